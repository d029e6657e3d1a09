//! Read-only buffers on transparent huge pages, for what decode streams
//! from memory every token: the weights repacked at load.
//!
//! On 4 KiB pages a stream of weights crosses a page every 4 KiB: a TLB
//! miss each time, and the end of the hardware prefetcher's run (it does
//! not cross pages). The same kvant binary decoded SmolLM2 Q4_1 at 154
//! tok/s on one Zen 4 thread on 4 KiB pages and at 230 on 2 MiB ones
//! (glibc's `glibc.malloc.hugetlb=1` tunable, 5 alternated runs). Where the
//! kernel's transparent huge pages are `madvise`-only (the common default,
//! and this machine's), an allocation gets them only when asked, so the
//! buffers here come from anonymous maps of whole 2 MiB pages marked
//! `MADV_HUGEPAGE`, shared by many buffers (one matrix of a small model is
//! far below a page).
//!
//! A chunk is freed when the last buffer in it is dropped. Where the map
//! or the advice fails, buffers live on the heap: slower, never wrong.

use std::sync::{Arc, Mutex, Weak};

/// Bytes of a chunk (more for a larger buffer): 32 huge pages. Pages of a
/// chunk nothing was written to are never touched, so a last, partly used
/// chunk costs address space, not memory.
const CHUNK: usize = 64 << 20;

/// The huge page size the chunks are rounded to.
const PAGE: usize = 2 << 20;

/// Every buffer starts on a cache line (the kernels' loads never split one
/// more than the data does).
const ALIGN: usize = 64;

/// An anonymous map that buffers are carved from, front to back.
struct Chunk {
    map: memmap2::MmapMut,
    base: *mut u8,
}

// SAFETY: `base` points into `map`, which lives as long as the chunk. Bytes
// are written only once, by the one caller `reserve` handed their range to
// (under `OPEN`'s lock, ranges never overlap), before any buffer covers
// them; afterwards they are only read (through `HugeSlice`, which hands out
// shared slices), so sharing and sending a chunk between threads shares
// immutable bytes.
unsafe impl Send for Chunk {}
// SAFETY: as above.
unsafe impl Sync for Chunk {}

/// The chunk new buffers go to, and its first free byte. Weak: a chunk
/// whose buffers were all dropped (a model unloaded) is freed, not kept.
static OPEN: Mutex<Option<(Weak<Chunk>, usize)>> = Mutex::new(None);

/// Element types a [`HugeSlice`] holds: plain values, copied as they are,
/// aligned to at most 64 bytes (checked at compile time).
pub trait Plain: Copy + Send + Sync + 'static {}
impl Plain for u8 {}
impl Plain for u16 {}
impl Plain for u64 {}

/// An immutable slice on transparent huge pages (or, failing that, the
/// heap), built from a `Vec` once and read ever after. Clones share it.
#[derive(Clone)]
pub struct HugeSlice<T: Plain> {
    inner: Inner<T>,
}

#[derive(Clone)]
enum Inner<T: Plain> {
    Heap(Arc<[T]>),
    Huge {
        chunk: Arc<Chunk>,
        offset: usize,
        len: usize,
    },
}

impl<T: Plain> HugeSlice<T> {
    /// Moves `v`'s values onto huge pages (a copy; `v` is freed).
    pub fn from_vec(v: Vec<T>) -> Self {
        match reserve::<T>(v.len()) {
            // SAFETY: `reserve`'s range is `v.len()` values, ours alone.
            Some((chunk, offset)) => unsafe {
                let dst = chunk.base.add(offset) as *mut T;
                std::ptr::copy_nonoverlapping(v.as_ptr(), dst, v.len());
                Self::huge(chunk, offset, v.len())
            },
            None => HugeSlice {
                inner: Inner::Heap(v.into()),
            },
        }
    }

    /// `len` values `f(0), f(1), ...` written straight onto huge pages
    /// (no copy on the heap first).
    pub fn from_fn(len: usize, f: impl Fn(usize) -> T) -> Self {
        match reserve::<T>(len) {
            // SAFETY: `reserve`'s range is `len` values, ours alone.
            Some((chunk, offset)) => unsafe {
                let dst = chunk.base.add(offset) as *mut T;
                (0..len).for_each(|i| dst.add(i).write(f(i)));
                Self::huge(chunk, offset, len)
            },
            None => HugeSlice {
                inner: Inner::Heap((0..len).map(f).collect()),
            },
        }
    }

    /// # Safety
    /// `len` values of `T` were written at `offset` in `chunk`, a range
    /// from [`reserve`].
    unsafe fn huge(chunk: Arc<Chunk>, offset: usize, len: usize) -> Self {
        HugeSlice {
            inner: Inner::Huge { chunk, offset, len },
        }
    }

    /// Whether the values are on a map advised for huge pages (else the heap).
    pub fn on_huge_pages(&self) -> bool {
        matches!(self.inner, Inner::Huge { .. })
    }
}

/// A range of `len` values of `T` in a chunk (its chunk and byte offset),
/// handed out once: no buffer covers it and no other call gets it. `None`
/// for no values, or when no chunk can be made.
fn reserve<T: Plain>(len: usize) -> Option<(Arc<Chunk>, usize)> {
    const { assert!(std::mem::align_of::<T>() <= ALIGN) };
    let bytes = len.checked_mul(std::mem::size_of::<T>())?;
    if bytes == 0 {
        return None;
    }
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    let fits = open.as_ref().and_then(|(weak, used)| {
        let chunk = weak.upgrade()?;
        let offset = used.next_multiple_of(ALIGN);
        (offset.checked_add(bytes)? <= chunk.map.len()).then_some((chunk, offset))
    });
    let (chunk, offset) = match fits {
        Some(found) => found,
        None => (new_chunk(bytes)?, 0),
    };
    *open = Some((Arc::downgrade(&chunk), offset + bytes));
    Some((chunk, offset))
}

/// A chunk of at least `bytes`, advised for huge pages; `None` if the
/// system refuses the map or the advice.
fn new_chunk(bytes: usize) -> Option<Arc<Chunk>> {
    let size = bytes.max(CHUNK).checked_next_multiple_of(PAGE)?;
    let mut map = memmap2::MmapMut::map_anon(size).ok()?;
    #[cfg(target_os = "linux")]
    map.advise(memmap2::Advice::HugePage).ok()?;
    let base = map.as_mut_ptr();
    Some(Arc::new(Chunk { map, base }))
}

impl<T: Plain> std::ops::Deref for HugeSlice<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.inner {
            Inner::Heap(v) => v,
            // SAFETY: `from_vec` wrote `len` values of `T` at `offset`
            // (64-byte aligned in a page-aligned map, so aligned for `T`),
            // inside the chunk, which this buffer keeps alive, and nothing
            // writes them again.
            Inner::Huge { chunk, offset, len } => unsafe {
                std::slice::from_raw_parts(chunk.base.add(*offset) as *const T, *len)
            },
        }
    }
}

impl<T: Plain> std::fmt::Debug for HugeSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugeSlice")
            .field("len", &self.len())
            .field("on_huge_pages", &self.on_huge_pages())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_survive_the_move_and_chunks_are_shared_aligned_and_freed() {
        let a: Vec<u16> = (0..1000u16).collect();
        let b: Vec<u8> = (0..=255u8).cycle().take(3 << 20).collect();
        let (ha, hb) = (
            HugeSlice::from_vec(a.clone()),
            HugeSlice::from_vec(b.clone()),
        );
        assert_eq!(&ha[..], &a[..]);
        assert_eq!(&hb[..], &b[..]);
        assert_eq!(ha.as_ptr() as usize % ALIGN, 0);
        assert_eq!(hb.as_ptr() as usize % ALIGN, 0);
        let clone = hb.clone();
        drop(hb);
        assert_eq!(&clone[..], &b[..]);
        assert!(HugeSlice::<u8>::from_vec(Vec::new()).is_empty());
        let f = HugeSlice::from_fn(5000, |i| i as u64 * 3);
        assert!(f.iter().enumerate().all(|(i, &v)| v == i as u64 * 3));
        assert_eq!(f.as_ptr() as usize % ALIGN, 0);
        // A buffer larger than a chunk gets one of its own, here filled
        // exactly (no other test's buffer can land in it), which is freed
        // with the buffer.
        let big = HugeSlice::from_vec(vec![7u8; CHUNK + PAGE]);
        assert!(big.iter().all(|&v| v == 7) && big.len() == CHUNK + PAGE);
        if let Inner::Huge { chunk, offset, .. } = &big.inner {
            assert_eq!((*offset, chunk.map.len()), (0, CHUNK + PAGE));
            let weak = Arc::downgrade(chunk);
            drop(big);
            assert!(weak.upgrade().is_none(), "the chunk outlived its buffers");
        }
    }

    #[test]
    fn threads_get_disjoint_buffers() {
        let handles: Vec<_> = (0..4u8)
            .map(|t| {
                std::thread::spawn(move || {
                    (0..50)
                        .map(|i| {
                            let v = vec![t.wrapping_mul(50).wrapping_add(i); 1000 + i as usize];
                            (HugeSlice::from_vec(v.clone()), v)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            for (got, want) in h.join().unwrap() {
                assert_eq!(&got[..], &want[..]);
            }
        }
    }
}
