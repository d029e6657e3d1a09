//! Incremental detokenization for streaming generated text.
//!
//! A token may end in the middle of a UTF-8 character (byte-fallback and byte-level vocabularies
//! spell an emoji as several tokens), so the stream holds back bytes until they can no longer
//! change: a complete character, or an invalid sequence that later bytes cannot repair. Because
//! decoding is the lossy UTF-8 of the concatenated pieces (see `pieces`), text emitted at such
//! points plus `flush` is exactly `Tokenizer::decode` of all the ids.

use super::error::TokenizerError;
use super::pieces::leading_spaces;
use super::pieces::PieceTable;

/// Turns ids, one at a time, into newly completed text.
pub struct DecodeStream<'t> {
    pieces: &'t PieceTable,
    skip_special: bool,
    /// Bytes received but not yet emitted: at most an incomplete character.
    pending: Vec<u8>,
    /// Leading spaces already stripped (SentencePiece's dummy prefix).
    stripped: usize,
    /// Whether any text has been emitted, after which nothing more is stripped.
    started: bool,
}

impl<'t> DecodeStream<'t> {
    pub(crate) fn new(pieces: &'t PieceTable, skip_special: bool) -> Self {
        DecodeStream {
            pieces,
            skip_special,
            pending: Vec::new(),
            stripped: 0,
            started: false,
        }
    }

    /// Feeds one id; returns the text it completes, if any. Never splits a UTF-8 character.
    pub fn step(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        let Some(piece) = self.pieces.piece(id, self.skip_special)? else {
            return Ok(None);
        };
        self.pending.extend_from_slice(piece);
        let settled = settled_len(&self.pending);
        if settled == 0 {
            return Ok(None);
        }
        let text = String::from_utf8_lossy(&self.pending[..settled]).into_owned();
        self.pending.drain(..settled);
        Ok(self.emit(text))
    }

    /// Ends the stream: returns whatever is held back (an incomplete character decodes to
    /// U+FFFD, as in `decode`).
    pub fn flush(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        self.emit(text).unwrap_or_default()
    }

    fn emit(&mut self, mut text: String) -> Option<String> {
        if !self.started {
            let limit = self.pieces.strip_leading().saturating_sub(self.stripped);
            let strip = leading_spaces(&text, limit);
            text.drain(..strip);
            self.stripped += strip;
            self.started = !text.is_empty();
        }
        (!text.is_empty()).then_some(text)
    }
}

/// Length of the longest prefix of `bytes` whose lossy decoding no further bytes can change:
/// everything except a trailing incomplete (but so far valid) UTF-8 sequence.
fn settled_len(bytes: &[u8]) -> usize {
    let mut at = 0;
    loop {
        let Some(rest) = bytes.get(at..) else {
            return bytes.len();
        };
        match std::str::from_utf8(rest) {
            Ok(_) => return bytes.len(),
            Err(e) => match e.error_len() {
                // An invalid sequence, already decided by the bytes present: keep going.
                Some(invalid) => at += e.valid_up_to() + invalid,
                // The bytes end inside a character that may still complete.
                None => return at + e.valid_up_to(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::settled_len;

    #[test]
    fn settled_prefix_stops_before_an_incomplete_character() {
        let euro = "€".as_bytes();
        assert_eq!(settled_len(b"abc"), 3);
        assert_eq!(settled_len(&euro[..1]), 0);
        assert_eq!(settled_len(&[b'a', euro[0], euro[1]]), 1);
        assert_eq!(settled_len(euro), 3);
        // A lone continuation byte is invalid whatever follows; a lead byte followed by ASCII is
        // invalid too, and the ASCII after it is settled.
        assert_eq!(settled_len(&[0x80]), 1);
        assert_eq!(settled_len(&[euro[0], b'x']), 2);
        assert_eq!(settled_len(&[0xFF, b'x', euro[0]]), 2);
    }
}
