//! Constrained decoding: a grammar (a JSON schema, a regular expression or
//! a Lark grammar) turned into a per-sequence token mask applied to the
//! logits before each sample, so the output always matches it.
//!
//! The grammar engine is `llguidance` (the one llama.cpp, vLLM and SGLang
//! use): a [`GrammarCompiler`] holds its token trie, built once per
//! tokenizer from the bytes each token stands for, and compiles each
//! request's grammar into a [`Constraint`]. The constraint computes the set
//! of tokens that keep the output inside the grammar (an Earley parser over
//! the trie, typically tens of microseconds per token), and is told each
//! sampled token. When the grammar is complete only end-of-sequence tokens
//! are allowed; a grammar that admits nothing more ends the sequence.

use kvant_model::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::Arc;
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// A JSON schema; `{"type": "object"}` is any JSON object.
    JsonSchema(Value),
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GrammarError {
    #[error("the tokenizer has no end-of-sequence token, so a constrained output could not end")]
    NoEos,
    #[error("cannot build the grammar engine's token table: {0}")]
    Setup(String),
    #[error("{0}")]
    Compile(String),
    #[error("the grammar rejected token {token}: {reason}")]
    Rejected { token: u32, reason: String },
}

/// Compiles grammars against one tokenizer's vocabulary. Building it walks
/// the vocabulary once (a few hundred milliseconds for 150k tokens); make
/// one per model and share it.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab: usize,
}

impl GrammarCompiler {
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, GrammarError> {
        let eos = tokenizer.eos_ids();
        let &first_eos = eos.first().ok_or(GrammarError::NoEos)?;
        let vocab = tokenizer.vocab_size();
        // Control tokens are written as the trie expects them: a 0xFF
        // marker and their spelling, which no grammar over text produces.
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tokenizer.token_bytes(id) {
                Some((b, false)) => b.to_vec(),
                Some((b, true)) => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], b].concat(),
                None => Vec::new(),
            })
            .collect();
        let info = TokRxInfo::new(vocab as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        // Greedy tokenization serves only forced text, which a mask never needs.
        let env: Arc<dyn TokenizerEnv + Sync> = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Setup(e.to_string()))?;
        // Warnings and errors come back to the caller, never to stderr.
        factory.quiet();
        Ok(GrammarCompiler { factory, vocab })
    }

    /// A fresh constraint for one sequence. A grammar the engine cannot
    /// compile (bad syntax, an unsupported schema keyword, a schema no
    /// value satisfies) is an error naming the problem.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, GrammarError> {
        let top = match grammar {
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(json_layout(schema)),
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| GrammarError::Compile(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Compile(e));
        }
        Ok(Constraint {
            matcher,
            vocab: self.vocab,
        })
    }
}

/// JSON without a layout of its own is written as Python's `json.dumps`
/// writes it (", " and ": ", no newlines): a free choice of whitespace lets
/// a sampled model emit blank lines until it runs out of tokens, which
/// vLLM's `disable-any-whitespace` exists to prevent. A schema that sets
/// llguidance's own `x-guidance` options keeps them. (A Lark grammar's
/// `%json {...}` takes the same options: pass its schema through this.)
pub fn json_layout(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// One sequence's place in its grammar.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    /// Tokens the trie covers; higher logit rows (padding) are never allowed.
    vocab: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Sets the logit of every token the grammar does not allow next to
    /// −∞. `logits` is one row over the model's vocabulary.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Compile(e.to_string()))?;
        let words = allowed.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = match words.get(w) {
                Some(&b) if w * 32 < self.vocab => b,
                _ => 0,
            };
            if bits == u32::MAX && chunk.len() == 32 {
                continue;
            }
            for (j, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << j) == 0 || w * 32 + j >= self.vocab {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    /// Moves past `token`, which [`Constraint::mask`] allowed. Returns
    /// whether the grammar is now complete and admits nothing more.
    pub fn commit(&mut self, token: u32) -> Result<bool, GrammarError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Rejected {
                token,
                reason: e.to_string(),
            })?;
        Ok(self.matcher.is_stopped())
    }

    /// Whether end-of-sequence is allowed now: the output so far is a
    /// complete match.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_added_unless_the_schema_sets_its_own() {
        let s = json_layout(&serde_json::json!({"type": "object"}));
        assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
        let own = serde_json::json!({"type": "object", "x-guidance": {"lenient": true}});
        assert_eq!(json_layout(&own), own);
    }
}
