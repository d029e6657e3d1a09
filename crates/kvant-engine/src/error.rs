//! The engine's error type.

use crate::cluster::wire::WireError;
use crate::continuation::ContinuationError;
use crate::grammar::GrammarError;
use crate::sampling::SamplingError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens but the context holds {context} (prompt and at least one generated token must fit)")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("sampling: {0}")]
    Sampling(#[from] SamplingError),
    /// Boxed: model errors carry names and shapes, and would bloat every
    /// `Result` on the decode path.
    #[error(transparent)]
    Model(Box<kvant_model::ModelError>),
    #[error("engine configuration: {0}")]
    Config(String),
    #[error("the engine thread stopped unexpectedly")]
    EngineStopped,
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] kvant_model::tokenizer::TokenizerError),
    #[error(transparent)]
    Dist(#[from] kvant_dist::DistError),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("grammar: {0}")]
    Grammar(#[from] GrammarError),
}

impl From<ContinuationError> for EngineError {
    fn from(e: ContinuationError) -> Self {
        match e {
            ContinuationError::Sampling(e) => e.into(),
            ContinuationError::Grammar(e) => e.into(),
            ContinuationError::Tokenizer(e) => e.into(),
        }
    }
}

impl From<kvant_model::ModelError> for EngineError {
    fn from(e: kvant_model::ModelError) -> Self {
        EngineError::Model(Box::new(e))
    }
}

impl EngineError {
    /// Whether this comes from the communication of a parallel run (a rank
    /// that died, hangs or aborted): the run cannot go on.
    pub fn is_communication(&self) -> bool {
        match self {
            EngineError::Dist(e) => e.is_communication(),
            EngineError::Model(m) => m.is_communication(),
            _ => false,
        }
    }
}
