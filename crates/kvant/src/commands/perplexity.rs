//! `kvant perplexity`: the file is tokenized once (BOS first if the model
//! uses one) and cut into consecutive non-overlapping windows of `--ctx`
//! tokens; a last window under 2 tokens is dropped. Every token of a window
//! after its first is predicted from its prefix within the window, and
//! PPL = exp(mean negative log-likelihood over all predicted tokens).

use super::input::read_utf8;
use crate::args::PerplexityArgs;
use crate::ranks::{self, Run};
use anyhow::{bail, Result};
use kvant_engine::cluster::{Row, Want};
use kvant_kernels::softmax::log_sum_exp;
use std::time::Instant;

/// Tokens per forward pass inside a window: bounds the `[n, vocab]` logits.
const CHUNK: usize = 128;

pub fn run(a: PerplexityArgs) -> Result<()> {
    let text = read_utf8(&a.file)?;
    let Some(run) = ranks::start(&a.model, &a.parallel, a.model.load_options())? else {
        return Ok(());
    };
    let result = perplexity(&a, &run, &text);
    run.finish(result)
}

fn perplexity(a: &PerplexityArgs, m: &Run, text: &str) -> Result<()> {
    if a.ctx < 2 || a.ctx > m.model.config().max_context {
        bail!(
            "--ctx must be between 2 and the model's context length {}",
            m.model.config().max_context
        );
    }
    let ids = m.tokenizer.encode(text, true)?;
    let vocab = m.model.config().vocab;
    let mut cache = m.cache(a.ctx)?;
    let (mut nll, mut scored, mut windows) = (0f64, 0usize, 0usize);
    let t0 = Instant::now();
    for window in ids.chunks(a.ctx).filter(|w| w.len() >= 2) {
        m.truncate(&mut cache, 0)?;
        windows += 1;
        let mut pos = 0;
        for chunk in window.chunks(CHUNK) {
            let rows = m.forward(&mut cache, chunk, Want::All)?;
            for (i, row) in rows.iter().enumerate() {
                let Some(&target) = window.get(pos + i + 1) else {
                    break;
                };
                let Row::Logits(row) = row else {
                    bail!("the forward pass returned no logits row");
                };
                let Some(&logit) = row.get(target as usize) else {
                    bail!("token id {target} is outside the model's vocabulary of {vocab}");
                };
                nll += log_sum_exp(row) - logit as f64;
                scored += 1;
            }
            pos += chunk.len();
        }
    }
    if scored == 0 {
        bail!("the file has fewer than 2 tokens: nothing to score");
    }
    let ppl = (nll / scored as f64).exp();
    let secs = t0.elapsed().as_secs_f64();
    // Every token of a window is computed: the scored ones plus its first.
    let tps = (scored + windows) as f64 / secs.max(1e-9);
    if a.json {
        println!(
            "{}",
            serde_json::json!({"ppl": ppl, "tokens_scored": scored, "windows": windows, "tokens_per_s": tps})
        );
    } else {
        println!("perplexity {ppl:.4} over {scored} predicted tokens in {windows} windows of ≤{} ({tps:.1} tokens/s)", a.ctx);
    }
    Ok(())
}
