//! A request's grammar → the engine's constraint, compiled on tokio's
//! blocking pool (a large schema takes milliseconds) against the model's
//! grammar tables, which are built on first use and then shared.

use crate::error::ApiError;
use crate::validate::format::OutputGrammar;
use kvant_engine::grammar::{Constraint, GrammarCompiler, GrammarError};
use kvant_model::tokenizer::Tokenizer;
use std::sync::{Arc, OnceLock};

/// The compiled constraint of `grammar` against the model's `tables`,
/// fresh for one request (each choice takes a clone). A grammar that does
/// not compile is a 400 naming the field it came from.
pub async fn compile(
    tables: Arc<GrammarTables>,
    grammar: Option<&OutputGrammar>,
) -> Result<Option<Constraint>, ApiError> {
    let Some(g) = grammar.cloned() else {
        return Ok(None);
    };
    tokio::task::spawn_blocking(move || {
        let compiler = tables
            .get()
            .map_err(|e| ApiError::internal(e.to_string()))?;
        compiler.compile(&g.grammar).map(Some).map_err(|e| match e {
            GrammarError::Compile(msg) => {
                ApiError::bad_param(g.param, format!("cannot compile `{}`: {msg}", g.param))
            }
            other => ApiError::internal(other.to_string()),
        })
    })
    .await
    .map_err(|e| ApiError::internal(format!("compiling the grammar failed: {e}")))?
}

/// The model's grammar compiler, built the first time a request needs it
/// (walking the vocabulary once: tens of milliseconds for 49k tokens), so a
/// server that never sees a constrained request never pays for it.
pub struct GrammarTables {
    tokenizer: Arc<Tokenizer>,
    compiler: OnceLock<Result<GrammarCompiler, GrammarError>>,
}

impl GrammarTables {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        GrammarTables {
            tokenizer,
            compiler: OnceLock::new(),
        }
    }

    /// Blocks while the first caller builds the tables.
    pub fn get(&self) -> Result<&GrammarCompiler, &GrammarError> {
        self.compiler
            .get_or_init(|| GrammarCompiler::new(&self.tokenizer))
            .as_ref()
    }
}
