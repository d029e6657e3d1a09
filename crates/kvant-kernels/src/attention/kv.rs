//! How attention sees one layer of a KV cache: fixed-size blocks of
//! head-major rows, addressed through each sequence's block table, in one
//! of the element types of [`KvDType`].
//!
//! Within a block, layout `[n_kv_heads, block_size, head_dim]`: the keys one
//! work item reads (one KV head, consecutive positions) are contiguous for
//! a whole block, so a tile is one or two sequential reads the prefetchers
//! follow, not `head_dim` floats every `kv_dim` (a token-major stride).
//!
//! Rows are stored in *units* of [`KvElem::VALUES`] values: one value for
//! f32, f16 and bf16; one 32-value block in ggml's layout (an f16 scale
//! and the quants) for Q8_0 and Q4_0. A row of `dim` values is `dim /
//! VALUES` units, so a quantized row never shares a block with another row
//! (its size must be a multiple of 32): a stored row never changes when a
//! later one is written, and a row's values do not depend on its
//! neighbours. Narrower types cut the bytes a decode step streams (f16 and
//! bf16: 2 per value, Q8_0: 34 per 32, Q4_0: 18 per 32); tiles are widened
//! to f32 once per item and tile, straight from the stored units, and all
//! arithmetic stays f32.
//!
//! Integer q·k (the item's query rows quantized to 8 bits, each score
//! `Σ d_k·d_q·Σ k·q` over the key blocks as ggml's `vec_dot_q8_0_q8_0`)
//! was tried and measured no faster (`benches/attention.rs`, one thread):
//! once the Q8_0/Q4_0 dequantizers lost a dependency chain (see
//! `quant::q8_0`), widening a Q8_0 tile costs about what an f16 one does,
//! and a decode step at 2048 positions of SmolLM2's shape ran within noise
//! of the widening path (0.95–1.07× f16 both ways); on DeepSeek-V3's latent
//! shape, whose values are the key rows and must be widened anyway, it was
//! 1.3× slower (2.2 ms against 1.7). So block types take the same f32
//! path as the others, and the queries are not rounded.
//!
//! [`KvBuffer`] holds one array of units whose type is chosen at run time
//! (what a pool allocates per layer); [`KvLayer`] pairs a layer's key and
//! value buffers for [`super::attention_dyn`]. The one `match` over the
//! element types is [`with_kv_elem`].

use crate::cpu::{self, SimdTier};
use crate::error::{checked_mul, KernelError};
use crate::quant::RowKernel;
use half::slice::HalfFloatSliceExt;
use kvant_core::{DType, HugeZeroed};
use std::any::TypeId;

/// The element types a KV cache can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDType {
    F32,
    F16,
    Bf16,
    /// ggml's Q8_0: per 32 values an f16 scale and 32 signed bytes.
    Q8_0,
    /// ggml's Q4_0: per 32 values an f16 scale and 16 bytes of nibbles.
    Q4_0,
}

impl KvDType {
    pub const ALL: [KvDType; 5] = [
        KvDType::F32,
        KvDType::F16,
        KvDType::Bf16,
        KvDType::Q8_0,
        KvDType::Q4_0,
    ];

    /// The name `--kv-cache-type` takes.
    pub fn name(self) -> &'static str {
        match self {
            KvDType::F32 => "f32",
            KvDType::F16 => "f16",
            KvDType::Bf16 => "bf16",
            KvDType::Q8_0 => "q8_0",
            KvDType::Q4_0 => "q4_0",
        }
    }

    /// Values one storage unit holds: 1, or a quantized block's 32.
    pub fn unit_values(self) -> usize {
        match self {
            KvDType::F32 | KvDType::F16 | KvDType::Bf16 => 1,
            KvDType::Q8_0 | KvDType::Q4_0 => 32,
        }
    }

    /// Bytes of one storage unit.
    fn unit_bytes(self) -> usize {
        match self {
            KvDType::F32 => 4,
            KvDType::F16 | KvDType::Bf16 => 2,
            KvDType::Q8_0 => 34,
            KvDType::Q4_0 => 18,
        }
    }

    /// Bytes of a row of `values` values; `None` unless the row is whole
    /// units (a multiple of 32 values for the block types).
    pub fn row_bytes(self, values: usize) -> Option<usize> {
        values
            .is_multiple_of(self.unit_values())
            .then(|| (values / self.unit_values()).checked_mul(self.unit_bytes()))
            .flatten()
    }

    /// Bytes `values` values would take, the last unit counted whole (for
    /// reports about rows this type could not store).
    pub fn bytes_rounded_up(self, values: usize) -> usize {
        values
            .div_ceil(self.unit_values())
            .saturating_mul(self.unit_bytes())
    }
}

impl std::fmt::Display for KvDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A storage unit of a KV cache: one value, or one block of values.
///
/// # Safety
/// Implementors are plain data: no padding, every bit pattern a valid
/// value, alignment at most 4, and `size_of::<Self>() ==
/// Self::DTYPE.unit_bytes()`, so [`KvBuffer`] may hand out its zeroed words
/// as units and the codecs may read and write units as bytes
/// (little-endian, as ggml stores them).
pub unsafe trait KvElem: Copy + Send + Sync + 'static {
    const DTYPE: KvDType;
    /// Values per unit (`DTYPE.unit_values()`).
    const VALUES: usize;
    /// Widens `src` into `dst` (`src.len() * VALUES` values) on `tier`
    /// (lowered to one the CPU supports); every tier gives the same bits.
    fn widen(tier: SimdTier, src: &[Self], dst: &mut [f32]);
    /// Narrows `src` (`dst.len() * VALUES` values) into `dst`: rounding to
    /// nearest even for the float types, ggml's reference quantizers for
    /// the block types.
    fn narrow(src: &[f32], dst: &mut [Self]);
}

// SAFETY: f32 is plain data of 4 bytes, alignment 4.
unsafe impl KvElem for f32 {
    const DTYPE: KvDType = KvDType::F32;
    const VALUES: usize = 1;
    fn widen(_: SimdTier, src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

// SAFETY: f16 is a `u16` (2 bytes, alignment 2) whose every bit pattern is
// a value.
unsafe impl KvElem for half::f16 {
    const DTYPE: KvDType = KvDType::F16;
    const VALUES: usize = 1;
    fn widen(tier: SimdTier, src: &[half::f16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        if cpu::clamp(tier) >= SimdTier::Avx2 {
            // SAFETY: the clamped tier has AVX2, which implies F16C here
            // (the tier requires it); lengths are equal (asserted).
            return unsafe { widen_f16c(src, dst) };
        }
        let _ = tier;
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [half::f16]) {
        dst.convert_from_f32_slice(src);
    }
}

// SAFETY: bf16 is a `u16` (2 bytes, alignment 2) whose every bit pattern
// is a value.
unsafe impl KvElem for half::bf16 {
    const DTYPE: KvDType = KvDType::Bf16;
    const VALUES: usize = 1;
    fn widen(tier: SimdTier, src: &[half::bf16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        RowKernel::new(DType::BF16, tier).dequantize(as_bytes(src), dst);
    }
    fn narrow(src: &[f32], dst: &mut [half::bf16]) {
        // `half` rounds to nearest, ties to even (NaN stays NaN).
        dst.convert_from_f32_slice(src);
    }
}

/// One Q8_0 block as ggml lays it out: the scale `d` (f16, little-endian)
/// and 32 signed quants; value `i` is `qs[i] · d`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: [u8; 2],
    pub qs: [u8; 32],
}

/// One Q4_0 block as ggml lays it out: the scale `d` (f16, little-endian)
/// and 16 bytes whose low nibbles are values 0..16 and high nibbles values
/// 16..32; value `i` is `(nibble - 8) · d`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: [u8; 2],
    pub qs: [u8; 16],
}

/// The block codecs: ggml's reference quantizer to store, the quant
/// module's dequantizer (AVX2 where the tier has it, bit-identical to the
/// scalar one) to widen.
macro_rules! block_elem {
    ($block:ty, $kv:ident, $dtype:ident, $quantize:path) => {
        // SAFETY: `repr(C)` over byte arrays: no padding, alignment 1,
        // every bit pattern a value, `DTYPE.unit_bytes()` bytes.
        unsafe impl KvElem for $block {
            const DTYPE: KvDType = KvDType::$kv;
            const VALUES: usize = 32;
            fn widen(tier: SimdTier, src: &[Self], dst: &mut [f32]) {
                assert_eq!(src.len() * Self::VALUES, dst.len());
                RowKernel::new(DType::$dtype, tier).dequantize(as_bytes(src), dst);
            }
            fn narrow(src: &[f32], dst: &mut [Self]) {
                assert_eq!(src.len(), dst.len() * Self::VALUES);
                $quantize(src, as_bytes_mut(dst));
            }
        }
    };
}
block_elem!(BlockQ8_0, Q8_0, Q8_0, crate::quant::q8_0::quantize_ref);
block_elem!(BlockQ4_0, Q4_0, Q4_0, crate::quant::q4_0::quantize_ref);

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

/// The bytes of some units.
fn as_bytes<T: KvElem>(s: &[T]) -> &[u8] {
    // SAFETY: `KvElem` units are plain data without padding, so all
    // `size_of_val(s)` bytes are initialised; u8 needs no alignment.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

/// The bytes of some units, to write.
fn as_bytes_mut<T: KvElem>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`, and every bit pattern is a valid `T`
    // (the `KvElem` contract), so any bytes written leave valid units.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}

/// Runs `$body` with `$t` naming the unit type of `$dtype` (a
/// [`KvDType`]): the one dispatch from a run-time element type to the
/// generic kernels.
macro_rules! with_kv_elem {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::attention::kv::KvDType::F32 => {
                type $t = f32;
                $body
            }
            $crate::attention::kv::KvDType::F16 => {
                type $t = half::f16;
                $body
            }
            $crate::attention::kv::KvDType::Bf16 => {
                type $t = half::bf16;
                $body
            }
            $crate::attention::kv::KvDType::Q8_0 => {
                type $t = $crate::attention::kv::BlockQ8_0;
                $body
            }
            $crate::attention::kv::KvDType::Q4_0 => {
                type $t = $crate::attention::kv::BlockQ4_0;
                $body
            }
        }
    };
}
pub(crate) use with_kv_elem;

/// f16 → f32, 8 values per instruction, inlined into the tile loop (the
/// `half` crate's slice conversion calls a function per 8 values).
///
/// # Safety
/// The CPU supports F16C and AVX; `src` and `dst` have equal lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_f16c(src: &[half::f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n8 = src.len() / 8 * 8;
    let (s, d) = (src.as_ptr() as *const u8, dst.as_mut_ptr());
    for i in (0..n8).step_by(8) {
        // SAFETY: `i + 8 <= len` for both slices (2 and 4 bytes per value).
        let h = unsafe { _mm_loadu_si128(s.add(2 * i) as *const __m128i) };
        unsafe { _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(h)) };
    }
    for (o, h) in dst[n8..].iter_mut().zip(&src[n8..]) {
        *o = h.to_f32();
    }
}

/// One layer's keys and values in fixed-size blocks (PagedAttention):
/// keys `[n_blocks, n_kv_heads, block_size, head_dim]`, values the same
/// with `v_dim`, in units of `T` (`head_dim / T::VALUES` per row). Within
/// a block the layout is head-major, so a key tile of one head is
/// contiguous for up to `block_size` positions. A contiguous cache is the
/// special case of one block of `capacity` positions.
#[derive(Clone, Copy)]
pub struct KvBlocks<'a, T> {
    pub k: &'a [T],
    /// `None` when the values are the first `v_dim` elements of each key
    /// row: multi-head latent attention caches one latent vector per
    /// token (its compressed KV followed by the rotary key part) that
    /// serves as both, so only it is stored and streamed.
    pub v: Option<&'a [T]>,
    pub block_size: usize,
}

impl<'a, T: KvElem> KvBlocks<'a, T> {
    /// The same blocks as units of `E`, when `E` is `T` (how a kernel
    /// generic over the cache type picks a path written for one type).
    pub(super) fn cast<E: KvElem>(&self) -> Option<KvBlocks<'a, E>> {
        if TypeId::of::<T>() != TypeId::of::<E>() {
            return None;
        }
        let cast = |s: &'a [T]| {
            // SAFETY: `E` is `T` (same `TypeId`), so the slice is
            // reinterpreted as itself.
            unsafe { std::slice::from_raw_parts(s.as_ptr() as *const E, s.len()) }
        };
        Some(KvBlocks {
            k: cast(self.k),
            v: self.v.map(cast),
            block_size: self.block_size,
        })
    }

    /// The stored key rows (`head_dim / VALUES` units each) and value
    /// rows (`v_dim / VALUES` units each; none when the values are in the
    /// keys) of KV head `h` from position `j` of the sequence whose blocks
    /// are `table`, to the end of `j`'s block or `max` rows, and how many
    /// rows that is: the rows one contiguous read gives.
    pub(super) fn rows_from(
        &self,
        table: &[u32],
        n_kv_heads: usize,
        (hd, vd): (usize, usize),
        h: usize,
        (j, max): (usize, usize),
    ) -> (&'a [T], &'a [T], usize) {
        let bs = self.block_size;
        let (ku, vu) = (hd / T::VALUES, vd / T::VALUES);
        let (b, slot) = (table[j / bs] as usize, j % bs);
        let run = (bs - slot).min(max);
        let row = b * n_kv_heads * bs + h * bs + slot;
        let k = &self.k[row * ku..(row + run) * ku];
        let v = match self.v {
            Some(v) => &v[row * vu..(row + run) * vu],
            None => &[],
        };
        (k, v, run)
    }

    /// Units per block of rows of `dim` values.
    pub(super) fn block_units(&self, n_kv_heads: usize, dim: usize) -> usize {
        n_kv_heads * self.block_size * (dim / T::VALUES)
    }

    /// Blocks held (the valid range of table entries).
    pub(super) fn n_blocks(&self, n_kv_heads: usize, head_dim: usize) -> usize {
        self.k.len() / self.block_units(n_kv_heads, head_dim).max(1)
    }

    /// Widens positions `j0..j0 + n` of head `at` (position `j` is slot
    /// `j % block_size` of block `table[j / block_size]`) into the first
    /// `n * head_dim` values of `kt` and (stored values only) the first
    /// `n * v_dim` of `vt`, one contiguous run of units per block crossed.
    pub(super) fn widen_tile(
        &self,
        tier: SimdTier,
        at: &HeadRows<'_>,
        (j0, n): (usize, usize),
        (kt, vt): (&mut [f32], &mut [f32]),
    ) {
        let bs = self.block_size;
        let mut j = j0;
        while j < j0 + n {
            let run = (bs - j % bs).min(j0 + n - j);
            self.widen_run(tier, at, (j, run), j - j0, kt, vt);
            j += run;
        }
    }

    /// Widens the rows of head `at` at `positions` (any order) into the
    /// first `positions.len() * head_dim` values of `kt` and (stored values
    /// only) `positions.len() * v_dim` of `vt`: the gathered tile of a
    /// sparse attention kernel.
    pub(super) fn widen_rows(
        &self,
        tier: SimdTier,
        at: &HeadRows<'_>,
        positions: &[u32],
        (kt, vt): (&mut [f32], &mut [f32]),
    ) {
        for (i, &j) in positions.iter().enumerate() {
            self.widen_run(tier, at, (j as usize, 1), i, kt, vt);
        }
    }

    /// Widens the `run` rows of head `at` from position `j` (all in `j`'s
    /// block) into rows `i..i + run` of `kt` and (stored values only) `vt`.
    #[inline(always)]
    fn widen_run(
        &self,
        tier: SimdTier,
        at: &HeadRows<'_>,
        (j, run): (usize, usize),
        i: usize,
        kt: &mut [f32],
        vt: &mut [f32],
    ) {
        let bs = self.block_size;
        let (hd, vd) = at.dims;
        let (ku, vu) = (hd / T::VALUES, vd / T::VALUES);
        let (k_block, v_block) = (at.n_kv_heads * bs * ku, at.n_kv_heads * bs * vu);
        let b = at.table[j / bs] as usize;
        let row = at.h * bs + j % bs;
        let src = b * k_block + row * ku;
        T::widen(
            tier,
            &self.k[src..src + run * ku],
            &mut kt[i * hd..(i + run) * hd],
        );
        if let Some(v) = self.v {
            let src = b * v_block + row * vu;
            T::widen(
                tier,
                &v[src..src + run * vu],
                &mut vt[i * vd..(i + run) * vd],
            );
        }
    }
}

/// Where one KV head's rows of one sequence live in a block store: the
/// sequence's block table, the layer's KV heads and (key, value) head
/// sizes, and the head.
pub(super) struct HeadRows<'a> {
    pub table: &'a [u32],
    pub n_kv_heads: usize,
    pub dims: (usize, usize),
    pub h: usize,
}

/// Writes `n` tokens' keys or values (`src`, token-major `[n, n_kv_heads *
/// head_dim]`) at positions `pos..pos + n` of a sequence whose blocks are
/// `table`, in a block store `dst` laid out as [`KvBlocks`] with `dims`
/// (block size, KV heads, head size).
///
/// # Panics
/// If `head_dim` is not whole units of `T`, a position falls outside the
/// table or a block outside `dst`, or the slices disagree (a bug in the
/// caller: row sizes are checked when a pool is made, block tables are
/// engine-made).
pub fn store_rows<T: KvElem>(
    src: &[f32],
    dst: &mut [T],
    dims: (usize, usize, usize),
    table: &[u32],
    pos: usize,
) {
    let (units, at) = head_rows::<T>(dims, table, pos, src.len());
    for (at, row) in at.zip(src.chunks_exact(dims.2)) {
        T::narrow(row, &mut dst[at..at + units]);
    }
}

/// Reads back positions `pos..pos + n` of a sequence whose blocks are
/// `table` from a block store `src` laid out as [`KvBlocks`], widened into
/// `dst` (token-major `[n, n_kv_heads * head_dim]`) on the start-up tier:
/// the inverse of [`store_rows`] (up to its rounding), for paths that
/// recompute from cached rows (latent attention's expanded prefill).
///
/// # Panics
/// As [`store_rows`].
pub fn load_rows<T: KvElem>(
    src: &[T],
    dst: &mut [f32],
    dims: (usize, usize, usize),
    table: &[u32],
    pos: usize,
) {
    let tier = cpu::tier();
    let (units, at) = head_rows::<T>(dims, table, pos, dst.len());
    for (at, row) in at.zip(dst.chunks_exact_mut(dims.2)) {
        T::widen(tier, &src[at..at + units], row);
    }
}

/// Units of `T` in a row of `dim` values.
fn row_units<T: KvElem>(dim: usize) -> usize {
    assert!(
        dim.is_multiple_of(T::VALUES),
        "rows of {dim} values are not whole {} units",
        T::DTYPE
    );
    dim / T::VALUES
}

/// Where the `values` token-major values from position `pos` of a sequence
/// whose blocks are `table` live in a block store of `T` laid out as
/// [`KvBlocks`] with `dims` (block size, KV heads, head size): the units
/// per row, and the offset (in units) of each token's each head's
/// `head_dim` values, in that order.
///
/// # Panics
/// If `head_dim` is not whole units of `T`, or `values` not whole tokens.
fn head_rows<T: KvElem>(
    (block_size, n_kv_heads, head_dim): (usize, usize, usize),
    table: &[u32],
    pos: usize,
    values: usize,
) -> (usize, impl Iterator<Item = usize> + '_) {
    let units = row_units::<T>(head_dim);
    let kv_dim = n_kv_heads * head_dim;
    assert!(kv_dim > 0 && block_size > 0);
    assert_eq!(values % kv_dim, 0);
    let per_block = n_kv_heads * units * block_size;
    let at = (pos..pos + values / kv_dim).flat_map(move |j| {
        let b = table[j / block_size] as usize;
        let slot = j % block_size;
        (0..n_kv_heads).map(move |h| b * per_block + (h * block_size + slot) * units)
    });
    (units, at)
}

/// Zeroed storage for values of a KV element type chosen at run time:
/// what a pool allocates per layer and per array (keys, values, or any
/// other per-layer rows). The memory comes from the system already zero,
/// so a large pool costs no start-up time and its pages (2 MiB huge pages
/// where the system grants them) are committed only when first written.
pub struct KvBuffer {
    dtype: KvDType,
    units: usize,
    /// The units' bytes, in 4-byte words (the largest unit alignment), on
    /// huge pages (see [`HugeZeroed`]).
    words: HugeZeroed<u32>,
}

impl KvBuffer {
    /// Room for `values` values of `dtype`, zeroed.
    ///
    /// # Errors
    /// [`KernelError::KvUnits`] unless `values` is whole units of `dtype`;
    /// [`KernelError::SizeOverflow`] if the bytes overflow.
    pub fn zeroed(dtype: KvDType, values: usize) -> Result<Self, KernelError> {
        if !values.is_multiple_of(dtype.unit_values()) {
            return Err(KernelError::KvUnits {
                dtype: dtype.name(),
                values,
                unit: dtype.unit_values(),
            });
        }
        let units = values / dtype.unit_values();
        let bytes = checked_mul("KV buffer", units, dtype.unit_bytes())?;
        if bytes > isize::MAX as usize {
            return Err(KernelError::SizeOverflow {
                op: "KV buffer",
                a: units,
                b: dtype.unit_bytes(),
            });
        }
        let words = HugeZeroed::new(bytes.div_ceil(4)).ok_or(KernelError::SizeOverflow {
            op: "KV buffer",
            a: units,
            b: dtype.unit_bytes(),
        })?;
        Ok(KvBuffer {
            dtype,
            units,
            words,
        })
    }

    pub fn dtype(&self) -> KvDType {
        self.dtype
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.units * self.dtype.unit_values()
    }

    pub fn is_empty(&self) -> bool {
        self.units == 0
    }

    /// Bytes the values occupy.
    pub fn bytes(&self) -> usize {
        self.units * self.dtype.unit_bytes()
    }

    /// The units, as `T`.
    ///
    /// # Panics
    /// If `T` is not the buffer's element type (a bug in the caller).
    pub fn units<T: KvElem>(&self) -> &[T] {
        self.check::<T>();
        // SAFETY: `words` holds at least `units * size_of::<T>()` bytes
        // (made so in `zeroed` for this type, checked by `check`), its
        // alignment (4) is at least `T`'s, and every bit pattern is a
        // valid `T` (the `KvElem` contract).
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const T, self.units) }
    }

    /// The units, as `T`, to write.
    ///
    /// # Panics
    /// As [`Self::units`].
    fn units_mut<T: KvElem>(&mut self) -> &mut [T] {
        self.check::<T>();
        // SAFETY: as in `units`; the borrow is unique.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut T, self.units) }
    }

    fn check<T: KvElem>(&self) {
        const { assert!(std::mem::align_of::<T>() <= std::mem::align_of::<u32>()) };
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "a {} KV buffer read as {}",
            self.dtype,
            T::DTYPE
        );
        assert_eq!(std::mem::size_of::<T>(), self.dtype.unit_bytes());
    }

    /// [`store_rows`] into this buffer.
    ///
    /// # Panics
    /// As [`store_rows`].
    pub fn store_rows(
        &mut self,
        src: &[f32],
        dims: (usize, usize, usize),
        table: &[u32],
        pos: usize,
    ) {
        with_kv_elem!(self.dtype, T => store_rows::<T>(src, self.units_mut::<T>(), dims, table, pos))
    }

    /// [`load_rows`] from this buffer.
    ///
    /// # Panics
    /// As [`store_rows`].
    pub fn load_rows(
        &self,
        dst: &mut [f32],
        dims: (usize, usize, usize),
        table: &[u32],
        pos: usize,
    ) {
        with_kv_elem!(self.dtype, T => load_rows::<T>(self.units::<T>(), dst, dims, table, pos))
    }
}

/// One layer of a KV cache in [`KvBuffer`]s: what a pool hands to
/// [`super::attention_dyn`]. Keys and values (when stored) share one
/// element type.
#[derive(Clone, Copy)]
pub struct KvLayer<'a> {
    pub k: &'a KvBuffer,
    /// `None` for a latent cache (see [`KvBlocks::v`]).
    pub v: Option<&'a KvBuffer>,
    pub block_size: usize,
}

impl<'a> KvLayer<'a> {
    pub fn dtype(&self) -> KvDType {
        self.k.dtype
    }

    /// The layer as blocks of `T`.
    ///
    /// # Panics
    /// If `T` is not the buffers' element type (a bug in the caller).
    pub fn blocks<T: KvElem>(&self) -> KvBlocks<'a, T> {
        KvBlocks {
            k: self.k.units::<T>(),
            v: self.v.map(KvBuffer::units::<T>),
            block_size: self.block_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The kernels' dtype of a cache type, for the quant module's references.
    fn core_dtype(dtype: KvDType) -> DType {
        match dtype {
            KvDType::F32 => DType::F32,
            KvDType::F16 => DType::F16,
            KvDType::Bf16 => DType::BF16,
            KvDType::Q8_0 => DType::Q8_0,
            KvDType::Q4_0 => DType::Q4_0,
        }
    }

    /// ggml's bytes for `x` in `dtype`, from the plain references: the
    /// `half` crate's (round to nearest even) conversions, ggml's reference
    /// quantizers.
    fn reference_bytes(dtype: KvDType, x: &[f32]) -> Vec<u8> {
        match dtype {
            KvDType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            KvDType::F16 => x
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            KvDType::Bf16 => x
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            KvDType::Q8_0 | KvDType::Q4_0 => {
                let mut b = vec![0u8; x.len() / 32 * dtype.unit_bytes()];
                match dtype {
                    KvDType::Q8_0 => quant::quantize_row_q8_0(x, &mut b),
                    _ => quant::quantize_row_q4_0(x, &mut b),
                }
                .expect("whole blocks");
                b
            }
        }
    }

    /// Every codec writes ggml's bytes and widens them, on every tier, to
    /// exactly the quant module's reference dequantization, for odd
    /// numbers of units, zero blocks, ties and large values.
    #[test]
    fn codecs_match_the_references_on_every_tier() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        for dtype in KvDType::ALL {
            for units in [1usize, 3, 7, 13, 64] {
                let n = units * dtype.unit_values();
                let mut x: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
                x[0] = 0.5;
                if n >= 64 {
                    x[32..64].fill(0.0);
                    x[5] = 1e4;
                    x[6] = -1.0 + f32::EPSILON;
                }
                let want = reference_bytes(dtype, &x);
                let got = with_kv_elem!(dtype, T => {
                    let mut t = vec![T::default(); units];
                    T::narrow(&x, &mut t);
                    as_bytes(&t).to_vec()
                });
                assert_eq!(got, want, "{dtype} narrow, {units} units");
                let mut want_back = vec![0f32; n];
                quant::dequantize_row_ref(core_dtype(dtype), &want, &mut want_back)
                    .expect("whole units");
                for tier in cpu::available_tiers() {
                    let back = with_kv_elem!(dtype, T => {
                        let mut t = vec![T::default(); units];
                        T::narrow(&x, &mut t);
                        let mut back = vec![f32::NAN; n];
                        T::widen(tier, &t, &mut back);
                        back
                    });
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&back), bits(&want_back), "{tier} {dtype} widen");
                }
            }
        }
    }

    /// bf16 rounds to nearest, ties to even: the top 16 bits of the f32,
    /// plus one where the rest is over half (or exactly half and the kept
    /// part odd).
    #[test]
    fn bf16_rounds_to_nearest_even() {
        let f = |bits: u32| f32::from_bits(bits);
        let cases = [
            (0x3F80_8000, 0x3F80), // 1 + 2⁻⁸: a tie, kept part even: down
            (0x3F81_8000, 0x3F82), // 1 + 3·2⁻⁸: a tie, kept part odd: up
            (0x3F80_8001, 0x3F81), // just over half: up
            (0x3F80_7FFF, 0x3F80), // just under half: down
            (0xBF81_8000, 0xBF82), // negative ties too
            (0x7F7F_FFFF, 0x7F80), // the largest f32 rounds to infinity
        ];
        let x: Vec<f32> = cases.iter().map(|c| f(c.0)).collect();
        let mut t = vec![half::bf16::ZERO; x.len()];
        half::bf16::narrow(&x, &mut t);
        let got: Vec<u16> = t.iter().map(|b| b.to_bits()).collect();
        let want: Vec<u16> = cases.iter().map(|c| c.1).collect();
        assert_eq!(got, want);
    }

    /// Sizes: 34 and 18 bytes per 32 values, 2 per value for f16 and bf16.
    #[test]
    fn row_bytes_count_the_real_bytes() {
        let sizes = KvDType::ALL.map(|d| (d, d.row_bytes(64), d.row_bytes(48)));
        assert_eq!(
            sizes,
            [
                (KvDType::F32, Some(256), Some(192)),
                (KvDType::F16, Some(128), Some(96)),
                (KvDType::Bf16, Some(128), Some(96)),
                (KvDType::Q8_0, Some(68), None),
                (KvDType::Q4_0, Some(36), None),
            ]
        );
        assert_eq!(KvDType::Q8_0.bytes_rounded_up(48), 68);
        for d in KvDType::ALL {
            let b = KvBuffer::zeroed(d, 96).expect("whole units");
            assert_eq!((b.len(), b.bytes()), (96, d.row_bytes(96).unwrap_or(0)));
        }
    }

    /// A buffer holds whole units only, and only its own type reads it.
    #[test]
    fn buffers_hold_whole_units_of_their_type() {
        for d in [KvDType::Q8_0, KvDType::Q4_0] {
            let e = KvBuffer::zeroed(d, 40).err().map(|e| e.to_string());
            assert_eq!(
                e.as_deref(),
                Some(
                    format!("40 values are not whole units of a {d} KV cache (32 values each)")
                        .as_str()
                )
            );
        }
        assert!(KvBuffer::zeroed(KvDType::Q8_0, usize::MAX / 32 * 32).is_err());
        let b = KvBuffer::zeroed(KvDType::Q8_0, 64).expect("two blocks");
        assert_eq!(b.units::<BlockQ8_0>(), [BlockQ8_0::default(); 2]);
        let read = std::panic::catch_unwind(|| b.units::<half::f16>().len());
        assert!(read.is_err(), "a q8_0 buffer read as f16");
    }
}
