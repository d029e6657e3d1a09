//! Tool calling: how a model family writes a call, reading the calls back
//! out of its output (whole, or while it streams), and the grammar that
//! makes a call certain when `tool_choice` demands one.
//!
//! The format is read off the chat template. Supported so far: Hermes
//! (Qwen 2.5/3, Hermes, SmolLM3 and most tool-tuned ChatML models), each
//! call `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
//! A template that renders `tools` in a format this server cannot parse
//! back is refused with a 400 rather than answered with unparsed text.

use crate::api::chat::{FunctionCall, ToolCall};
use kvant_engine::grammar::{json_layout, Grammar};
use serde_json::{json, Value};

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";

/// How a model family writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
}

impl ToolFormat {
    /// The format a chat template's text announces, if any.
    pub fn of_template(source: &str) -> Option<Self> {
        source.contains(HERMES_OPEN).then_some(ToolFormat::Hermes)
    }

    fn open(self) -> &'static str {
        match self {
            ToolFormat::Hermes => HERMES_OPEN,
        }
    }

    /// A grammar for output that is exactly one call of one of `tools`
    /// (each name and parameter schema), its arguments valid against the
    /// function's parameter schema, laid out as `json.dumps` writes JSON.
    pub fn forced_call(self, tools: &[(String, Value)]) -> Grammar {
        let calls: Vec<Value> = tools
            .iter()
            .map(|(name, params)| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = json_layout(&match calls.len() {
            1 => calls.into_iter().next().unwrap_or(Value::Null),
            _ => json!({ "anyOf": calls }),
        });
        match self {
            ToolFormat::Hermes => Grammar::Lark(format!(
                "start: \"{HERMES_OPEN}\\n\" call \"\\n{HERMES_CLOSE}\"\ncall: %json {schema}"
            )),
        }
    }
}

/// One call read back from the output.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI sends them as a string).
    pub arguments: String,
}

impl ParsedCall {
    /// The call as OpenAI's API shows it, with a fresh id; `index` in a stream.
    pub fn into_api(self, index: Option<usize>) -> ToolCall {
        ToolCall {
            index,
            id: format!("call_{:024x}", rand::random::<u128>() >> 32),
            kind: "function",
            function: FunctionCall {
                name: self.name,
                arguments: self.arguments,
            },
        }
    }
}

/// Splits a finished output into its text (what comes before the first
/// call) and its calls. Output whose calls do not parse is all text (the
/// model wrote something else).
pub fn parse(format: ToolFormat, text: &str) -> (String, Vec<ParsedCall>) {
    let ToolFormat::Hermes = format;
    let Some(first) = text.find(HERMES_OPEN) else {
        return (text.to_string(), Vec::new());
    };
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(body) = rest.strip_prefix(HERMES_OPEN) {
        // An unterminated last call (the model ran out of tokens) is read
        // to the end.
        let (inner, after) = match body.find(HERMES_CLOSE) {
            Some(end) => (&body[..end], &body[end + HERMES_CLOSE.len()..]),
            None => (body, ""),
        };
        match call_of(inner) {
            Some(c) => calls.push(c),
            None => return (text.to_string(), Vec::new()),
        }
        rest = after.trim_start();
    }
    if !rest.is_empty() {
        return (text.to_string(), Vec::new());
    }
    (text[..first].to_string(), calls)
}

/// `{"name": "...", "arguments": {...}}` (Hermes also allows `"parameters"`).
fn call_of(inner: &str) -> Option<ParsedCall> {
    let v: Value = serde_json::from_str(inner.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or_else(|| json!({}));
    let arguments = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ParsedCall { name, arguments })
}

/// Streams one choice's text with tool calls held back: text before a call
/// goes out as it comes, anything from the start of a possible call is kept
/// until the end, when [`parse`] decides what it was.
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    /// Everything the choice produced.
    all: String,
    /// Bytes of `all` already sent as content.
    sent: usize,
}

impl ToolStream {
    pub fn new(format: ToolFormat) -> Self {
        ToolStream {
            format,
            all: String::new(),
            sent: 0,
        }
    }

    pub fn format(&self) -> ToolFormat {
        self.format
    }

    /// Adds generated text; returns the content that may go out now.
    pub fn push(&mut self, text: &str) -> String {
        self.all.push_str(text);
        let open = self.format.open();
        let unsent = &self.all[self.sent..];
        let keep_from = match unsent.find(open) {
            Some(at) => at,
            // Hold back a tail that could still grow into the marker.
            None => (1..open.len().min(unsent.len() + 1))
                .rev()
                .find(|&k| {
                    unsent.is_char_boundary(unsent.len() - k)
                        && open.starts_with(&unsent[unsent.len() - k..])
                })
                .map_or(unsent.len(), |k| unsent.len() - k),
        };
        let out = unsent[..keep_from].to_string();
        self.sent += keep_from;
        out
    }

    /// The end: the content still to send and the calls.
    pub fn finish(self) -> (String, Vec<ParsedCall>) {
        let (content, calls) = parse(self.format, &self.all);
        let rest = content.get(self.sent..).unwrap_or("").to_string();
        (rest, calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments: args.into(),
        }
    }

    #[test]
    fn hermes_calls_parse_back() {
        let f = ToolFormat::Hermes;
        assert_eq!(parse(f, "just text"), ("just text".into(), vec![]));
        let one = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        assert_eq!(
            parse(f, one),
            (
                "Let me check.\n".into(),
                vec![call("get_weather", r#"{"city":"Paris"}"#)]
            )
        );
        let two = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"parameters\": {\"x\": 1}}";
        assert_eq!(
            parse(f, two),
            (
                String::new(),
                vec![call("a", "{}"), call("b", r#"{"x":1}"#)]
            )
        );
        for broken in [
            "<tool_call>{\"name\": 3}</tool_call>",
            "<tool_call>not json</tool_call>",
            "<tool_call>{\"name\": \"a\"}</tool_call> and then text",
        ] {
            assert_eq!(parse(f, broken), (broken.to_string(), vec![]), "{broken}");
        }
    }

    #[test]
    fn streams_hold_back_only_what_may_be_a_call() {
        let mut s = ToolStream::new(ToolFormat::Hermes);
        let mut sent = String::new();
        for piece in [
            "Hi ",
            "there <",
            "tool",
            "_call>{\"name\": \"f\", ",
            "\"arguments\": {}}</tool_call>",
        ] {
            sent.push_str(&s.push(piece));
        }
        let (rest, calls) = s.finish();
        assert_eq!(sent, "Hi there ");
        assert_eq!(rest, "");
        assert_eq!(calls, vec![call("f", "{}")]);
        // A '<' that is not a call comes out, late but whole.
        let mut s = ToolStream::new(ToolFormat::Hermes);
        let mut sent = s.push("a <b");
        sent.push_str(&s.push(" c"));
        let (rest, calls) = s.finish();
        assert_eq!(format!("{sent}{rest}"), "a <b c");
        assert!(calls.is_empty());
        // A marker with no valid call after it: all text, at the end.
        let mut s = ToolStream::new(ToolFormat::Hermes);
        let sent = s.push("x <tool_call> oops");
        let (rest, calls) = s.finish();
        assert_eq!((sent.as_str(), rest.as_str()), ("x ", "<tool_call> oops"));
        assert!(calls.is_empty());
    }

    #[test]
    fn forced_calls_compile_and_match_only_calls() {
        let tools = vec![
            (
                "get_weather".to_string(),
                json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
            ),
            (
                "noop".to_string(),
                json!({"type": "object", "properties": {}}),
            ),
        ];
        match ToolFormat::Hermes.forced_call(&tools) {
            Grammar::Lark(g) => {
                assert!(g.starts_with("start: \"<tool_call>\\n\""), "{g}");
                assert!(g.contains("anyOf"), "{g}");
            }
            other => panic!("{other:?}"),
        }
    }
}
