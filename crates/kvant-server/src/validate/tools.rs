//! `tools`, `tool_choice`, and the tool turns of a conversation (assistant
//! `tool_calls`, `tool` messages) → what the template renders, how the
//! output is read back, and the grammar when a call is demanded.

use super::format::OutputGrammar;
use crate::error::ApiError;
use crate::tools::ToolFormat;
use serde_json::{json, Value};

/// What a request with tools needs beyond its prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolPlan {
    /// Read each choice's calls back in this format.
    pub format: ToolFormat,
    /// `tool_choice` `required` or a named function: the grammar that makes
    /// the output exactly one such call.
    pub forced: Option<OutputGrammar>,
}

/// A request's tools.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// The list for the template, as sent.
    pub rendered: Value,
    /// Each function's name and parameter schema.
    pub named: Vec<(String, Value)>,
}

/// The request's tools, checked: `[{"type": "function", "function": {"name",
/// "description"?, "parameters"?}}]`. Returns the list for the template
/// (as sent) and each (name, parameter schema; none given: no parameters).
pub fn tool_list(v: Option<Value>) -> Result<Option<Tools>, ApiError> {
    let items = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) if a.is_empty() => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::bad_param("tools", "`tools` must be an array")),
    };
    let mut rendered = Vec::with_capacity(items.len());
    let mut named: Vec<(String, Value)> = Vec::with_capacity(items.len());
    for (i, t) in items.into_iter().enumerate() {
        let at = |f: &str| format!("tools[{i}].{f}");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::bad_param(
                at("type"),
                "a tool's `type` must be \"function\"",
            ));
        }
        let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
            ApiError::bad_param(at("function"), "a tool needs a `function` object")
        })?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| valid_name(n))
            .ok_or_else(|| {
                ApiError::bad_param(
                    at("function.name"),
                    "a function name is 1-64 characters of a-z, A-Z, 0-9, _ and -",
                )
            })?
            .to_string();
        if named.iter().any(|(n, _)| *n == name) {
            return Err(ApiError::bad_param(
                at("function.name"),
                format!("two tools are named `{name}`"),
            ));
        }
        let params = match f.get("parameters") {
            // No parameters: the call takes none.
            None | Some(Value::Null) => {
                json!({"type": "object", "properties": {}, "additionalProperties": false})
            }
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(ApiError::bad_param(
                    at("function.parameters"),
                    "`parameters` must be a JSON schema object",
                ))
            }
        };
        // The template sees the tool as sent (key order included), as
        // transformers renders the Python dict it is given.
        rendered.push(t.clone());
        named.push((name, params));
    }
    Ok(Some(Tools {
        rendered: Value::Array(rendered),
        named,
    }))
}

fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

pub fn tool_choice(v: Option<Value>) -> Result<Option<ToolChoice>, ApiError> {
    let bad = || {
        ApiError::bad_param(
            "tool_choice",
            "`tool_choice` must be \"none\", \"auto\", \"required\" or \
             {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )
    };
    Ok(Some(match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(bad()),
        },
        Some(o @ Value::Object(_)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(bad)?;
            ToolChoice::Named(name.to_string())
        }
        Some(_) => return Err(bad()),
    }))
}

/// The plan for `tools` and `tool_choice` with a template of `format`
/// (`None`: the template writes no tool calls this server can read), and
/// whether the template gets the tools. `tool_choice: "none"` renders no
/// tools, so the model answers in text.
pub fn plan(
    tools: Option<&[(String, Value)]>,
    choice: Option<ToolChoice>,
    format: Option<ToolFormat>,
) -> Result<Option<ToolPlan>, ApiError> {
    let Some(tools) = tools else {
        return match choice {
            None | Some(ToolChoice::None | ToolChoice::Auto) => Ok(None),
            Some(_) => Err(ApiError::bad_param(
                "tool_choice",
                "`tool_choice` asks for a call, but the request has no `tools`",
            )),
        };
    };
    let choice = choice.unwrap_or(ToolChoice::Auto);
    if choice == ToolChoice::None {
        return Ok(None);
    }
    let format = format.ok_or_else(|| {
        ApiError::bad_param(
            "tools",
            "this model's chat template writes no tool calls that this server can read back \
             (supported: Hermes <tool_call>, Llama 3 JSON with <|python_tag|>, Mistral [TOOL_CALLS])",
        )
    })?;
    let forced = match &choice {
        ToolChoice::Required => Some(format.forced_call(tools)),
        ToolChoice::Named(name) => {
            let one: Vec<(String, Value)> =
                tools.iter().filter(|(n, _)| n == name).cloned().collect();
            if one.is_empty() {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not among the tools"),
                ));
            }
            Some(format.forced_call(&one))
        }
        _ => None,
    };
    Ok(Some(ToolPlan {
        format,
        forced: forced.map(|grammar| OutputGrammar {
            param: "tool_choice",
            grammar,
        }),
    }))
}

/// An assistant turn's `tool_calls` as templates expect them: arguments as
/// a JSON object, not OpenAI's string.
pub fn assistant_calls(v: Value, at: &str) -> Result<Vec<Value>, ApiError> {
    let Value::Array(calls) = v else {
        return Err(ApiError::bad_param(at, "`tool_calls` must be an array"));
    };
    calls
        .into_iter()
        .enumerate()
        .map(|(j, c)| {
            let at = format!("{at}[{j}]");
            let f = c.get("function").filter(|f| f.is_object()).ok_or_else(|| {
                ApiError::bad_param(format!("{at}.function"), "a tool call needs a `function`")
            })?;
            let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad_param(format!("{at}.function.name"), "a tool call needs a name")
            })?;
            let arguments = match f.get("arguments") {
                None | Some(Value::Null) => json!({}),
                Some(Value::String(s)) => serde_json::from_str::<Value>(s).map_err(|e| {
                    ApiError::bad_param(
                        format!("{at}.function.arguments"),
                        format!("the arguments are not JSON: {e}"),
                    )
                })?,
                Some(o @ Value::Object(_)) => o.clone(),
                Some(_) => {
                    return Err(ApiError::bad_param(
                        format!("{at}.function.arguments"),
                        "`arguments` must be a JSON string",
                    ))
                }
            };
            let mut call =
                json!({"type": "function", "function": {"name": name, "arguments": arguments}});
            if let Some(id) = c.get("id").and_then(Value::as_str) {
                call["id"] = json!(id);
            }
            Ok(call)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "description": "d",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "noop"}}])
    }

    #[test]
    fn tools_and_choices_parse_or_name_the_field() {
        let Tools { rendered, named } = tool_list(Some(tools())).ok().flatten().expect("tools");
        assert_eq!(named.len(), 2);
        assert_eq!(rendered, tools());
        assert_eq!(named[1].1["additionalProperties"], false);
        let bad = [
            (json!({}), "tools"),
            (json!([{"type": "code"}]), "tools[0].type"),
            (json!([{"type": "function"}]), "tools[0].function"),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                "tools[0].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]),
                "tools[1].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "parameters": 3}}]),
                "tools[0].function.parameters",
            ),
        ];
        for (v, param) in bad {
            let e = tool_list(Some(v.clone())).err();
            assert_eq!(e.and_then(|e| e.param).as_deref(), Some(param), "{v}");
        }
        assert_eq!(
            tool_choice(Some(json!("required"))).ok().flatten(),
            Some(ToolChoice::Required)
        );
        assert_eq!(
            tool_choice(Some(json!({"type": "function", "function": {"name": "f"}})))
                .ok()
                .flatten(),
            Some(ToolChoice::Named("f".into()))
        );
        assert!(tool_choice(Some(json!("sometimes"))).is_err());
    }

    #[test]
    fn plans_follow_the_choice() {
        let named = tool_list(Some(tools()))
            .ok()
            .flatten()
            .expect("tools")
            .named;
        let hermes = Some(ToolFormat::Hermes);
        assert_eq!(plan(None, None, hermes).ok(), Some(None));
        assert!(plan(None, Some(ToolChoice::Required), hermes).is_err());
        assert_eq!(
            plan(Some(&named), Some(ToolChoice::None), hermes).ok(),
            Some(None)
        );
        let auto = plan(Some(&named), None, hermes)
            .ok()
            .flatten()
            .expect("a plan");
        assert_eq!(auto.forced, None);
        let forced = plan(Some(&named), Some(ToolChoice::Named("noop".into())), hermes)
            .ok()
            .flatten()
            .expect("a plan");
        assert_eq!(forced.forced.map(|g| g.param), Some("tool_choice"));
        let e = plan(Some(&named), Some(ToolChoice::Named("nope".into())), hermes).err();
        assert_eq!(e.and_then(|e| e.param).as_deref(), Some("tool_choice"));
        let e = plan(Some(&named), None, None).err();
        assert_eq!(e.and_then(|e| e.param).as_deref(), Some("tools"));
    }

    #[test]
    fn assistant_calls_get_object_arguments() {
        let calls = json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]);
        let out = assistant_calls(calls, "messages[1].tool_calls").expect("calls");
        assert_eq!(out[0]["function"]["arguments"], json!({"x": 1}));
        assert_eq!(out[0]["id"], "c1");
        let bad = json!([{"function": {"name": "f", "arguments": "{oops"}}]);
        let e = assistant_calls(bad, "messages[1].tool_calls").err();
        assert_eq!(
            e.and_then(|e| e.param).as_deref(),
            Some("messages[1].tool_calls[0].function.arguments")
        );
    }
}
