//! `kvant quantize IN.gguf OUT.gguf --type q8_0|q4_0|q4_k`: the file's float
//! weight matrices quantized on every core, with a progress bar.

use crate::args::QuantizeArg;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::time::Instant;

pub fn run(input: &Path, output: &Path, kind: QuantizeArg) -> Result<()> {
    if input.is_dir() {
        bail!(
            "{} is a directory: `kvant quantize` reads a GGUF; load a Hugging Face checkpoint \
             with --quantize {} instead",
            input.display(),
            kind.name()
        );
    }
    if input == output {
        bail!("the output must be another file than the input");
    }
    let to = kind.dtype();
    let bar = crate::progress::counting(format!("quantizing to {}", kind.name()), "tensors");
    let started = Instant::now();
    let report = kvant_model::quantize::quantize_gguf(input, output, to, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| format!("quantizing {}", input.display()))?;
    bar.finish_and_clear();
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let fallback = match report.fallback {
        0 => String::new(),
        n => format!(" ({n} of them q5_0: rows not whole 256-value blocks)"),
    };
    println!(
        "{}: {} tensors quantized to {}{fallback}, {} copied; {:.1} MiB -> {:.1} MiB in {:.2} s",
        output.display(),
        report.quantized,
        kind.name(),
        report.kept,
        mib(report.bytes_in),
        mib(report.bytes_out),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
