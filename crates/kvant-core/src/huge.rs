//! Buffers on transparent huge pages, for what decode streams from memory
//! every token: the weights repacked at load (read-only, [`HugeSlice`])
//! and the KV cache (zeroed, written as tokens come, [`HugeZeroed`]).
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

// SAFETY: `base` points into `map`, which lives as long as the chunk. Each
// range of it belongs to the one buffer `reserve` handed it to (under
// its `Open`'s lock, ranges never overlap and are never handed out again): a
// `HugeSlice` writes its range once, before anything reads it, and then
// only hands out shared slices; a `HugeZeroed` writes its range only
// through `&mut self`. So threads sharing a chunk share no byte that one
// of them may write while another reads it.
unsafe impl Send for Chunk {}
// SAFETY: as above.
unsafe impl Sync for Chunk {}

/// The chunk new buffers go to, and its first free byte. Weak: a chunk
/// whose buffers were all dropped (a model unloaded) is freed, not kept.
type Open = Mutex<Option<(Weak<Chunk>, usize)>>;

/// Where [`HugeSlice`]s (weights, read-only for good) go.
static OPEN: Open = Mutex::new(None);

/// Where [`HugeZeroed`] buffers (caches, made and dropped with sequences)
/// go: apart from the weights, so that a dropped cache's chunks are freed
/// rather than kept alive by weights sharing them.
static OPEN_ZEROED: Open = Mutex::new(None);

/// Element types a [`HugeSlice`] or [`HugeZeroed`] holds: plain values,
/// copied as they are, aligned to at most 64 bytes (checked at compile
/// time).
///
/// # Safety
/// All-zero bytes are a value of the type ([`HugeZeroed`] hands out
/// zeroed memory as values).
pub unsafe trait Plain: Copy + Send + Sync + 'static {}
// SAFETY: integers: every bit pattern, zero included, is a value.
unsafe impl Plain for u8 {}
// SAFETY: as for `u8`.
unsafe impl Plain for u16 {}
// SAFETY: as for `u8`.
unsafe impl Plain for u32 {}
// SAFETY: as for `u8`.
unsafe impl Plain for u64 {}

/// An immutable slice on transparent huge pages (or, failing that, the
/// heap), built from a `Vec` once and read ever after. Clones share it.
#[derive(Clone)]
pub struct HugeSlice<T: Plain> {
    inner: Inner<T>,
}

#[derive(Clone)]
enum Inner<T: Plain> {
    Heap(Arc<[T]>),
    Huge(Placed),
}

/// A range of a chunk that [`reserve`] handed to one buffer: `len` values
/// of the buffer's type at byte `offset` (64-byte aligned in a page-aligned
/// map, so aligned for the type), the chunk kept alive with it.
#[derive(Clone)]
struct Placed {
    chunk: Arc<Chunk>,
    offset: usize,
    len: usize,
}

impl Placed {
    fn ptr<T>(&self) -> *mut T {
        self.chunk.base.wrapping_add(self.offset) as *mut T
    }

    /// # Safety
    /// The range was reserved for `T` and its bytes are values of `T`
    /// (written, or zero for a [`Plain`] type), which nothing writes while
    /// the slice lives.
    unsafe fn slice<T>(&self) -> &[T] {
        // SAFETY: the caller's contract; the range lies inside the chunk.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    /// # Safety
    /// As for [`Self::slice`], and nothing else reads the range while the
    /// slice lives.
    unsafe fn slice_mut<T>(&mut self) -> &mut [T] {
        // SAFETY: the caller's contract; the range lies inside the chunk.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

impl<T: Plain> HugeSlice<T> {
    /// Moves `v`'s values onto huge pages (a copy; `v` is freed).
    pub fn from_vec(v: Vec<T>) -> Self {
        match reserve::<T>(&OPEN, v.len()) {
            // SAFETY: `reserve`'s range is `v.len()` values, ours alone.
            Some(placed) => unsafe {
                std::ptr::copy_nonoverlapping(v.as_ptr(), placed.ptr(), v.len());
                Self::huge(placed)
            },
            None => HugeSlice {
                inner: Inner::Heap(v.into()),
            },
        }
    }

    /// `len` values `f(0), f(1), ...` written straight onto huge pages
    /// (no copy on the heap first).
    pub fn from_fn(len: usize, f: impl Fn(usize) -> T) -> Self {
        match reserve::<T>(&OPEN, len) {
            // SAFETY: `reserve`'s range is `len` values, ours alone.
            Some(placed) => unsafe {
                let dst = placed.ptr::<T>();
                (0..len).for_each(|i| dst.add(i).write(f(i)));
                Self::huge(placed)
            },
            None => HugeSlice {
                inner: Inner::Heap((0..len).map(f).collect()),
            },
        }
    }

    /// # Safety
    /// Values of `T` were written to the whole of `placed`, a range from
    /// [`reserve`] for `T`.
    unsafe fn huge(placed: Placed) -> Self {
        HugeSlice {
            inner: Inner::Huge(placed),
        }
    }

    /// Whether the values are on a map advised for huge pages (else the heap).
    fn on_huge_pages(&self) -> bool {
        matches!(self.inner, Inner::Huge(_))
    }
}

/// A range of `len` values of `T` in a chunk of `open`'s, handed out once:
/// no buffer covers it and no other call gets it. `None` for no values, or
/// when no chunk can be made.
fn reserve<T: Plain>(open: &Open, len: usize) -> Option<Placed> {
    const { assert!(std::mem::align_of::<T>() <= ALIGN) };
    let bytes = len.checked_mul(std::mem::size_of::<T>())?;
    if bytes == 0 {
        return None;
    }
    let mut open = open.lock().unwrap_or_else(|p| p.into_inner());
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
    Some(Placed { chunk, offset, len })
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
            // SAFETY: `from_vec` or `from_fn` wrote the range's values of
            // `T`, and nothing writes them again.
            Inner::Huge(placed) => unsafe { placed.slice() },
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

/// A zeroed, writable buffer that decode writes a little of per token and
/// reads ever more of (the KV cache), on huge pages as [`HugeSlice`]s are
/// (carved from chunks of their own; the heap where the system refuses
/// them).
/// On 4 KiB pages attention's stream through a layer's keys and values
/// crosses a page every 4 KiB, as the weights' did (see the module's
/// notes). Caches here against the heap, alternated runs on one Zen 4 VM:
/// SmolLM2 Q4_1 after 2048 positions 123.4 -> 142.3 tok/s on one thread
/// (7 runs), 173.4 -> 194.8 on two (5); Gemma 3 Q4_K_M after 4096
/// positions 84.4 -> 93.6 on one (5); after 512, inside the spread.
///
/// A chunk's memory comes zero from the system, and no range of it is
/// handed out twice, so a new buffer is zero without being written; its
/// pages are committed as they are first written.
pub struct HugeZeroed<T: Plain> {
    inner: ZeroedInner<T>,
}

enum ZeroedInner<T: Plain> {
    Heap(Vec<T>),
    Huge(Placed),
}

impl<T: Plain> HugeZeroed<T> {
    /// `len` zero values; `None` if their bytes overflow `usize`.
    pub fn new(len: usize) -> Option<Self> {
        len.checked_mul(std::mem::size_of::<T>())?;
        let inner = match reserve::<T>(&OPEN_ZEROED, len) {
            Some(placed) => ZeroedInner::Huge(placed),
            // SAFETY: all-zero bytes are a `T` (the `Plain` contract).
            None => ZeroedInner::Heap(vec![unsafe { std::mem::zeroed() }; len]),
        };
        Some(HugeZeroed { inner })
    }

    /// Whether the values are on a map advised for huge pages (else the heap).
    pub fn on_huge_pages(&self) -> bool {
        matches!(self.inner, ZeroedInner::Huge(_))
    }
}

impl<T: Plain> std::ops::Deref for HugeZeroed<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.inner {
            ZeroedInner::Heap(v) => v,
            // SAFETY: the range was reserved for `T`; its bytes are zero
            // from the system (a `T`, by `Plain`) or were written as `T`
            // through `deref_mut`, whose borrow has ended.
            ZeroedInner::Huge(placed) => unsafe { placed.slice() },
        }
    }
}

impl<T: Plain> std::ops::DerefMut for HugeZeroed<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.inner {
            ZeroedInner::Heap(v) => v,
            // SAFETY: as in `deref`; no other buffer covers the range, and
            // the borrow of this one is unique.
            ZeroedInner::Huge(placed) => unsafe { placed.slice_mut() },
        }
    }
}

impl<T: Plain> std::fmt::Debug for HugeZeroed<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugeZeroed")
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
        if let Inner::Huge(Placed { chunk, offset, .. }) = &big.inner {
            assert_eq!((*offset, chunk.map.len()), (0, CHUNK + PAGE));
            let weak = Arc::downgrade(chunk);
            drop(big);
            assert!(weak.upgrade().is_none(), "the chunk outlived its buffers");
        }
    }

    #[test]
    fn zeroed_buffers_start_zero_and_keep_what_is_written() {
        // Where the system gives chunks at all (as it did this one), it
        // gives every buffer one.
        let ha = HugeSlice::from_vec(vec![1u8; 100]);
        for len in [0usize, 1, 1000, PAGE / 4 + 3, PAGE + 1] {
            let mut b = HugeZeroed::<u32>::new(len).expect("fits");
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&v| v == 0));
            assert_eq!(b.on_huge_pages(), len > 0 && ha.on_huge_pages());
            for (i, v) in b.iter_mut().enumerate() {
                *v = i as u32 ^ 0x5a5a;
            }
            assert!(b.iter().enumerate().all(|(i, &v)| v == i as u32 ^ 0x5a5a));
            assert!(ha.iter().all(|&v| v == 1), "a write reached another buffer");
            assert_eq!(b.as_ptr() as usize % std::mem::align_of::<u32>(), 0);
        }
        assert!(HugeZeroed::<u64>::new(usize::MAX / 4).is_none());
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
