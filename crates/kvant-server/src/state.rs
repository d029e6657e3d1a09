//! What every handler shares: the engine handle, the tokenizer and chat
//! template that turn requests into prompts, and the server's settings.

use crate::constrain::GrammarTables;
use crate::cors::AllowedOrigins;
use kvant_engine::serving::{EngineConfig, EngineHandle, Pooling};
use kvant_model::chat::ChatTemplate;
use kvant_model::tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Settings of the HTTP layer.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model name clients ask for (requests without `model` are accepted too).
    pub model_name: String,
    /// When set, `/v1/*` requires `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// How long a shutdown lets requests in flight finish before aborting them.
    pub shutdown_grace: Duration,
    /// Read control tokens (`<|im_start|>`) out of chat message contents, as
    /// the rendered template's own; off, they are plain text and a user
    /// cannot forge a turn.
    pub parse_special_in_content: bool,
    /// Browser origins answered with CORS headers; `None`: none.
    pub allowed_origins: Option<AllowedOrigins>,
    /// How `/v1/embeddings` pools a prompt's hidden states.
    pub pooling: Pooling,
}

impl ServerConfig {
    pub fn new(model_name: impl Into<String>) -> Self {
        ServerConfig {
            model_name: model_name.into(),
            api_key: None,
            shutdown_grace: Duration::from_secs(10),
            parse_special_in_content: false,
            allowed_origins: None,
            pooling: Pooling::Last,
        }
    }
}

pub struct AppState {
    engine: EngineHandle,
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<Arc<ChatTemplate>>,
    grammar_tables: Arc<GrammarTables>,
    config: ServerConfig,
    /// Prompt plus output tokens one sequence may hold: the smaller of the
    /// context and the KV pool, so a default `max_tokens` always fits.
    max_sequence_tokens: usize,
    /// Unix seconds at start-up: the model's `created` time.
    created: u64,
}

impl AppState {
    /// `engine` must have been started with `engine_config` (whose pool size
    /// bounds the default `max_tokens`) over the model `tokenizer` belongs to.
    pub fn new(
        engine: EngineHandle,
        engine_config: &EngineConfig,
        tokenizer: Arc<Tokenizer>,
        chat_template: Option<Arc<ChatTemplate>>,
        config: ServerConfig,
    ) -> Self {
        let pool_tokens = engine_config
            .kv_blocks
            .saturating_mul(engine_config.block_size);
        AppState {
            max_sequence_tokens: engine.context_length().min(pool_tokens),
            engine,
            grammar_tables: Arc::new(GrammarTables::new(Arc::clone(&tokenizer))),
            tokenizer,
            chat_template,
            config,
            created: unix_now(),
        }
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    pub(crate) fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub(crate) fn chat_template(&self) -> Option<&Arc<ChatTemplate>> {
        self.chat_template.as_ref()
    }

    pub(crate) fn grammar_tables(&self) -> Arc<GrammarTables> {
        Arc::clone(&self.grammar_tables)
    }

    pub(crate) fn max_sequence_tokens(&self) -> usize {
        self.max_sequence_tokens
    }

    pub(crate) fn created(&self) -> u64 {
        self.created
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
