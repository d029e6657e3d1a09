//! Decoding as one rule for every vocabulary: each token stands for a fixed run of bytes, and the
//! text of a token sequence is the lossy UTF-8 of their concatenation, less up to
//! `strip_leading` leading spaces (SentencePiece's dummy prefix).
//!
//! The Hugging Face decoders differ only where bytes are not valid UTF-8 (`ByteFallback` turns
//! each byte of a broken run into U+FFFD; here a broken sequence becomes one U+FFFD, as
//! `String::from_utf8_lossy` and llama.cpp's byte output do). The payoff is that decoding is
//! additive at any point where the bytes so far end on a complete character, which is what lets
//! `DecodeStream` emit text early and still agree exactly with `decode`.

use super::error::TokenizerError;

/// One vocabulary's pieces, stored back to back.
#[derive(Debug)]
pub(crate) struct PieceTable {
    bytes: Vec<u8>,
    entries: Vec<Entry>,
    strip_leading: usize,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    start: usize,
    end: usize,
    /// Dropped by `decode(.., skip_special = true)`.
    special: bool,
    /// An id inside the vocabulary's range that names no token (a hole in a tokenizer.json).
    missing: bool,
}

impl PieceTable {
    pub(crate) fn new(strip_leading: usize) -> Self {
        PieceTable {
            bytes: Vec::new(),
            entries: Vec::new(),
            strip_leading,
        }
    }

    /// Appends the piece of the next id.
    pub(crate) fn push(&mut self, piece: &[u8], special: bool) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(piece);
        self.entries.push(Entry {
            start,
            end: self.bytes.len(),
            special,
            missing: false,
        });
    }

    /// Appends an id that names no token: decoding it is an error.
    pub(crate) fn push_missing(&mut self) {
        let at = self.bytes.len();
        self.entries.push(Entry {
            start: at,
            end: at,
            special: false,
            missing: true,
        });
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn strip_leading(&self) -> usize {
        self.strip_leading
    }

    /// The bytes `id` contributes, or `None` when decoding skips it.
    pub(crate) fn piece(
        &self,
        id: u32,
        skip_special: bool,
    ) -> Result<Option<&[u8]>, TokenizerError> {
        let out_of_range = || TokenizerError::IdOutOfRange {
            id,
            vocab_size: self.entries.len(),
        };
        let entry = usize::try_from(id)
            .ok()
            .and_then(|i| self.entries.get(i))
            .filter(|e| !e.missing)
            .ok_or_else(out_of_range)?;
        if skip_special && entry.special {
            return Ok(None);
        }
        self.bytes
            .get(entry.start..entry.end)
            .map(Some)
            .ok_or_else(out_of_range)
    }

    /// The bytes of `id` and whether it is special, whatever decoding would skip.
    pub(crate) fn entry(&self, id: u32) -> Option<(&[u8], bool)> {
        let e = self.entries.get(usize::try_from(id).ok()?)?;
        if e.missing {
            return None;
        }
        Some((self.bytes.get(e.start..e.end)?, e.special))
    }

    pub(crate) fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for &id in ids {
            if let Some(piece) = self.piece(id, skip_special)? {
                bytes.extend_from_slice(piece);
            }
        }
        let mut text = String::from_utf8_lossy(&bytes).into_owned();
        let strip = leading_spaces(&text, self.strip_leading);
        text.drain(..strip);
        Ok(text)
    }
}

/// How many of `text`'s leading spaces, at most `limit`, a strip removes (in bytes and chars:
/// a space is one byte).
pub(crate) fn leading_spaces(text: &str, limit: usize) -> usize {
    text.bytes().take(limit).take_while(|&b| b == b' ').count()
}
