//! Activations quantized on the fly to 8 bits, 32 values per block.
//!
//! The int8 kernels multiply 8-bit weights (or 4-bit, widened) by 8-bit
//! activations with integer dot products, 32 products per instruction
//! instead of 8 multiply-adds per f32 FMA, and apply the float scales once
//! per block. As in llama.cpp's `q8_0`/`q8_1`: `d = max|x| / 127`,
//! `q = round(x / d)`, and each block also keeps `s = d · Σ q` for formats
//! with a per-block minimum (`Σ (d_w q_w + m_w) x ≈ d_w d Σ q_w q + m_w s`).
//!
//! Rounding is to nearest, ties to even, in both the scalar reference and
//! the AVX2 path, so the two are bit-identical and the kernels built on them
//! can be compared exactly.

use crate::cpu::SimdTier;
use crate::error::{check_len, checked_mul, KernelError};
use crate::pool::{self, DisjointSlice};

/// Values per activation block (matches the weight blocks of Q4_0/Q4_1/Q5_0/Q8_0).
pub const BLOCK: usize = 32;

/// `n_tokens` rows of `k` activations, quantized per block of [`BLOCK`].
#[derive(Clone, Debug, Default)]
pub struct Q8Activations {
    /// `[n_tokens, k]` quantized values in `-127..=127`.
    pub(crate) qs: Vec<i8>,
    /// `[n_tokens, k / BLOCK]` block scales.
    pub(crate) d: Vec<f32>,
    /// `[n_tokens, k / BLOCK]`: `d · Σ q` of each block.
    pub(crate) s: Vec<f32>,
    /// `[n_tokens, k / BLOCK]`: `Σ q` of each block, exact (the VNNI Q8_0
    /// kernel's offset correction).
    pub(crate) sums: Vec<i32>,
    /// `[n_tokens, k / BLOCK]`: each block's [`offsets_ref`] (the Q6_K
    /// kernels' `32 Σ x` of each half block, once per token instead of
    /// once per row group and token).
    pub(crate) offsets: Vec<[i32; 2]>,
    pub(crate) n_tokens: usize,
    pub(crate) k: usize,
}

impl Q8Activations {
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    pub fn k(&self) -> usize {
        self.k
    }

    /// Quantizes `x` (`[n_tokens, k]`, `k` a multiple of [`BLOCK`]) on
    /// `tier`, reusing this buffer's memory.
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] if `x` is not `n_tokens * k` long or
    /// `k` is not a whole number of blocks.
    pub fn quantize(
        &mut self,
        tier: SimdTier,
        x: &[f32],
        n_tokens: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        check_len("q8 activations", checked_mul("q8", n_tokens, k)?, x.len())?;
        check_len("q8 activation row (whole blocks)", k / BLOCK * BLOCK, k)?;
        let nb = x.len() / BLOCK;
        self.qs.resize(x.len(), 0);
        self.d.resize(nb, 0.0);
        self.s.resize(nb, 0.0);
        self.sums.resize(nb, 0);
        self.offsets.resize(nb, [0; 2]);
        self.n_tokens = n_tokens;
        self.k = k;
        // A prefill chunk's tokens are split over the pool; each block is
        // quantized on its own, so the split changes no bits.
        let tier = crate::cpu::clamp(tier);
        let (qs, d, s) = (
            DisjointSlice::new(&mut self.qs),
            DisjointSlice::new(&mut self.d),
            DisjointSlice::new(&mut self.s),
        );
        let (sums, offsets) = (
            DisjointSlice::new(&mut self.sums),
            DisjointSlice::new(&mut self.offsets),
        );
        let per_token = k / BLOCK;
        pool::for_rows(n_tokens, k, &|r| {
            let b = r.start * per_token..r.end * per_token;
            let v = b.start * BLOCK..b.end * BLOCK;
            // SAFETY: `for_rows` hands out disjoint token ranges, so these
            // block and value ranges are disjoint between tasks.
            let (qs, d, s, sums, offsets) = unsafe {
                (
                    qs.range(v.clone()),
                    d.range(b.clone()),
                    s.range(b.clone()),
                    sums.range(b.clone()),
                    offsets.range(b),
                )
            };
            quantize_blocks(tier, &x[v], qs, d, s, sums, offsets);
        });
        Ok(())
    }

    /// Token `t`'s quantized values, scales and scaled sums.
    #[inline]
    pub(crate) fn token(&self, t: usize) -> (&[i8], &[f32], &[f32]) {
        let nb = self.k / BLOCK;
        (
            &self.qs[t * self.k..(t + 1) * self.k],
            &self.d[t * nb..(t + 1) * nb],
            &self.s[t * nb..(t + 1) * nb],
        )
    }

    /// Token `t`'s exact block sums `Σ q`.
    #[inline]
    pub(crate) fn token_sums(&self, t: usize) -> &[i32] {
        let nb = self.k / BLOCK;
        &self.sums[t * nb..(t + 1) * nb]
    }

    /// Token `t`'s block offsets ([`offsets_ref`]).
    #[inline]
    pub(crate) fn token_offsets(&self, t: usize) -> &[[i32; 2]] {
        let nb = self.k / BLOCK;
        &self.offsets[t * nb..(t + 1) * nb]
    }

    /// Bytes of one row of `k` values in the form [`Self::write_row`]
    /// writes: the values, then each block's scale and scaled sum (f32,
    /// little-endian): a quarter of the row's f32 bytes plus 8 per block.
    pub fn row_bytes(k: usize) -> usize {
        k + 8 * (k / BLOCK)
    }

    /// Appends token `t`'s quantized row to `out` (to send it to another
    /// rank, which gets exactly these activations back with
    /// [`Self::read_rows`]).
    ///
    /// # Panics
    /// If `t` is not a token of the buffer.
    pub fn write_row(&self, t: usize, out: &mut Vec<u8>) {
        let (qs, d, s) = self.token(t);
        out.extend(qs.iter().map(|&q| q as u8));
        for (d, s) in d.iter().zip(s) {
            out.extend_from_slice(&d.to_le_bytes());
            out.extend_from_slice(&s.to_le_bytes());
        }
    }

    /// Replaces the buffer with the rows of `k` values in `bytes` (whole
    /// rows as [`Self::write_row`] writes them).
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] unless `k` is whole blocks and
    /// `bytes` whole rows.
    pub fn read_rows(&mut self, k: usize, bytes: &[u8]) -> Result<(), KernelError> {
        check_len("q8 activation row (whole blocks)", k / BLOCK * BLOCK, k)?;
        let row = Self::row_bytes(k).max(1);
        check_len(
            "q8 activation rows (whole rows)",
            bytes.len() / row * row,
            bytes.len(),
        )?;
        let n = bytes.len() / row;
        self.qs.clear();
        self.d.clear();
        self.s.clear();
        self.sums.clear();
        self.offsets.clear();
        let f32_at = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for r in bytes.chunks_exact(row) {
            let (qs, scales) = r.split_at(k);
            self.qs.extend(qs.iter().map(|&q| q as i8));
            // The exact sums and offsets are the values' own: rebuilt, not
            // sent.
            for b in self.qs[self.qs.len() - k..].chunks_exact(BLOCK) {
                self.sums.push(b.iter().map(|&q| q as i32).sum());
                self.offsets.push(offsets_ref(b));
            }
            for pair in scales.chunks_exact(8) {
                self.d.push(f32_at(&pair[..4]));
                self.s.push(f32_at(&pair[4..]));
            }
        }
        self.n_tokens = n;
        self.k = k;
        Ok(())
    }

    /// The dequantized values `d · q` (for tests' error bounds).
    pub fn dequantize(&self) -> Vec<f32> {
        self.qs
            .chunks_exact(BLOCK)
            .zip(&self.d)
            .flat_map(|(q, &d)| q.iter().map(move |&q| q as f32 * d))
            .collect()
    }
}

/// Scale `d` and reciprocal for a block whose largest magnitude is `amax`.
fn scales(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (d, id)
}

/// A block's Q6_K offsets: for each half of 16 values, `32 (x[4m + 2e] +
/// x[4m + 2e + 1])` summed over `m < 4` in the i16 position `e` (0: low,
/// 1: high) of a 32-bit word, which is what `vpmaddubsw` of the unsigned
/// `q = w + 32` against the half sums in each row lane's two positions
/// (the kernel subtracts it there; `|·| ≤ 32·8·127 = 32512`, an i16).
pub(crate) fn offsets_ref(q: &[i8]) -> [i32; 2] {
    let mut out = [0i32; 2];
    for (o, h) in out.iter_mut().zip(q.chunks_exact(BLOCK / 2)) {
        let pos = |e: usize| -> u32 {
            let v: i32 = (0..4)
                .map(|m| 32 * (h[4 * m + 2 * e] as i32 + h[4 * m + 2 * e + 1] as i32))
                .sum();
            v as i16 as u16 as u32
        };
        *o = (pos(0) | pos(1) << 16) as i32;
    }
    out
}

/// Quantizes whole blocks `x` into `qs` and each block's scale, scaled
/// sum, sum and offsets (see [`Q8Activations`]), on `tier` (clamped).
fn quantize_blocks(
    tier: SimdTier,
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    sums: &mut [i32],
    offsets: &mut [[i32; 2]],
) {
    let blocks = x
        .chunks_exact(BLOCK)
        .zip(qs.chunks_exact_mut(BLOCK))
        .zip((d.iter_mut().zip(s)).zip(sums.iter_mut().zip(offsets)));
    match tier {
        #[cfg(target_arch = "x86_64")]
        SimdTier::Avx2 | SimdTier::Avx512 => {
            for ((x, q), ((d, s), (n, o))) in blocks {
                // SAFETY: the tier (clamped to the CPU) has AVX2; `x`
                // and `q` are one block each.
                (*d, *n) = unsafe { avx2::quantize_block(x, q) };
                *s = *d * *n as f32;
                // SAFETY: as above.
                *o = unsafe { avx2::offsets(q) };
            }
        }
        _ => {
            for ((x, q), ((d, s), (n, o))) in blocks {
                (*d, *n) = quantize_block_ref(x, q);
                *s = *d * *n as f32;
                *o = offsets_ref(q);
            }
        }
    }
}

/// The scalar reference: one block into `q`, returning `(d, Σ q)`.
pub(crate) fn quantize_block_ref(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (d, id) = scales(amax);
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        let r = (v * id).round_ties_even().clamp(-127.0, 127.0);
        *q = r as i8;
        sum += r as i32;
    }
    (d, sum)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{scales, BLOCK};
    use std::arch::x86_64::*;

    /// [`super::quantize_block_ref`], bit for bit.
    ///
    /// # Safety
    /// The CPU supports AVX2; `x` and `q` hold at least [`BLOCK`] values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
        assert!(x.len() >= BLOCK && q.len() >= BLOCK);
        let p = x.as_ptr();
        // SAFETY: `x` holds 32 floats (asserted).
        let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(p.add(8 * i)) });
        let sign = _mm256_set1_ps(-0.0);
        let a = v.map(|v| _mm256_andnot_ps(sign, v));
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        let (d, id) = scales(_mm_cvtss_f32(m));
        let (idv, lo, hi) = (
            _mm256_set1_ps(id),
            _mm256_set1_ps(-127.0),
            _mm256_set1_ps(127.0),
        );
        let i = v.map(|v| {
            let r = _mm256_round_ps(
                _mm256_mul_ps(v, idv),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            );
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        // Pack 4 × 8 i32 to 32 i8; the packs interleave 128-bit lanes, which
        // the final permute undoes.
        let w = _mm256_packs_epi32(i[0], i[1]);
        let z = _mm256_packs_epi32(i[2], i[3]);
        let b = _mm256_packs_epi16(w, z);
        let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `q` holds 32 bytes (asserted).
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, b);
        let s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        (d, _mm_cvtsi128_si32(s))
    }

    /// [`super::offsets_ref`], bit for bit: pairs `32 (x_2j + x_2j+1)`
    /// (at most 8128), then the four 32-bit lanes of each 16-byte half
    /// summed in i16 (at most 32512).
    ///
    /// # Safety
    /// The CPU supports AVX2; `q` holds at least [`BLOCK`] values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn offsets(q: &[i8]) -> [i32; 2] {
        assert!(q.len() >= BLOCK);
        // SAFETY: `q` holds 32 bytes (asserted).
        let x = unsafe { _mm256_loadu_si256(q.as_ptr() as *const __m256i) };
        let v = _mm256_maddubs_epi16(_mm256_set1_epi8(32), x);
        let v = _mm256_add_epi16(v, _mm256_shuffle_epi32(v, 0b01_00_11_10));
        let v = _mm256_add_epi16(v, _mm256_shuffle_epi32(v, 0b10_11_00_01));
        [_mm256_extract_epi32::<0>(v), _mm256_extract_epi32::<4>(v)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn every_tier_matches_the_reference_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        // 37 tokens of 576 are split over the pool (`pool::ROWS_MIN_PARALLEL`).
        for &(n, k) in &[(1usize, 32usize), (3, 96), (5, 576), (2, 1536), (37, 576)] {
            let mut x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-3.0..3.0)).collect();
            // Ties, zeros, a zero block and a huge value.
            x[0] = 0.5;
            x[1] = -1.5;
            x[2] = 1e30;
            if k >= 64 {
                x[32..64].fill(0.0);
            }
            let mut want = Q8Activations::default();
            want.quantize(SimdTier::Scalar, &x, n, k).unwrap();
            for tier in crate::cpu::available_tiers() {
                let mut got = Q8Activations::default();
                got.quantize(tier, &x, n, k).unwrap();
                assert_eq!(got.qs, want.qs, "{tier} n={n} k={k}");
                assert_eq!(got.d, want.d);
                assert_eq!(got.s, want.s);
                assert_eq!(got.sums, want.sums);
                assert_eq!(got.offsets, want.offsets);
                // The last token alone gets the same bits.
                let mut alone = Q8Activations::default();
                alone.quantize(tier, &x[(n - 1) * k..], 1, k).unwrap();
                assert_eq!(alone.qs, got.qs[(n - 1) * k..]);
                assert_eq!(alone.d, got.d[(n - 1) * k / BLOCK..]);
            }
            for (b, &n) in want.qs.chunks(BLOCK).zip(&want.sums) {
                assert_eq!(b.iter().map(|&q| q as i32).sum::<i32>(), n);
            }
            let back = want.dequantize();
            for ((xb, rb), &d) in x.chunks(BLOCK).zip(back.chunks(BLOCK)).zip(&want.d) {
                for (&v, &r) in xb.iter().zip(rb) {
                    // Rounding to the nearest step: at most half a step off.
                    assert!((v - r).abs() <= 0.5 * d * (1.0 + 1e-6), "{v} {r} {d}");
                }
            }
        }
    }

    #[test]
    fn rows_travel_exactly() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let (n, k) = (5, 96);
        let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-4.0..4.0)).collect();
        let mut a = Q8Activations::default();
        a.quantize(SimdTier::Scalar, &x, n, k).unwrap();
        let mut wire = Vec::new();
        for t in [3, 0, 3] {
            a.write_row(t, &mut wire);
        }
        assert_eq!(wire.len(), 3 * Q8Activations::row_bytes(k));
        let mut b = Q8Activations::default();
        b.read_rows(k, &wire).unwrap();
        assert_eq!((b.n_tokens(), b.k()), (3, k));
        for (i, t) in [3, 0, 3].into_iter().enumerate() {
            assert_eq!(b.token(i), a.token(t));
            assert_eq!(b.token_sums(i), a.token_sums(t));
            assert_eq!(b.token_offsets(i), a.token_offsets(t));
        }
        assert!(b.read_rows(k, &wire[1..]).is_err());
        assert!(b.read_rows(40, &[]).is_err());
        b.read_rows(k, &[]).unwrap();
        assert_eq!(b.n_tokens(), 0);
    }

    #[test]
    fn bad_shapes_are_errors() {
        let mut a = Q8Activations::default();
        assert!(a.quantize(SimdTier::Scalar, &[0.0; 40], 1, 40).is_err());
        assert!(a.quantize(SimdTier::Scalar, &[0.0; 64], 1, 32).is_err());
    }
}
