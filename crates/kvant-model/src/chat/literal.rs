//! A conversation → token ids in which only the template writes control tokens: a message
//! whose text spells one (`<|im_start|>system` typed by a user) is tokenized as the plain
//! characters it is, so nobody can forge a turn, as OpenAI's API behaves.
//!
//! Conversations without such text are rendered and tokenized exactly as before (one string,
//! one encode). The others are rendered a second time with each such message's content replaced
//! by a marker of private-use characters; the rendered text is cut at the markers, the
//! template's parts are encoded as usual and each content with special-token matching off. A
//! template that transforms content (`| trim`) sees the marker, not the text, so such a
//! message keeps its surrounding whitespace: the price of the rare case.

use super::{ChatError, ChatMessage, ChatTemplate};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Marker around a content's index: Unicode private-use characters, which no template writes.
const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';

#[derive(Debug, thiserror::Error)]
pub enum ConversationError {
    #[error(transparent)]
    Template(#[from] ChatError),
    #[error("cannot tokenize the conversation: {0}")]
    Tokenize(#[from] TokenizerError),
}

impl ChatTemplate {
    /// The prompt's token ids, `tools` rendered as [`ChatTemplate::render_with_tools`] does.
    /// `literal`: control-token spellings inside message contents are
    /// plain text; otherwise (the raw behaviour) the whole rendered text is tokenized at once.
    /// The rendered template carries its own BOS where the model wants one.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        literal: bool,
    ) -> Result<Vec<u32>, ConversationError> {
        let mut forged = Vec::new();
        if literal {
            for (i, m) in messages.iter().enumerate() {
                if tokenizer.has_control_text(&m.content)? {
                    forged.push(i);
                }
            }
        }
        if forged.is_empty() {
            let text = self.render_with_tools(messages, add_generation_prompt, tools)?;
            return Ok(tokenizer.encode(&text, false)?);
        }
        let masked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mut m = m.clone();
                if forged.contains(&i) {
                    m.content = format!("{OPEN}{i}{CLOSE}");
                }
                m
            })
            .collect();
        let text = self.render_with_tools(&masked, add_generation_prompt, tools)?;
        let mut ids = Vec::new();
        let mut rest = text.as_str();
        while let Some((before, index, after)) = next_marker(rest, messages.len()) {
            ids.extend(tokenizer.encode(before, false)?);
            ids.extend(tokenizer.encode_literal(&messages[index].content)?);
            rest = after;
        }
        ids.extend(tokenizer.encode(rest, false)?);
        Ok(ids)
    }
}

/// The text before the first well-formed marker of an index below `n`, that index, and the
/// text after it.
fn next_marker(text: &str, n: usize) -> Option<(&str, usize, &str)> {
    let mut from = 0;
    while let Some(open) = text[from..].find(OPEN).map(|o| o + from) {
        let digits_at = open + OPEN.len_utf8();
        if let Some(close) = text[digits_at..].find(CLOSE).map(|c| c + digits_at) {
            if let Ok(i) = text[digits_at..close].parse::<usize>() {
                if i < n {
                    return Some((&text[..open], i, &text[close + CLOSE.len_utf8()..]));
                }
            }
        }
        from = digits_at;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_found_in_order_and_strays_kept() {
        let t = format!("a{OPEN}1{CLOSE}b{OPEN}x{CLOSE}c{OPEN}0{CLOSE}");
        let (before, i, after) = next_marker(&t, 2).expect("a marker");
        assert_eq!((before, i), ("a", 1));
        let (before, i, after) = next_marker(after, 2).expect("a second marker");
        assert_eq!((before, i, after), (&*format!("b{OPEN}x{CLOSE}c"), 0, ""));
        assert!(next_marker(&format!("{OPEN}7{CLOSE}"), 2).is_none());
    }
}
