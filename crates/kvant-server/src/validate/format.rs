//! Structured outputs: OpenAI's `response_format` and vLLM's `guided_json`,
//! `guided_regex`, `guided_choice` and `guided_grammar` → the grammar the
//! output must match. Only the shape is checked here; whether the grammar
//! compiles is known once the engine's grammar compiler has seen it
//! (`crate::constrain`), and a failure there is a 400 naming the same field.

use crate::api::request::CommonFields;
use crate::error::ApiError;
use kvant_engine::grammar::Grammar;
use serde_json::{json, Value};

/// A request's grammar and the field it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputGrammar {
    pub param: &'static str,
    pub grammar: Grammar,
}

/// The request's grammar, if it asks for one. At most one of the fields may.
pub fn parse(c: &mut CommonFields) -> Result<Option<OutputGrammar>, ApiError> {
    let mut found = Vec::new();
    if let Some(g) = response_format(c.response_format.take())? {
        found.push(("response_format", g));
    }
    let fields = [
        ("guided_json", c.guided_json.take()),
        ("guided_regex", c.guided_regex.take()),
        ("guided_choice", c.guided_choice.take()),
        ("guided_grammar", c.guided_grammar.take()),
    ];
    for (param, value) in fields {
        match value {
            None | Some(Value::Null) => {}
            Some(v) => found.push((param, guided(param, v)?)),
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(p, _)| *p).collect();
        return Err(ApiError::bad_param(
            found[1].0,
            format!(
                "give at most one of response_format and the guided_* fields, got {}",
                names.join(", ")
            ),
        ));
    }
    Ok(found
        .pop()
        .map(|(param, grammar)| OutputGrammar { param, grammar }))
}

/// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
/// "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
fn response_format(v: Option<Value>) -> Result<Option<Grammar>, ApiError> {
    const P: &str = "response_format";
    let v = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::bad_param(
            P,
            "`response_format` must be an object with a `type`: text, json_object or json_schema",
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Grammar::JsonSchema(json!({"type": "object"})))),
        "json_schema" => {
            let spec = v
                .get("json_schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "response_format.json_schema",
                        "a json_schema response format needs a `json_schema` object",
                    )
                })?;
            match spec.get("schema") {
                Some(schema @ Value::Object(_)) => Ok(Some(Grammar::JsonSchema(schema.clone()))),
                Some(Value::Bool(true)) => Ok(Some(Grammar::JsonSchema(json!({})))),
                _ => Err(ApiError::bad_param(
                    "response_format.json_schema.schema",
                    "`json_schema.schema` must be a JSON schema object",
                )),
            }
        }
        other => Err(ApiError::bad_param(
            "response_format.type",
            format!("unknown response format `{other}`: use text, json_object or json_schema"),
        )),
    }
}

fn guided(param: &'static str, v: Value) -> Result<Grammar, ApiError> {
    let bad = |msg: &str| ApiError::bad_param(param, msg);
    match (param, v) {
        ("guided_json", Value::Object(o)) => Ok(Grammar::JsonSchema(Value::Object(o))),
        ("guided_json", Value::String(s)) => match serde_json::from_str::<Value>(&s) {
            Ok(schema @ Value::Object(_)) => Ok(Grammar::JsonSchema(schema)),
            _ => Err(bad(
                "`guided_json` must be a JSON schema (an object or its text)",
            )),
        },
        ("guided_regex", Value::String(s)) if !s.is_empty() => Ok(Grammar::Regex(s)),
        ("guided_grammar", Value::String(s)) if !s.trim().is_empty() => Ok(Grammar::Lark(s)),
        ("guided_choice", Value::Array(items)) if !items.is_empty() => {
            let choices = items
                .iter()
                .map(|c| c.as_str().filter(|s| !s.is_empty()))
                .collect::<Option<Vec<&str>>>()
                .ok_or_else(|| bad("`guided_choice` must be an array of non-empty strings"))?;
            let alternatives: Vec<String> = choices.iter().map(|c| escape(c)).collect();
            Ok(Grammar::Regex(format!("({})", alternatives.join("|"))))
        }
        ("guided_choice", _) => Err(bad("`guided_choice` must be an array of non-empty strings")),
        ("guided_json", _) => Err(bad(
            "`guided_json` must be a JSON schema (an object or its text)",
        )),
        ("guided_grammar", _) => Err(bad(
            "`guided_grammar` must be a non-empty grammar in llguidance's Lark syntax",
        )),
        _ => Err(bad(&format!("`{param}` must be a non-empty string"))),
    }
}

/// `text` as a regular expression matching exactly it.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(ch) {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::fields;

    fn parse_json(v: Value) -> Result<Option<OutputGrammar>, ApiError> {
        let mut c: CommonFields = fields(&v)?;
        parse(&mut c)
    }

    #[test]
    fn the_documented_shapes_give_their_grammar() {
        let any = Grammar::JsonSchema(json!({"type": "object"}));
        let cases = [
            (json!({}), None),
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some(any.clone()),
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": true}}}),
                Some(Grammar::JsonSchema(json!({"type": "integer"}))),
            ),
            (
                json!({"guided_json": {"type": "object"}}),
                Some(any.clone()),
            ),
            (json!({"guided_json": "{\"type\": \"object\"}"}), Some(any)),
            (
                json!({"guided_regex": "[0-9]+"}),
                Some(Grammar::Regex("[0-9]+".into())),
            ),
            (
                json!({"guided_choice": ["yes", "no (1.5)"]}),
                Some(Grammar::Regex(r"(yes|no \(1\.5\))".into())),
            ),
            (
                json!({"guided_grammar": "start: \"a\""}),
                Some(Grammar::Lark("start: \"a\"".into())),
            ),
        ];
        for (body, want) in cases {
            let got = parse_json(body.clone()).map(|g| g.map(|g| g.grammar));
            assert_eq!(got.ok(), Some(want), "{body}");
        }
    }

    #[test]
    fn bad_shapes_name_their_field() {
        let cases = [
            (json!({"response_format": "json"}), "response_format"),
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"guided_json": "not json"}), "guided_json"),
            (json!({"guided_json": 3}), "guided_json"),
            (json!({"guided_regex": ""}), "guided_regex"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_choice": ["a", 1]}), "guided_choice"),
            (json!({"guided_grammar": " "}), "guided_grammar"),
            (
                json!({"guided_regex": "a", "response_format": {"type": "json_object"}}),
                "guided_regex",
            ),
        ];
        for (body, param) in cases {
            let e = parse_json(body.clone()).err();
            assert_eq!(e.and_then(|e| e.param).as_deref(), Some(param), "{body}");
        }
    }
}
