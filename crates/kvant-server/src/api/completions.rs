//! `/v1/completions` responses and stream chunks.

use super::{Chunk, Response};
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;

pub type CompletionResponse = Response<CompletionChoice>;
pub type CompletionChunk<'a> = Chunk<'a, CompletionChoice>;

/// One choice of a response, or its part in one stream chunk.
#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    /// `null` in every stream chunk but a choice's last.
    pub finish_reason: Option<&'static str>,
}

/// The legacy logprobs object: parallel arrays, one entry per token.
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<TopLogprobMap>,
    /// Where each token's text starts in the completion, in characters.
    pub text_offset: Vec<usize>,
}

/// `{token text: logprob}`, most likely first. Two ids that spell the same
/// text keep the first (more likely) entry, so the JSON has no duplicate keys.
#[derive(Debug, Default)]
pub struct TopLogprobMap(pub Vec<(String, f32)>);

impl Serialize for TopLogprobMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seen = std::collections::HashSet::new();
        let unique: Vec<_> = self.0.iter().filter(|(t, _)| seen.insert(t)).collect();
        let mut map = s.serialize_map(Some(unique.len()))?;
        for (token, lp) in unique {
            map.serialize_entry(token, lp)?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_map_keeps_order_and_drops_duplicates() {
        let m = TopLogprobMap(vec![
            ("b".into(), -0.5),
            ("a".into(), -1.0),
            ("b".into(), -2.0),
        ]);
        let s = serde_json::to_string(&m).ok();
        assert_eq!(s.as_deref(), Some(r#"{"b":-0.5,"a":-1.0}"#));
    }
}
