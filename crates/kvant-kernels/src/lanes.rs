//! Element types a kernel reads straight into f32 lanes: f32 as stored,
//! f16 through F16C, bf16 by a 16-bit shift. Each conversion is exact, so
//! a kernel that reads f16 rows this way gives the bits it gives on the
//! same rows widened to f32 first; attention's decode path reads its f16
//! and bf16 cache this way instead of widening every tile into a buffer
//! (see `attention::rows`).

/// A value type that widens exactly to f32, one value or eight lanes at a time.
pub trait Lanes: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;

    /// Eight values from `p` widened to f32.
    ///
    /// # Safety
    /// The CPU supports AVX2 and F16C (every tier above scalar does) and
    /// `p` reads eight values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// Whether values are f32 already (kernels keep plain loops the
    /// compiler vectorizes for them).
    const F32: bool = false;
}

impl Lanes for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    const F32: bool = true;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract: `p` reads eight floats.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl Lanes for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract: F16C, and `p` reads 16 bytes.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

impl Lanes for half::bf16 {
    /// The bits in the high half of an f32, as the BF16 dequantizer widens
    /// (NaNs keep their payload).
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const half::bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract: AVX2, and `p` reads 16 bytes.
        unsafe {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
        }
    }
}

/// Rows a kernel reads, `len` of them, each of at least `width` values:
/// evenly spaced in one slice (a tile widened into a buffer) or gathered
/// from anywhere (a tile read as stored from the cache's blocks). The
/// bounds are checked once, where the set is made; kernels are compiled
/// once per kind ([`with_rows!`]), so that widened tiles are addressed as
/// cheaply as a plain stride (gathered row references cost prompt
/// attention 4–5% more instructions and 8% more time on widened tiles).
pub struct RowSet<'s, 'a, E> {
    src: Src<'s, 'a, E>,
    len: usize,
    width: usize,
}

enum Src<'s, 'a, E> {
    Strided(&'a [E], usize),
    Gathered(&'s [&'a [E]]),
}

impl<'s, 'a, E> RowSet<'s, 'a, E> {
    /// Rows `j·stride..j·stride + width` of `data` for `j < len`.
    ///
    /// # Panics
    /// If the last row runs past `data`.
    pub fn strided(data: &'a [E], stride: usize, len: usize, width: usize) -> Self {
        if let Some(last) = len.checked_sub(1) {
            assert!(
                last * stride + width <= data.len(),
                "RowSet: rows past the data"
            );
        }
        RowSet {
            src: Src::Strided(data, stride),
            len,
            width,
        }
    }

    /// The first `width` values of each of `rows`.
    ///
    /// # Panics
    /// If a row holds fewer than `width` values.
    pub fn gathered(rows: &'s [&'a [E]], width: usize) -> Self {
        assert!(
            rows.iter().all(|r| r.len() >= width),
            "RowSet: a row shorter than {width}"
        );
        RowSet {
            src: Src::Gathered(rows),
            len: rows.len(),
            width,
        }
    }

    /// [`RowSet::gathered`] without checking the rows' lengths, for rows
    /// cut to their width by construction: checking a decode tile's 64
    /// rows (keys and values) cost 3–4% of its attention.
    ///
    /// # Safety
    /// Every row of `rows` holds at least `width` values (kernels read
    /// that many from each row's start).
    pub(crate) unsafe fn gathered_unchecked(rows: &'s [&'a [E]], width: usize) -> Self {
        debug_assert!(rows.iter().all(|r| r.len() >= width));
        RowSet {
            src: Src::Gathered(rows),
            len: rows.len(),
            width,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Values each row holds.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The first `n` rows (all of them if fewer).
    pub fn head(self, n: usize) -> Self {
        RowSet {
            len: n.min(self.len),
            ..self
        }
    }

    /// The first `w` values of each row.
    ///
    /// # Panics
    /// If `w` is wider than the rows.
    pub fn narrow(self, w: usize) -> Self {
        assert!(w <= self.width, "RowSet: narrower than {w}");
        RowSet { width: w, ..self }
    }

    /// Row `j`.
    ///
    /// # Panics
    /// If `j >= len`.
    pub fn row(&self, j: usize) -> &'a [E] {
        assert!(j < self.len, "RowSet: row {j} of {}", self.len);
        match self.src {
            Src::Strided(d, s) => &d[j * s..][..self.width],
            Src::Gathered(g) => &g[j][..self.width],
        }
    }

    /// The rows' addressing, for [`with_rows!`].
    pub(crate) fn ptrs(self) -> Ptrs<'s, 'a, E> {
        match self.src {
            Src::Strided(data, stride) => Ptrs::Strided(Strided {
                data,
                stride,
                width: self.width,
            }),
            Src::Gathered(rows) => Ptrs::Gathered(Gathered {
                rows: &rows[..self.len],
                width: self.width,
            }),
        }
    }
}

/// How a kernel addresses row `j` of a [`RowSet`] (`j` below its length:
/// rows past it panic).
pub(crate) trait RowPtrs<'a, E>: Copy {
    fn row(&self, j: usize) -> &'a [E];

    /// Where row `j` starts, without the bounds checks of [`Self::row`]:
    /// only a row below the set's length may be read through it.
    fn ptr(&self, j: usize) -> *const E;
}

pub(crate) struct Strided<'a, E> {
    data: &'a [E],
    stride: usize,
    width: usize,
}

impl<'a, E> RowPtrs<'a, E> for Strided<'a, E> {
    #[inline(always)]
    fn row(&self, j: usize) -> &'a [E] {
        &self.data[j * self.stride..][..self.width]
    }

    #[inline(always)]
    fn ptr(&self, j: usize) -> *const E {
        self.data.as_ptr().wrapping_add(j * self.stride)
    }
}

pub(crate) struct Gathered<'s, 'a, E> {
    rows: &'s [&'a [E]],
    width: usize,
}

impl<'a, E> RowPtrs<'a, E> for Gathered<'_, 'a, E> {
    #[inline(always)]
    fn row(&self, j: usize) -> &'a [E] {
        &self.rows[j][..self.width]
    }

    #[inline(always)]
    fn ptr(&self, j: usize) -> *const E {
        self.rows[j].as_ptr()
    }
}

// Copy without `E: Copy` (derive would ask for it): these hold references only.
macro_rules! copy_refs {
    ($($t:ident<$($l:lifetime),*>),*) => {$(
        impl<$($l,)* E> Clone for $t<$($l,)* E> {
            fn clone(&self) -> Self {
                *self
            }
        }
        impl<$($l,)* E> Copy for $t<$($l,)* E> {}
    )*};
}
copy_refs!(RowSet<'s, 'a>, Src<'s, 'a>, Strided<'a>, Gathered<'s, 'a>);

pub(crate) enum Ptrs<'s, 'a, E> {
    Strided(Strided<'a, E>),
    Gathered(Gathered<'s, 'a, E>),
}

/// Runs `$body` with `$p` the [`RowPtrs`] of the [`RowSet`] `$rows`,
/// compiled once per kind of set.
macro_rules! with_rows {
    ($rows:expr, $p:ident => $body:expr) => {
        match $rows.ptrs() {
            $crate::lanes::Ptrs::Strided($p) => $body,
            $crate::lanes::Ptrs::Gathered($p) => $body,
        }
    };
}
pub(crate) use with_rows;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{self, SimdTier};

    /// Every tier's eight-lane load equals the scalar widening, bit for bit,
    /// on values from every f16 and bf16 class (normal, subnormal, zero,
    /// infinity, NaN).
    #[test]
    fn load8_equals_to_f32() {
        let bits: Vec<u16> = (0..=u16::MAX)
            .step_by(7)
            .chain([0x7c00, 0xfc00, 0x7e01, 0x0001, 0x8000])
            .collect();
        let f16s: Vec<half::f16> = bits.iter().map(|&b| half::f16::from_bits(b)).collect();
        let bf16s: Vec<half::bf16> = bits.iter().map(|&b| half::bf16::from_bits(b)).collect();
        for tier in cpu::available_tiers() {
            if tier == SimdTier::Scalar {
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            {
                check(&f16s);
                check(&bf16s);
                let f32s: Vec<f32> = f16s.iter().map(|h| h.to_f32()).collect();
                check(&f32s);
            }
        }
        // bf16 widening is the dequantizer's: the high half of the f32.
        for (b, h) in bits.iter().zip(&bf16s) {
            assert_eq!(Lanes::to_f32(*h).to_bits(), (*b as u32) << 16);
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn check<E: Lanes>(xs: &[E]) {
        for c in xs.chunks_exact(8) {
            let mut got = [0f32; 8];
            // SAFETY: the tier loop runs this only where AVX2 and F16C
            // were detected; `c` holds eight values and `got` eight floats.
            unsafe { std::arch::x86_64::_mm256_storeu_ps(got.as_mut_ptr(), E::load8(c.as_ptr())) };
            for (g, x) in got.iter().zip(c) {
                assert_eq!(g.to_bits(), x.to_f32().to_bits(), "{}", x.to_f32());
            }
        }
    }

    /// Both kinds of set give the same rows; `head` and `narrow` cut them;
    /// the two kinds' addressing agrees with `row`.
    #[test]
    fn row_sets_address_the_rows_they_were_made_of() {
        let data: Vec<f32> = (0..40).map(|i| i as f32).collect();
        let strided = RowSet::strided(&data, 10, 4, 7);
        let rows: Vec<&[f32]> = data.chunks(10).collect();
        let gathered = RowSet::gathered(&rows, 7);
        for j in 0..4 {
            assert_eq!(strided.row(j), &data[j * 10..j * 10 + 7]);
            assert_eq!(gathered.row(j), strided.row(j));
        }
        assert_eq!(strided.head(2).len(), 2);
        assert_eq!(gathered.head(9).len(), 4);
        assert_eq!(strided.narrow(3).row(3), &[30.0, 31.0, 32.0]);
        for set in [strided, gathered] {
            with_rows!(set, p => {
                for j in 0..4 {
                    assert_eq!(p.row(j), set.row(j));
                    assert_eq!(p.ptr(j), set.row(j).as_ptr());
                }
            });
        }
    }

    #[test]
    #[should_panic(expected = "rows past the data")]
    fn strided_rows_past_the_data_panic() {
        RowSet::strided(&[0f32; 20], 10, 2, 11);
    }

    #[test]
    #[should_panic(expected = "a row shorter than 4")]
    fn gathered_short_rows_panic() {
        let (a, b) = ([0f32; 4], [0f32; 3]);
        RowSet::gathered(&[&a[..], &b[..]], 4);
    }

    #[test]
    #[should_panic(expected = "row 2 of 2")]
    fn rows_past_the_set_panic() {
        RowSet::strided(&[0f32; 20], 10, 2, 10).row(2);
    }
}
