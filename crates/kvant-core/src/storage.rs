//! Where a tensor's bytes live.
//!
//! Weights stay in the checkpoint's mmap in their stored type; only small
//! tensors built at load time (e.g. converted norms) are owned. A device
//! variant will sit beside these when a GPU backend arrives.

use crate::{CoreError, Result};
use std::sync::Arc;

#[derive(Clone)]
pub enum Storage {
    /// A byte range of a memory-mapped file, shared by every tensor in it.
    Mapped(Arc<memmap2::Mmap>),
    /// Bytes owned by the process.
    Owned(Arc<[u8]>),
}

impl Storage {
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }

    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checked sub-slice: a range from a checkpoint header is never trusted.
    pub fn slice(&self, start: usize, len: usize) -> Result<&[u8]> {
        let bytes = self.as_bytes();
        let end = start.checked_add(len).ok_or(CoreError::OutOfBounds {
            start,
            end: usize::MAX,
            len: bytes.len(),
        })?;
        bytes.get(start..end).ok_or(CoreError::OutOfBounds {
            start,
            end,
            len: bytes.len(),
        })
    }

    /// Tells the OS this process no longer needs the resident pages of
    /// bytes `start..start + len` of a mapped file (owned bytes are
    /// untouched). Called after load-time repacking copied a weight out, so
    /// the file's pages stop counting toward the process's memory while the
    /// copy is made; a later read of the range (an embedding row) faults its
    /// page back in from the file. Advisory: errors are ignored.
    #[cfg(unix)]
    pub fn release_resident_pages(&self, start: usize, len: usize) {
        if let Storage::Mapped(m) = self {
            if start.checked_add(len).is_some_and(|end| end <= m.len()) {
                // SAFETY: `m` is a private, read-only file mapping that kvant
                // never writes, so after MADV_DONTNEED a later access reads the
                // same bytes back from the file: no reader can observe a
                // change (also for the parts of the first and last page that
                // belong to neighbouring tensors).
                let _ = unsafe {
                    m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len)
                };
            }
        }
    }

    /// Maps a whole file read-only.
    pub fn map_file(path: &std::path::Path) -> Result<Storage> {
        let io = |source| CoreError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process; kvant never
        // writes checkpoint files, and every access goes through checked slices.
        // A concurrent truncation by another process is outside our control (as
        // for every mmap-based loader) and is documented in the README.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Ok(Storage::Mapped(Arc::new(map)))
    }
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Storage::Mapped(m) => write!(f, "Mapped({} bytes)", m.len()),
            Storage::Owned(v) => write!(f, "Owned({} bytes)", v.len()),
        }
    }
}
