//! The engine's per-token log-probabilities in the two shapes OpenAI uses:
//! completions' parallel arrays and chat's list of token objects.
//!
//! Tokens are shown as their text pieces (e.g. " the"). A completion's
//! `text_offset` is the running length, in characters, of those pieces,
//! which is where each token's text starts in the output.

use crate::api::chat::{ChatLogprobs, ChatTokenLogprob, ChatTopLogprob};
use crate::api::completions::{CompletionLogprobs, TopLogprobMap};
use kvant_engine::serving::TokenLogprob;
use kvant_model::tokenizer::Tokenizer;

/// A token's text; empty for an id the tokenizer does not know (the engine
/// only produces ids inside the vocabulary).
fn piece(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.token_to_piece(id).unwrap_or_default()
}

/// Builds one choice's completion logprobs, token by token.
#[derive(Debug, Default)]
pub struct CompletionLogprobsBuilder {
    /// Characters of the pieces so far.
    offset: usize,
}

impl CompletionLogprobsBuilder {
    /// The entries of `tokens`, continuing from the tokens already seen.
    pub fn entries(
        &mut self,
        tokenizer: &Tokenizer,
        tokens: &[TokenLogprob],
    ) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for t in tokens {
            let text = piece(tokenizer, t.token);
            out.text_offset.push(self.offset);
            self.offset += text.chars().count();
            out.tokens.push(text);
            out.token_logprobs.push(t.logprob);
            let top = t
                .top
                .iter()
                .map(|&(id, lp)| (piece(tokenizer, id), lp))
                .collect();
            out.top_logprobs.push(TopLogprobMap(top));
        }
        out
    }
}

/// The bytes a token stands for, exact even where it ends inside a UTF-8
/// character (its text piece then shows U+FFFD, and these bytes let a client
/// join the pieces back into the real characters).
fn bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    tokenizer
        .token_bytes(id)
        .map_or_else(Vec::new, |(b, _)| b.to_vec())
}

/// Chat's logprobs of `tokens`.
pub fn chat(tokenizer: &Tokenizer, tokens: &[TokenLogprob]) -> ChatLogprobs {
    let content = tokens
        .iter()
        .map(|t| {
            let token = piece(tokenizer, t.token);
            ChatTokenLogprob {
                bytes: bytes(tokenizer, t.token),
                token,
                logprob: t.logprob,
                top_logprobs: t
                    .top
                    .iter()
                    .map(|&(id, logprob)| {
                        let token = piece(tokenizer, id);
                        ChatTopLogprob {
                            bytes: bytes(tokenizer, id),
                            token,
                            logprob,
                        }
                    })
                    .collect(),
            }
        })
        .collect();
    ChatLogprobs { content }
}
