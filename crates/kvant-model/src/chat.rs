//! Chat templates: the checkpoint's Jinja template rendered with minijinja the way transformers'
//! `apply_chat_template` renders it, so a prompt is byte-for-byte the one the model was tuned on.
//!
//! That means: `trim_blocks` and `lstrip_blocks` on, loop controls (`{% break %}`), Python string
//! and dict methods (`.strip()`, `.startswith()`, `.items()`, via minijinja-contrib's pycompat),
//! `raise_exception(msg)`, `strftime_now(fmt)`, a Python-compatible `tojson`, and the variables
//! `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools` and `documents` (none).
//! The template comes from a checkpoint file, so rendering is bounded in instructions and output.

mod literal;
mod strftime;
mod tojson;

pub use literal::ConversationError;

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind, State};
use std::io;

/// One turn of a conversation, as templates see it (transformers' message dicts).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's tool calls: `{"id", "type": "function", "function": {"name",
    /// "arguments"}}` with the arguments as a JSON object, as templates expect them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` turn: the call it answers, and the function's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("the chat template does not parse: {0}")]
    Syntax(#[source] Error),
    /// The template called `raise_exception`, e.g. because roles do not alternate.
    #[error("the chat template rejects this conversation: {0}")]
    Raised(String),
    #[error("the chat template failed: {0}")]
    Render(#[source] Error),
    /// transformers refuses to render an empty conversation; so does kvant.
    #[error("cannot apply a chat template to an empty conversation")]
    EmptyConversation,
    #[error("the chat template's output exceeds {limit} bytes")]
    OutputTooLarge { limit: usize },
}

/// Template instructions one render may execute: far beyond any real conversation, small enough
/// that a looping template fails within seconds.
const RENDER_FUEL: u64 = 20_000_000;
/// Largest rendered prompt, in bytes.
const MAX_OUTPUT_BYTES: usize = 64 << 20;
const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template plus the special-token spellings it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's text, for callers that recognise a model family by it.
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token`/`eos_token` are the tokens' text (e.g. "<|im_start|>");
    /// an absent one is undefined in the template, as in transformers.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(python_method);
        env.add_filter("tojson", tojson::tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(ChatError::Syntax)?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token,
            eos_token,
        })
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt for `messages`; with `add_generation_prompt` it ends where the assistant's
    /// reply begins.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with_tools(messages, add_generation_prompt, None)
    }

    /// As [`ChatTemplate::render`], with the functions the model may call: a list of
    /// `{"type": "function", "function": {"name", "description", "parameters"}}` (the `tools`
    /// of transformers' `apply_chat_template`).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, ChatError> {
        if messages.is_empty() {
            return Err(ChatError::EmptyConversation);
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(ChatError::Render)?;
        let mut ctx = vec![
            ("messages", Value::from_serialize(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            (
                "tools",
                tools.map_or(Value::from(()), Value::from_serialize),
            ),
            ("documents", Value::from(())),
        ];
        if let Some(bos) = &self.bos_token {
            ctx.push(("bos_token", Value::from(bos.as_str())));
        }
        if let Some(eos) = &self.eos_token {
            ctx.push(("eos_token", Value::from(eos.as_str())));
        }
        let ctx: Value = ctx.into_iter().collect();
        let mut out = BoundedOutput::default();
        if let Err(e) = template.render_captured_to(ctx, &mut out) {
            return Err(if out.overflowed {
                ChatError::OutputTooLarge {
                    limit: MAX_OUTPUT_BYTES,
                }
            } else {
                match raised_message(&e) {
                    Some(message) => ChatError::Raised(message),
                    None => ChatError::Render(e),
                }
            });
        }
        // minijinja writes whole `str` fragments, so this is valid UTF-8.
        Ok(String::from_utf8_lossy(&out.bytes).into_owned())
    }
}

/// minijinja-contrib's Python string and dict methods, except that `str.find`/`str.rfind` count
/// characters as Python does (pycompat returns byte offsets, wrong for non-ASCII text).
fn python_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let (Some(haystack), "find" | "rfind", [needle]) = (value.as_str(), method, args) {
        if let Some(needle) = needle.as_str() {
            let at = if method == "find" {
                haystack.find(needle)
            } else {
                haystack.rfind(needle)
            };
            let chars_before = |byte: usize| haystack.get(..byte).map_or(0, |p| p.chars().count());
            return Ok(Value::from(at.map_or(-1, |b| chars_before(b) as i64)));
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// The error `raise_exception` attaches, found again in the render error's source chain.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Raised(String);

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn raised_message(error: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<Raised>() {
            return Some(raised.0.clone());
        }
        source = e.source();
    }
    None
}

/// transformers formats the local time; kvant formats UTC so that output does not depend on
/// the machine's time zone.
fn strftime_now(format: String) -> Result<String, Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    strftime::format_utc(&format, now)
}

/// Collects the output, failing the render once it passes `MAX_OUTPUT_BYTES`.
#[derive(Default)]
struct BoundedOutput {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.bytes.len().saturating_add(buf.len()) > MAX_OUTPUT_BYTES {
            self.overflowed = true;
            return Err(io::Error::other("chat template output too large"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
