//! What the tests of hostile checkpoints share: an error must name what is
//! wrong, and every case must also pass inside a small address space (an
//! allocation sized by a hostile header field fails there, not later).

#![allow(dead_code)] // each test binary uses its own part

use std::fmt::Display;

/// The error of `r`, whose message contains every `needle`; `opened`
/// describes what was wrongly opened when `r` is not an error.
#[track_caller]
pub fn err_naming<T, E: Display>(
    r: Result<T, E>,
    opened: impl FnOnce(T) -> String,
    needles: &[&str],
) -> E {
    let err = match r {
        Ok(t) => panic!("{}", opened(t)),
        Err(e) => e,
    };
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "{msg:?} lacks {n:?}");
    }
    err
}

/// Reruns this test binary, all but the test calling this (whose name
/// contains `under_a_small`), under `ulimit -v kib` (with
/// `KVANT_UNDER_ULIMIT` set, which makes that test return at once).
/// Returns at once when already under the limit.
pub fn rerun_under_address_limit(kib: u64) {
    if std::env::var_os("KVANT_UNDER_ULIMIT").is_some() {
        return;
    }
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {kib} && exec \"$0\" --skip under_a_small --test-threads 2"
        ))
        .arg(std::env::current_exe().expect("the test binary"))
        .env("KVANT_UNDER_ULIMIT", "1")
        .output()
        .expect("run the test binary again");
    assert!(
        out.status.success(),
        "hostile tests failed under `ulimit -v {kib}` ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
