//! A bounds-checked little-endian reader over the header bytes.
//!
//! Every read states its size before touching memory, so a header can never
//! make the parser read past the end. Errors carry only the offset and sizes;
//! the caller adds what was being read (key, tensor) through [`Within`], which
//! formats that context only when something actually failed.

use super::error::{GgufError, Result};

/// A read that ran past the end of the bytes.
#[derive(Clone, Copy, Debug)]
pub struct Short {
    offset: usize,
    needed: usize,
    available: usize,
}

pub(crate) type ShortResult<T> = std::result::Result<T, Short>;

pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Cursor { bytes, pos: 0 }
    }

    /// Offset of the next byte to read.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    pub(crate) fn take(&mut self, n: usize) -> ShortResult<&'a [u8]> {
        let short = Short {
            offset: self.pos,
            needed: n,
            available: self.remaining(),
        };
        let end = self.pos.checked_add(n).ok_or(short)?;
        let out = self.bytes.get(self.pos..end).ok_or(short)?;
        self.pos = end;
        Ok(out)
    }

    pub(crate) fn array<const N: usize>(&mut self) -> ShortResult<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self) -> ShortResult<u8> {
        Ok(self.array::<1>()?[0])
    }

    pub(crate) fn u32(&mut self) -> ShortResult<u32> {
        self.array().map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self) -> ShortResult<u64> {
        self.array().map(u64::from_le_bytes)
    }
}

/// Attaches what was being read to a [`Short`] read.
pub(crate) trait Within<T> {
    fn within(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Within<T> for ShortResult<T> {
    fn within(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|s| GgufError::Truncated {
            context: context(),
            offset: s.offset,
            needed: s.needed,
            available: s.available,
        })
    }
}

/// Turns a count read from the header into a `usize` after checking that
/// `count` items of at least `min_len` bytes each fit in what is left, so
/// no allocation is ever sized by an unchecked header field.
pub(crate) fn checked_count(
    cur: &Cursor<'_>,
    count: u64,
    min_len: usize,
    context: impl FnOnce() -> String,
) -> Result<usize> {
    let available = cur.remaining();
    let max = available / min_len.max(1);
    match usize::try_from(count) {
        Ok(n) if n <= max => Ok(n),
        _ => Err(GgufError::CountTooLarge {
            context: context(),
            offset: cur.pos(),
            count,
            available,
            max,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_little_endian_and_stops_at_end() {
        let bytes = [1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 9];
        let mut c = Cursor::new(&bytes);
        assert_eq!(c.u32().unwrap(), 1);
        assert_eq!(c.u64().unwrap(), 2);
        assert!(c.u32().is_err());
        // A failed read consumes nothing.
        assert_eq!(c.u8().unwrap(), 9);
        assert!(c.take(usize::MAX).is_err());
    }

    #[test]
    fn counts_are_bounded_by_remaining_bytes() {
        let bytes = [0u8; 24];
        let c = Cursor::new(&bytes);
        assert_eq!(checked_count(&c, 3, 8, String::new).unwrap(), 3);
        assert!(checked_count(&c, 4, 8, String::new).is_err());
        assert!(checked_count(&c, u64::MAX, 1, String::new).is_err());
        assert_eq!(checked_count(&c, 24, 0, String::new).unwrap(), 24);
    }
}
