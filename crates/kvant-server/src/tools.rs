//! Tool calling: how a model family writes a call, reading the calls back
//! out of its output (whole, or while it streams), and the grammar that
//! makes a call certain when `tool_choice` demands one.
//!
//! The format is read off the chat template:
//! - Hermes (Qwen 2.5/3, Hermes, most tool-tuned ChatML models): each call
//!   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, after
//!   any text;
//! - Llama 3.1+ JSON: the whole reply is `{"name": ..., "parameters": {...}}`
//!   (several separated by `;`), after the `<|python_tag|>` control token
//!   where the model writes one (decoding drops control tokens);
//! - Mistral: the whole reply is `[TOOL_CALLS]` (a control token in v3+
//!   vocabularies) and a JSON array of `{"name", "arguments"}`;
//! - DeepSeek-V3: after any text, `<｜tool▁calls▁begin｜>`, then per call
//!   `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>`
//!   (V3.1 and later: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`),
//!   then `<｜tool▁calls▁end｜>`. The markers are control tokens, so such a
//!   request decodes with them kept in the text.
//!
//! A template that renders `tools` in none of these is refused with a 400
//! rather than answered with unparsed text.

use crate::api::chat::{FunctionCall, ToolCall};
use kvant_engine::grammar::{json_layout, Grammar};
use kvant_engine::stop::longest_suffix_prefix;
use serde_json::{json, Value};

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";
/// DeepSeek-V3's fence around a call's arguments, after the name.
const DS_FENCE_OPEN: &str = "\n```json\n";
const DS_FENCE_CLOSE: &str = "\n```";

/// How a model family writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Mistral,
    /// DeepSeek-V3: type, name, then the arguments fenced as JSON.
    DeepSeekV3,
    /// DeepSeek-V3.1 and later: name, then the bare arguments.
    DeepSeekV31,
}

const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";

impl ToolFormat {
    /// The format a chat template's text announces, if any.
    pub fn of_template(source: &str) -> Option<Self> {
        if source.contains(DS_CALLS_BEGIN) {
            Some(match source.contains("```json") {
                true => ToolFormat::DeepSeekV3,
                false => ToolFormat::DeepSeekV31,
            })
        } else if source.contains(HERMES_OPEN) {
            Some(ToolFormat::Hermes)
        } else if source.contains(MISTRAL_CALLS) {
            Some(ToolFormat::Mistral)
        } else if source.contains(PYTHON_TAG) {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// Whether its calls are written in control tokens, which the text
    /// must keep for them to be read.
    pub fn writes_control_tokens(self) -> bool {
        matches!(self, ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31)
    }

    /// A grammar for output that is exactly one call of one of `tools`
    /// (each name and parameter schema), its arguments valid against the
    /// function's parameter schema, laid out as `json.dumps` writes JSON.
    pub fn forced_call(self, tools: &[(String, Value)]) -> Grammar {
        let args_key = match self {
            ToolFormat::Llama3Json => "parameters",
            _ => "arguments",
        };
        let calls: Vec<Value> = tools
            .iter()
            .map(|(name, params)| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, args_key: params},
                    "required": ["name", args_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let call = match calls.len() {
            1 => calls.into_iter().next().unwrap_or(Value::Null),
            _ => json!({ "anyOf": calls }),
        };
        match self {
            ToolFormat::Hermes => Grammar::Lark(format!(
                "start: \"{HERMES_OPEN}\\n\" call \"\\n{HERMES_CLOSE}\"\ncall: %json {}",
                json_layout(&call)
            )),
            ToolFormat::Llama3Json => Grammar::JsonSchema(call),
            // Without the control token, which a text grammar cannot write;
            // the reader takes the bare array too.
            ToolFormat::Mistral => Grammar::JsonSchema(
                json!({"type": "array", "items": call, "minItems": 1, "maxItems": 1}),
            ),
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => self.forced_deepseek_call(tools),
        }
    }

    /// DeepSeek's call: the markers as the control tokens they are
    /// (llguidance's `<token>` syntax; a vocabulary without them fails to
    /// compile, a 400), one alternative per function.
    fn forced_deepseek_call(self, tools: &[(String, Value)]) -> Grammar {
        // A JSON string literal is a Lark string literal too.
        let lit = |s: &str| serde_json::to_string(s).unwrap_or_default();
        let alternatives: Vec<String> = tools
            .iter()
            .map(|(name, params)| {
                let args = format!("%json {}", json_layout(params));
                match self {
                    ToolFormat::DeepSeekV3 => format!(
                        "\"function\" {DS_SEP} {} {args} {}",
                        lit(&format!("{name}{DS_FENCE_OPEN}")),
                        lit(DS_FENCE_CLOSE)
                    ),
                    _ => format!("{} {DS_SEP} {args}", lit(name)),
                }
            })
            .collect();
        let calls: Vec<String> = (0..alternatives.len()).map(|i| format!("c{i}")).collect();
        let mut g = format!(
            "start: {DS_CALLS_BEGIN} {DS_CALL_BEGIN} call {DS_CALL_END} {DS_CALLS_END}\ncall: {}\n",
            calls.join(" | ")
        );
        for (c, alt) in calls.iter().zip(&alternatives) {
            g.push_str(&format!("{c}: {alt}\n"));
        }
        Grammar::Lark(g)
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
    let parsed = match format {
        ToolFormat::Hermes => parse_hermes(text),
        ToolFormat::Llama3Json => parse_llama3(text).map(|c| (String::new(), c)),
        ToolFormat::Mistral => parse_mistral(text).map(|c| (String::new(), c)),
        ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => parse_deepseek(text),
    };
    parsed.unwrap_or_else(|| (text.to_string(), Vec::new()))
}

fn parse_hermes(text: &str) -> Option<(String, Vec<ParsedCall>)> {
    let first = text.find(HERMES_OPEN)?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(body) = rest.strip_prefix(HERMES_OPEN) {
        // An unterminated last call (the model ran out of tokens) is read
        // to the end.
        let (inner, after) = match body.find(HERMES_CLOSE) {
            Some(end) => (&body[..end], &body[end + HERMES_CLOSE.len()..]),
            None => (body, ""),
        };
        calls.push(call_of(inner)?);
        rest = after.trim_start();
    }
    rest.is_empty().then(|| (text[..first].to_string(), calls))
}

/// Text, then `<｜tool▁calls▁begin｜>` and calls in either DeepSeek form
/// (the V3 fence is recognised, else the V3.1 layout), each closed by
/// `<｜tool▁call▁end｜>` (an unterminated last call, cut by `max_tokens`,
/// is read to the end), then `<｜tool▁calls▁end｜>` or nothing.
fn parse_deepseek(text: &str) -> Option<(String, Vec<ParsedCall>)> {
    let first = text.find(DS_CALLS_BEGIN)?;
    let mut rest = text[first + DS_CALLS_BEGIN.len()..].trim_start();
    let mut calls = Vec::new();
    while let Some(body) = rest.strip_prefix(DS_CALL_BEGIN) {
        let (inner, after) = match body.find(DS_CALL_END) {
            Some(end) => (&body[..end], &body[end + DS_CALL_END.len()..]),
            None => (body, ""),
        };
        let (head, tail) = inner.split_once(DS_SEP)?;
        let fenced = tail
            .split_once(DS_FENCE_OPEN)
            .and_then(|(name, args)| Some((name, args.strip_suffix(DS_FENCE_CLOSE)?)));
        let (name, args) = match fenced {
            Some((name, args)) if head.trim() == "function" => (name, args),
            _ => (head, tail),
        };
        let args: Value = serde_json::from_str(args.trim()).ok()?;
        let name = name.trim();
        if name.is_empty() {
            return None;
        }
        calls.push(ParsedCall {
            name: name.to_string(),
            arguments: args.to_string(),
        });
        rest = after.trim_start();
    }
    let rest = rest.strip_prefix(DS_CALLS_END).unwrap_or(rest);
    (!calls.is_empty() && rest.trim().is_empty()).then(|| (text[..first].to_string(), calls))
}

/// One or more `{"name", "parameters"}` objects, separated by `;`.
fn parse_llama3(text: &str) -> Option<Vec<ParsedCall>> {
    let body = text.trim();
    let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim_start();
    if !body.starts_with('{') {
        return None;
    }
    body.split(';')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(call_of)
        .collect()
}

/// A JSON array of `{"name", "arguments"}`, after `[TOOL_CALLS]` if written.
fn parse_mistral(text: &str) -> Option<Vec<ParsedCall>> {
    let body = text.trim();
    let body = body
        .strip_prefix(MISTRAL_CALLS)
        .unwrap_or(body)
        .trim_start();
    if !body.starts_with('[') {
        return None;
    }
    let Value::Array(items) = serde_json::from_str::<Value>(body).ok()? else {
        return None;
    };
    if items.is_empty() {
        return None;
    }
    items.iter().map(|v| call_of(&v.to_string())).collect()
}

/// `{"name": "...", "arguments": {...}}` (or `"parameters"`, Llama's word).
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
        let unsent = &self.all[self.sent..];
        let keep_from = match self.format {
            ToolFormat::Hermes | ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => {
                let open = match self.format {
                    ToolFormat::Hermes => HERMES_OPEN,
                    _ => DS_CALLS_BEGIN,
                };
                match unsent.find(open) {
                    Some(at) => at,
                    // Hold back a tail that could still grow into the marker.
                    None => unsent.len() - longest_suffix_prefix(unsent, open),
                }
            }
            // Calls are the whole reply: hold everything while it may be
            // one, stream freely once it cannot.
            ToolFormat::Llama3Json | ToolFormat::Mistral => {
                let (opener, marker) = match self.format {
                    ToolFormat::Mistral => ('[', MISTRAL_CALLS),
                    _ => ('{', PYTHON_TAG),
                };
                let head = self.all.trim_start();
                let maybe_call = head.is_empty()
                    || head.starts_with(opener)
                    || head.starts_with(marker)
                    || marker.starts_with(head);
                match self.sent == 0 && maybe_call {
                    true => 0,
                    false => unsent.len(),
                }
            }
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
    fn llama3_and_mistral_calls_parse_back() {
        let l = ToolFormat::Llama3Json;
        assert_eq!(
            parse(l, " {\"name\": \"f\", \"parameters\": {\"a\": 1}}; {\"name\": \"g\", \"parameters\": {}}"),
            (String::new(), vec![call("f", r#"{"a":1}"#), call("g", "{}")])
        );
        assert_eq!(
            parse(l, "{not a call} sorry"),
            ("{not a call} sorry".into(), vec![])
        );
        assert_eq!(
            parse(l, "Hello {\"name\": \"f\"}"),
            ("Hello {\"name\": \"f\"}".into(), vec![])
        );
        let m = ToolFormat::Mistral;
        assert_eq!(
            parse(
                m,
                "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"x\": \"y\"}}]"
            ),
            (String::new(), vec![call("f", r#"{"x":"y"}"#)])
        );
        assert_eq!(
            parse(
                m,
                "[{\"name\": \"f\", \"arguments\": {}}, {\"name\": \"g\", \"arguments\": {}}]"
            ),
            (String::new(), vec![call("f", "{}"), call("g", "{}")])
        );
        assert_eq!(parse(m, "[1, 2]"), ("[1, 2]".into(), vec![]));
        assert_eq!(parse(m, "[]"), ("[]".into(), vec![]));
    }

    #[test]
    fn whole_reply_formats_stream_text_at_once_and_hold_calls() {
        let mut s = ToolStream::new(ToolFormat::Llama3Json);
        let mut sent = s.push("  ");
        sent.push_str(&s.push("Hello"));
        sent.push_str(&s.push(" {x}"));
        assert_eq!(sent, "  Hello {x}");
        assert_eq!(s.finish(), (String::new(), vec![]));
        let mut s = ToolStream::new(ToolFormat::Mistral);
        assert_eq!(s.push("[{\"name\": \"f\", "), "");
        assert_eq!(s.push("\"arguments\": {}}]"), "");
        assert_eq!(s.finish(), (String::new(), vec![call("f", "{}")]));
    }

    #[test]
    fn deepseek_calls_parse_back() {
        let v3 = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let want = vec![
            call("get_weather", r#"{"city":"Paris"}"#),
            call("now", "{}"),
        ];
        for f in [ToolFormat::DeepSeekV3, ToolFormat::DeepSeekV31] {
            assert_eq!(parse(f, v3), ("Checking.".into(), want.clone()));
        }
        let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}";
        assert_eq!(parse(ToolFormat::DeepSeekV31, v31), (String::new(), want));
        for broken in [
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>not json<｜tool▁call▁end｜>",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><｜tool▁sep｜>{}<｜tool▁call▁end｜>",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜> more",
        ] {
            let f = ToolFormat::DeepSeekV31;
            assert_eq!(parse(f, broken), (broken.to_string(), vec![]), "{broken}");
        }
        let mut s = ToolStream::new(ToolFormat::DeepSeekV3);
        let mut sent = s.push("Hi <｜tool");
        sent.push_str(&s.push(
            "▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```",
        ));
        assert_eq!(sent, "Hi ");
        assert_eq!(s.finish(), (String::new(), vec![call("now", "{}")]));
    }

    #[test]
    fn deepseek_forced_calls_name_the_marker_tokens() {
        let tools = vec![("now".to_string(), json!({"type": "object"}))];
        let Grammar::Lark(g) = ToolFormat::DeepSeekV3.forced_call(&tools) else {
            panic!("a Lark grammar");
        };
        assert!(
            g.starts_with("start: <｜tool▁calls▁begin｜> <｜tool▁call▁begin｜> call"),
            "{g}"
        );
        assert!(
            g.contains(r#"c0: "function" <｜tool▁sep｜> "now\n```json\n" %json"#),
            "{g}"
        );
        let Grammar::Lark(g) = ToolFormat::DeepSeekV31.forced_call(&tools) else {
            panic!("a Lark grammar");
        };
        assert!(g.contains(r#"c0: "now" <｜tool▁sep｜> %json"#), "{g}");
        assert_eq!(
            ToolFormat::of_template("{{'<｜tool▁calls▁begin｜>'}}```json"),
            Some(ToolFormat::DeepSeekV3)
        );
        assert_eq!(
            ToolFormat::of_template("{{'<｜tool▁calls▁begin｜>'}}"),
            Some(ToolFormat::DeepSeekV31)
        );
        assert!(ToolFormat::DeepSeekV3.writes_control_tokens());
        assert!(!ToolFormat::Hermes.writes_control_tokens());
    }

    #[test]
    fn templates_name_their_format() {
        assert_eq!(
            ToolFormat::of_template("x <tool_call> y"),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::of_template("{{ '[TOOL_CALLS]' }}"),
            Some(ToolFormat::Mistral)
        );
        assert_eq!(
            ToolFormat::of_template("<|python_tag|>"),
            Some(ToolFormat::Llama3Json)
        );
        assert_eq!(ToolFormat::of_template("{{ messages }}"), None);
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
