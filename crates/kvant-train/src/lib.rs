//! Training kernels: forward and backward passes, in the style of
//! Liger-Kernel and FlashAttention, for f32 and bf16 tensors.
//!
//! Each op lives in its own file with a scalar reference (`*_ref`, f64 or
//! f32 accumulation, obviously correct), fast paths per SIMD tier and one
//! dispatch, as the inference kernels do. What they share:
//! - element types are [`Elem`]: read widened to f32 exactly, written back
//!   rounded to nearest even (bf16) — torch's own rounding;
//! - every sum is accumulated in f32 (weight gradients across rows too),
//!   in a fixed order: the result does not depend on the thread count;
//! - gradients are computed where the forward already holds the data
//!   (cross-entropy writes its gradient into the logits, GLU backward
//!   writes into its inputs), so nothing the size of the logits is kept;
//! - arguments are checked once per call and a mismatch is a
//!   [`KernelError`](kvant_kernels::KernelError), never an out-of-bounds access.
//!
//! The Python package (`crates/kvant-py`) hands torch tensors to these
//! functions as slices; torch allocates every output.

use kvant_kernels::lanes::Lanes;

/// A tensor element type the training kernels read and write.
pub trait Elem: Lanes + Default {
    /// `v` rounded to this type (round to nearest even; NaN stays NaN).
    fn from_f32(v: f32) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Elem for half::bf16 {
    /// half's `from_f32`, bit for bit, without its early return for NaN,
    /// which kept every loop storing bf16 scalar (RMSNorm forward ran at
    /// 8 GB/s on 2 threads instead of 25; cross-entropy's bf16 rows ran
    /// slower than f32 ones).
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        half::bf16::from_bits(bf16_bits(v))
    }
}

/// Round to nearest even to bf16, NaN quieted (half's `f32_to_bf16`),
/// without branches: `x + 0x7fff + lsb` carries into bit 16 exactly when
/// the dropped half is above the tie, or at it with the kept lsb odd.
#[inline(always)]
fn bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let nan = (x >> 16) | 0x40;
    (if x & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }) as u16
}

/// How a loss over rows is reduced, as torch's `reduction=`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Per-row losses, no reduction.
    None,
    /// Sum over the rows that count.
    Sum,
    /// Sum divided by the number of rows that count (not ignored).
    Mean,
}

/// Writes zeros over a task's part of a large zeroed (`vec![0.0; n]`)
/// accumulator before the task's first read-modify-write. The allocator
/// hands such a buffer over untouched; a read maps the shared zero page,
/// and the write after it then takes a copy-on-write fault and a TLB
/// shoot-down (an IPI to every thread of the process) per 4 KiB page,
/// where a first write takes one plain fault. FlashAttention's partial dQ
/// paid 12% of the backward's time for it, the norms' weight-gradient
/// partials 2–4 ms of a 15 ms LayerNorm backward.
pub(crate) fn zero_first(part: &mut [f32]) {
    part.fill(0.0);
}

pub mod cross_entropy;
pub mod distill;
pub mod flash;
pub mod gemm;
pub mod glu;
pub mod linear_ce;
pub mod norm;
pub mod rope;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use half::bf16;
    use rand::{Rng, SeedableRng};

    /// f32 bit patterns for the bf16 store: every class first (ties both
    /// ways, kept lsb odd and even, overflow to infinity, NaN, subnormal),
    /// then 200 000 random ones.
    pub(crate) fn bf16_cases() -> Vec<u32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
        let mut xs: Vec<u32> = Vec::new();
        for hi in [
            0u32, 0x3f80, 0x3f81, 0x7f7f, 0x7f80, 0x7fc0, 0xff80, 0x8000, 0x0001, 0xffff,
        ] {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                xs.push(hi << 16 | lo);
            }
        }
        xs.extend((0..200_000).map(|_| rng.random::<u32>()));
        xs
    }

    /// The branch-free bf16 store rounds as half does, bit for bit, on
    /// every class; the f32 store is the identity.
    #[test]
    fn bf16_store_rounds_like_half() {
        for x in bf16_cases() {
            let v = f32::from_bits(x);
            assert_eq!(
                <bf16 as Elem>::from_f32(v).to_bits(),
                bf16::from_f32(v).to_bits(),
                "{x:#x}"
            );
            assert_eq!(<f32 as Elem>::from_f32(v).to_bits(), x);
        }
    }
}
