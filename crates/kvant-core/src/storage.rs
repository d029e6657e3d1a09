//! Where a tensor's bytes live.
//!
//! Weights stay in the checkpoint's mmap in their stored type; only small
//! tensors built at load time (e.g. converted norms) are owned. A device
//! variant will sit beside these when a GPU backend arrives.

use crate::{CoreError, Result};
use std::sync::Arc;

/// The largest page-cache folio a read fault maps at once (a PMD's
/// span on x86-64): the unit [`Storage::release_resident_pages`] rounds to.
const FOLIO_SPAN: usize = 2 << 20;

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
    /// bytes `start..start + len` of a mapped file, and of the rest of the
    /// [`FOLIO_SPAN`]-aligned window around them (owned bytes are
    /// untouched). Called after load time copied bytes out of the file (a
    /// weight repacked, a norm widened to f32), so the file's pages stop
    /// counting toward the process's memory; a later read (an embedding
    /// row) faults its page back in from the file. Advisory: errors are
    /// ignored.
    ///
    /// The window, not the range alone: where the page cache holds the
    /// file in large folios (ext4 read from disk on Linux 6.x, as after
    /// `drop_caches` or on a machine that did not write the file itself),
    /// one read fault maps a whole folio of up to 2 MiB, so reading a
    /// 2 KiB norm maps up to 2 MiB of the repacked weights around it
    /// again. SmolLM2 Q4_1 `generate` on one Zen 4 VM, page cache dropped
    /// first: peak RSS 170.5 MB releasing the ranges (41.7 MB of the file
    /// mapped, mostly weights already repacked), against 140.8 MB with the
    /// file's pages small.
    #[cfg(unix)]
    pub fn release_resident_pages(&self, start: usize, len: usize) {
        if let Storage::Mapped(m) = self {
            let Some(end) = start.checked_add(len).filter(|&end| end <= m.len()) else {
                return;
            };
            if len == 0 {
                return;
            }
            let from = start - start % FOLIO_SPAN;
            let to = end.next_multiple_of(FOLIO_SPAN).min(m.len());
            // SAFETY: `m` is a private, read-only file mapping that kvant
            // never writes, so after MADV_DONTNEED a later access reads the
            // same bytes back from the file: no reader can observe a change
            // (also for the bytes of the window that belong to other
            // tensors, still in use or not).
            let _ = unsafe {
                m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, from, to - from)
            };
        }
    }

    /// [`Self::release_resident_pages`] for the whole file: after a model
    /// is loaded, what it still reads from the file (an embedding table
    /// kept as stored) faults back in as it is read.
    #[cfg(unix)]
    pub fn release_all_resident_pages(&self) {
        self.release_resident_pages(0, self.len());
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
