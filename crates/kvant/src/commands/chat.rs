//! `kvant chat`: an interactive conversation. Each turn re-renders the whole
//! conversation with the chat template; the session's KV cache keeps the
//! shared prefix, so only the new turn is computed.

use crate::args::ChatArgs;
use crate::ranks::{self, Run};
use anyhow::{Context, Result};
use kvant_engine::EngineRequest;
use kvant_model::chat::ChatMessage;
use std::io::{BufRead, Write};

pub fn run(a: ChatArgs) -> Result<()> {
    let Some(run) = ranks::start(&a.model, &a.parallel, a.model.load_options())? else {
        return Ok(());
    };
    let result = chat(&a, &run);
    run.finish(result)
}

fn chat(a: &ChatArgs, m: &Run) -> Result<()> {
    let template = m
        .chat_template
        .as_ref()
        .context("this checkpoint has no chat template, so it cannot chat; use `kvant generate`")?;
    let mut session = m.session(m.model.config().max_context)?;
    session.set_speculation(a.model.speculation());
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &a.system {
        messages.push(ChatMessage::new("system", s));
    }
    let params = a.sampling.params();
    eprintln!(
        "kvant chat: {} ({} layers, context {}). Type /exit to quit, /reset to start over.",
        m.info.architecture, m.info.layers, m.info.context_length
    );
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        eprint!("> ");
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let input = line.trim_end_matches(['\n', '\r']);
        match input.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages.truncate(usize::from(a.system.is_some()));
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::new("user", input));
        let text = template.render(&messages, true)?;
        let prompt_ids = m.tokenizer.encode(&text, false)?;
        let budget = session.capacity().saturating_sub(prompt_ids.len());
        let max_tokens = a.sampling.max_tokens.min(budget);
        let req = EngineRequest {
            stop: a.sampling.stop.clone(),
            ..EngineRequest::new(prompt_ids, max_tokens, params.clone())
        };
        let mut stdout = std::io::stdout();
        let out = match session.generate(&req, &mut |s| {
            let _ = stdout.write_all(s.as_bytes());
            let _ = stdout.flush();
        }) {
            Ok(out) => out,
            // A lost rank ends the run; anything else ends only the turn.
            Err(e) if e.is_communication() => return Err(e.into()),
            Err(e) => {
                messages.pop();
                eprintln!("kvant: {e}");
                continue;
            }
        };
        println!();
        messages.push(ChatMessage::new("assistant", out.text.trim()));
    }
    Ok(())
}
