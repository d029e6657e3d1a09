//! `kvant serve` and its signals, as a process: the first SIGINT drains the
//! requests in flight for `--shutdown-grace`, a second one aborts them.

mod common;

use common::fixture;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn sigint(child: &Child) {
    let ok = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -INT {}", child.id());
}

#[test]
fn a_second_sigint_cuts_the_grace_period_short() {
    let model = fixture("models/llama-gqa");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvant"))
        .args(["serve", "--model"])
        .arg(&model)
        .args([
            "--port",
            "0",
            "--shutdown-grace",
            "300",
            "--threads",
            "1",
            "--ctx-size",
            "65536",
        ])
        .env_remove("KVANT_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvant serve");
    let mut ready = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut ready)
        .expect("ready line");
    let addr = ready
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {ready:?}"))
        .to_string();
    // Streams that run for far longer than the test waits: 16 choices of
    // 65000 tokens on one thread.
    let body =
        r#"{"prompt": "a", "n": 16, "max_tokens": 65000, "ignore_eos": true, "stream": true}"#;
    let mut s = TcpStream::connect(&addr).expect("connect");
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("request");
    let mut first = [0u8; 256];
    let n = s.read(&mut first).expect("first bytes");
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));

    sigint(&child);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        child.try_wait().expect("wait").is_none(),
        "one SIGINT drains: the streams still run"
    );
    let t = Instant::now();
    sigint(&child);
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        // Draining alone would take minutes (16 × 65000 tokens).
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("still running 20 s after the second SIGINT");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    // The aborted stream still ends properly.
    let mut rest = Vec::new();
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = s.read_to_end(&mut rest);
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains(r#""finish_reason":"abort""#), "{rest}");
    assert!(rest.contains("data: [DONE]"));
}
