//! `/v1/chat/completions` fields: the conversation (with tool turns),
//! `max_completion_tokens`, `logprobs`/`top_logprobs`, `tools` and
//! `tool_choice`, and the legacy `functions`, which this server does not
//! implement.

use super::{common, tools, Plan};
use crate::api::request::{ChatFields, CommonFields, MessageIn};
use crate::body::fields;
use crate::error::ApiError;
use crate::prompt::PromptInput;
use crate::state::AppState;
use crate::tools::ToolFormat;
use kvant_engine::serving::MAX_TOP_LOGPROBS;
use kvant_model::chat::ChatMessage;
use serde_json::Value;

pub fn parse(body: &Value, state: &AppState) -> Result<(PromptInput, Plan), ApiError> {
    let c: CommonFields = fields(body)?;
    let f: ChatFields = fields(body)?;
    let mut plan = common(c, state)?;
    unsupported_options(&f)?;
    if let Some(m) = f.max_completion_tokens {
        if m == 0 {
            return Err(ApiError::bad_param(
                "max_completion_tokens",
                "`max_completion_tokens` must be at least 1",
            ));
        }
        plan.max_tokens = Some(usize::try_from(m).unwrap_or(usize::MAX));
    }
    plan.logprobs = match (f.logprobs.unwrap_or(false), f.top_logprobs) {
        (false, None) => None,
        (false, Some(_)) => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                "`top_logprobs` needs `logprobs` set to true",
            ))
        }
        (true, k) => {
            let k = k.unwrap_or(0);
            if k > MAX_TOP_LOGPROBS as u64 {
                return Err(ApiError::bad_param(
                    "top_logprobs",
                    format!("`top_logprobs` must be at most {MAX_TOP_LOGPROBS}, got {k}"),
                ));
            }
            Some(k as usize)
        }
    };
    let tools = tools::tool_list(f.tools)?;
    let choice = tools::tool_choice(f.tool_choice)?;
    let format = state
        .chat_template()
        .and_then(|t| ToolFormat::of_template(t.source()));
    let tool_plan = tools::plan(tools.as_ref().map(|t| t.named.as_slice()), choice, format)?;
    let mut rendered = None;
    if let Some(tp) = tool_plan {
        if let Some(forced) = tp.forced {
            if let Some(g) = &plan.grammar {
                return Err(ApiError::bad_param(
                    g.param,
                    format!("`{}` and a `tool_choice` that demands a call cannot both constrain the output", g.param),
                ));
            }
            plan.grammar = Some(forced);
        }
        plan.tools = Some(tp.format);
        if tp.format.writes_control_tokens() {
            plan.skip_special_tokens = false;
        }
        rendered = tools.map(|t| t.rendered);
    }
    Ok((PromptInput::Chat(conversation(f.messages)?, rendered), plan))
}

/// `messages`: required, not empty, each a known role with text content.
pub fn conversation(messages: Option<Vec<MessageIn>>) -> Result<Vec<ChatMessage>, ApiError> {
    let messages =
        messages.ok_or_else(|| ApiError::bad_param("messages", "`messages` is required"))?;
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "`messages` must not be empty",
        ));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect()
}

/// The legacy `functions` API changes what the model must produce;
/// refusing it beats silently ignoring it (`tools` replaces it).
fn unsupported_options(f: &ChatFields) -> Result<(), ApiError> {
    // "none" and "auto" without functions both mean: answer in text.
    let no_call = |v: &Option<Value>| match v {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s == "none" || s == "auto",
        Some(_) => false,
    };
    if present(&f.functions) {
        return Err(ApiError::unsupported("functions"));
    }
    if !no_call(&f.function_call) {
        return Err(ApiError::unsupported("function_call"));
    }
    Ok(())
}

/// Whether an optional list-like field says something: not absent, null or `[]`.
fn present(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

/// One message: a known role and text content (a string or text parts).
fn message(i: usize, m: MessageIn) -> Result<ChatMessage, ApiError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let role = match m.role.as_str() {
        // Chat templates know "system"; "developer" is OpenAI's newer name for it.
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        "tool" => "tool",
        "function" => return Err(ApiError::unsupported(&at("role"))),
        other => {
            return Err(ApiError::bad_param(
                at("role"),
                format!("unknown role `{other}`: use system, developer, user or assistant"),
            ))
        }
    };
    let tool_calls = match (present(&m.tool_calls), m.tool_calls) {
        (true, Some(calls)) if role == "assistant" => {
            Some(tools::assistant_calls(calls, &at("tool_calls"))?)
        }
        (true, _) => {
            return Err(ApiError::bad_param(
                at("tool_calls"),
                "only assistant messages carry `tool_calls`",
            ))
        }
        (false, _) => None,
    };
    if role == "tool" && m.tool_call_id.is_none() {
        return Err(ApiError::bad_param(
            at("tool_call_id"),
            "a tool message needs the `tool_call_id` it answers",
        ));
    }
    if present(&m.function_call) {
        return Err(ApiError::unsupported(&at("function_call")));
    }
    let content = match m.content {
        Some(Value::String(s)) => s,
        // An assistant turn may carry no text (OpenAI sends null there).
        None | Some(Value::Null) if role == "assistant" => String::new(),
        Some(Value::Array(parts)) => text_parts(&parts, &at("content"))?,
        _ => {
            return Err(ApiError::bad_param(
                at("content"),
                "`content` must be a string or an array of text parts",
            ))
        }
    };
    let mut out = ChatMessage::new(role, content);
    out.tool_calls = tool_calls;
    if role == "tool" {
        out.tool_call_id = m.tool_call_id;
        out.name = m.name;
    }
    Ok(out)
}

/// `[{"type": "text", "text": ...}, ...]`, joined with newlines; at least
/// one part, as OpenAI requires (an empty array was taken as an empty
/// message and generated up to the context limit).
fn text_parts(parts: &[Value], param: &str) -> Result<String, ApiError> {
    if parts.is_empty() {
        return Err(ApiError::bad_param(
            param,
            "`content` must not be an empty array",
        ));
    }
    let texts = parts
        .iter()
        .enumerate()
        .map(|(j, p)| {
            let kind = p.get("type").and_then(Value::as_str);
            match (kind, p.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(t)) => Ok(t),
                (Some("text"), None) => Err(ApiError::bad_param(
                    format!("{param}[{j}].text"),
                    "a text part needs a string `text`",
                )),
                _ => Err(ApiError::bad_param(
                    format!("{param}[{j}].type"),
                    "only text content parts are supported",
                )),
            }
        })
        .collect::<Result<Vec<&str>, _>>()?;
    Ok(texts.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn msg(v: Value) -> Result<ChatMessage, ApiError> {
        let m: MessageIn = fields(&v)?;
        message(2, m)
    }

    #[test]
    fn messages_map_roles_and_content() {
        let m = msg(json!({"role": "developer", "content": "be brief"}));
        assert_eq!(m.ok(), Some(ChatMessage::new("system", "be brief")));
        let parts = json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]});
        assert_eq!(msg(parts).ok(), Some(ChatMessage::new("user", "a\nb")));
        let empty_reply = json!({"role": "assistant", "content": null, "tool_calls": []});
        assert_eq!(
            msg(empty_reply).ok(),
            Some(ChatMessage::new("assistant", ""))
        );
    }

    #[test]
    fn bad_messages_name_the_field() {
        let cases = [
            (
                json!({"role": "wizard", "content": "x"}),
                "messages[2].role",
            ),
            (
                json!({"role": "user", "content": null}),
                "messages[2].content",
            ),
            (json!({"role": "user", "content": 5}), "messages[2].content"),
            (
                json!({"role": "user", "content": []}),
                "messages[2].content",
            ),
            (
                json!({"role": "assistant", "content": []}),
                "messages[2].content",
            ),
            (
                json!({"role": "user", "content": [{"type": "image_url"}]}),
                "messages[2].content[0].type",
            ),
            (
                json!({"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}),
                "messages[2].tool_calls[0].function",
            ),
            (
                json!({"role": "tool", "content": "x"}),
                "messages[2].tool_call_id",
            ),
            (
                json!({"role": "function", "content": "x"}),
                "messages[2].role",
            ),
        ];
        for (v, param) in cases {
            let e = msg(v.clone()).err();
            assert_eq!(e.and_then(|e| e.param).as_deref(), Some(param), "{v}");
        }
    }

    #[test]
    fn unsupported_options_are_refused_by_name() {
        let parse = |v: Value| fields::<ChatFields>(&v).and_then(|f| unsupported_options(&f));
        assert!(parse(json!({"tools": [{"type": "function"}], "tool_choice": "required"})).is_ok());
        let cases = [
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (json!({"function_call": {"name": "f"}}), "function_call"),
        ];
        for (v, param) in cases {
            let e = parse(v.clone()).err();
            assert_eq!(e.and_then(|e| e.param).as_deref(), Some(param), "{v}");
        }
    }
}
