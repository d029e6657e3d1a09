//! `kvant generate`.

use super::input::read_utf8;
use crate::args::GenerateArgs;
use crate::ranks::{self, Run};
use anyhow::{Context, Result};
use kvant_engine::continuation::MIN_TOKENS;
use kvant_engine::EngineRequest;
use kvant_model::chat::ChatMessage;
use std::io::Write;

pub fn run(a: GenerateArgs) -> Result<()> {
    let prompt = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_utf8(f)?,
        (None, None) => anyhow::bail!("give --prompt or --prompt-file"),
    };
    let Some(run) = ranks::start(&a.model, &a.parallel, a.model.load_options())? else {
        return Ok(());
    };
    let result = generate(&a, &run, prompt);
    run.finish(result)
}

fn generate(a: &GenerateArgs, m: &Run, prompt: String) -> Result<()> {
    let (text, add_special) = if a.chat {
        let t = m
            .chat_template
            .as_ref()
            .context("this checkpoint has no chat template; drop --chat")?;
        let msgs = [ChatMessage::new("user", &prompt)];
        // The rendered template carries its own BOS when the model wants one.
        (t.render(&msgs, true)?, false)
    } else {
        (prompt, true)
    };
    let prompt_ids = m.tokenizer.encode(&text, add_special)?;
    let req = EngineRequest {
        stop: a.sampling.stop.clone(),
        ignore_eos: a.ignore_eos,
        ..EngineRequest::new(prompt_ids, a.sampling.max_tokens, a.sampling.params())
    };
    // Room for the prompt and the output (at least one token is generated,
    // so `--max-tokens 0` is not mistaken for an overlong prompt).
    let capacity = req.prompt_ids.len() + req.max_tokens.max(MIN_TOKENS);
    let mut session = m.session(capacity)?;
    session.set_speculation(a.model.speculation());
    let stdout = std::io::stdout();
    let mut on_text = |s: &str| {
        if !a.json {
            let mut lock = stdout.lock();
            let _ = lock.write_all(s.as_bytes());
            let _ = lock.flush();
        }
    };
    let out = session.generate(&req, &mut on_text)?;
    if a.json {
        let per_s = |n: usize, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        let obj = serde_json::json!({
            "text": out.text,
            "token_ids": out.token_ids,
            "prompt_token_ids": req.prompt_ids,
            "prompt_tokens": req.prompt_ids.len(),
            "completion_tokens": out.token_ids.len(),
            "finish_reason": out.finish_reason.as_str(),
            "prefill_tokens_per_s": per_s(out.prefill_tokens, out.prefill_secs),
            // Tokens after the first, over the time after the prompt
            // (a speculative step yields up to two).
            "decode_tokens_per_s": per_s(out.token_ids.len().saturating_sub(1), out.decode_secs),
            "decode_steps": out.decode_steps,
            "mtp_drafted": out.drafted,
            "mtp_accepted": out.accepted,
        });
        println!("{obj}");
    } else {
        println!();
    }
    Ok(())
}
