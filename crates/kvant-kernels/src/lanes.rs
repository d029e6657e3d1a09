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
}

impl Lanes for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

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
}
