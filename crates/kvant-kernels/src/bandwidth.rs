//! A memory read-bandwidth probe.
//!
//! Decoding one token streams every weight once, so its speed limit is
//! `bandwidth / bytes per token`. That bandwidth is measured on the machine
//! at hand, not taken from a data sheet: `kvant bench` divides it by the
//! bytes each token reads to report decode speed as a fraction of the
//! roofline, and `benches/bandwidth.rs` prints it alone.
//!
//! The probe reads a buffer far larger than the last-level cache, each
//! thread its own contiguous slice, with 32-byte loads into four
//! independent accumulators (so the adds never limit the loads), like the
//! read kernels of STREAM-style tools. The best of several passes is kept:
//! interference from other processes only ever slows a pass down. The
//! buffer is on transparent huge pages, as the repacked weights are
//! ([`kvant_core::huge`]): on 4 KiB pages the probe read this Zen 4 VM at
//! 18 GB/s on one thread while decode read the weights faster.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

/// The unit each thread reads: 128 bytes = four 32-byte loads, one per
/// accumulator, aligned to a cache line so `_mm256_load_si256` is legal.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Block([u64; 16]);

// SAFETY: sixteen `u64`s: every bit pattern, zero included, is a value.
unsafe impl kvant_core::huge::Plain for Block {}

const BLOCK_BYTES: usize = std::mem::size_of::<Block>();

/// Read bandwidth in bytes/s: the best of `repeats` passes in which
/// `threads` threads, released together by a barrier, each read their own
/// contiguous slice of a `bytes`-byte buffer (rounded down to whole 128-byte
/// blocks, at least one per thread). Pass a buffer far over the last-level
/// cache (callers use 256 MiB) to measure DRAM rather than cache.
/// `threads` and `repeats` of 0 count as 1.
///
/// A pass lasts from the first reader's start to the last reader's end,
/// each stamped by the reader itself around its read: a stamp taken late
/// (a reader descheduled) can only lengthen the pass. A separate timing
/// thread, as this probe had, is one thread more than the cores when
/// `threads` is all of them, and when it was scheduled after the readers
/// had started, its pass came out short: `kvant bench` on 2 cores reported
/// 41 to 2704 GB/s across runs of one machine.
pub fn measure_read_bandwidth(bytes: usize, threads: usize, repeats: usize) -> f64 {
    let threads = threads.max(1);
    let repeats = repeats.max(1);
    let n_blocks = (bytes / BLOCK_BYTES).max(threads);
    // Writing every block commits the pages before any pass is timed.
    // On huge pages, as the weights it stands for are.
    let buffer = kvant_core::HugeSlice::from_fn(n_blocks, |i| Block([i as u64; 16]));
    let slices: Vec<&[Block]> = buffer.chunks(n_blocks.div_ceil(threads)).collect();
    let read_bytes = (n_blocks * BLOCK_BYTES) as f64;
    let barrier = Barrier::new(slices.len());
    // Per reader, per pass: (start, end).
    let stamps: Vec<Vec<(Instant, Instant)>> = std::thread::scope(|s| {
        let readers: Vec<_> = slices
            .iter()
            .map(|slice| {
                let barrier = &barrier;
                s.spawn(move || {
                    (0..repeats)
                        .map(|_| {
                            barrier.wait();
                            let t0 = Instant::now();
                            black_box(checksum(slice));
                            let t1 = Instant::now();
                            // No pass starts before every reader has ended.
                            barrier.wait();
                            (t0, t1)
                        })
                        .collect()
                })
            })
            .collect();
        readers
            .into_iter()
            .map(|r| r.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    (0..repeats)
        .filter_map(|pass| pass_seconds(stamps.iter().map(|r| r[pass])))
        .map(|secs| read_bytes / secs)
        .fold(0.0, f64::max)
}

/// A pass's length: from the earliest start to the latest end of its
/// readers' `(start, end)` stamps; `None` when it took no measurable time.
fn pass_seconds(stamps: impl Iterator<Item = (Instant, Instant)> + Clone) -> Option<f64> {
    let first = stamps.clone().map(|s| s.0).min()?;
    let last = stamps.map(|s| s.1).max()?;
    let secs = last.saturating_duration_since(first).as_secs_f64();
    (secs > 0.0).then_some(secs)
}

/// The wrapping sum of every `u64` in `blocks`, read with the widest loads
/// the CPU has. The sum is what keeps the reads from being optimised away.
fn checksum(blocks: &[Block]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        return unsafe { avx2::checksum(blocks) };
    }
    checksum_scalar(blocks)
}

/// Four independent `u64` accumulators, one per quarter of a block.
fn checksum_scalar(blocks: &[Block]) -> u64 {
    let mut acc = [0u64; 4];
    for b in blocks {
        for (quarter, a) in b.0.chunks_exact(4).zip(acc.iter_mut()) {
            for &w in quarter {
                *a = a.wrapping_add(w);
            }
        }
    }
    acc.iter().fold(0, |s, &a| s.wrapping_add(a))
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Block;
    use std::arch::x86_64::*;

    /// The same sum as `checksum_scalar`: four 64-bit lanes per accumulator,
    /// added with wrap-around, then the sixteen lanes folded together.
    #[target_feature(enable = "avx2")]
    pub(super) fn checksum(blocks: &[Block]) -> u64 {
        let mut acc = [_mm256_setzero_si256(); 4];
        for b in blocks {
            let p = b.0.as_ptr().cast::<__m256i>();
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: a `Block` is 128 bytes aligned to 64, so `p.add(i)`
                // for i < 4 is an in-bounds, 32-byte-aligned 32-byte load.
                *a = _mm256_add_epi64(*a, unsafe { _mm256_load_si256(p.add(i)) });
            }
        }
        let s = _mm256_add_epi64(
            _mm256_add_epi64(acc[0], acc[1]),
            _mm256_add_epi64(acc[2], acc[3]),
        );
        let mut lanes = [0u64; 4];
        // SAFETY: `lanes` holds 32 bytes; the store is unaligned.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), s) };
        lanes.iter().fold(0, |t, &l| t.wrapping_add(l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn checksums_add_every_word() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        // An odd block count; random words make any skipped word show.
        let blocks: Vec<Block> = (0..37).map(|_| Block(rng.random())).collect();
        let expected = blocks
            .iter()
            .flat_map(|b| b.0)
            .fold(0u64, |s, w| s.wrapping_add(w));
        assert_eq!(checksum_scalar(&blocks), expected);
        assert_eq!(checksum(&blocks), expected);
        assert_eq!(checksum(&[]), 0);
    }

    #[test]
    fn bandwidth_is_finite_and_positive() {
        // 1 MiB plus an odd remainder, split unevenly over three threads.
        for threads in [0, 1, 3] {
            let bw = measure_read_bandwidth((1 << 20) + 1000, threads, 2);
            assert!(bw.is_finite() && bw > 0.0, "{threads} threads: {bw}");
        }
        // A buffer smaller than one block per thread still reads something.
        let bw = measure_read_bandwidth(10, 4, 1);
        assert!(bw.is_finite() && bw > 0.0, "tiny buffer: {bw}");
    }

    #[test]
    fn a_pass_spans_its_first_start_to_its_last_end() {
        use std::time::Duration;
        let t = Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        // Readers that started and ended at different times.
        let secs = pass_seconds([(at(5), at(40)), (at(2), at(30)), (at(9), at(12))].into_iter());
        assert_eq!(secs, Some(0.038));
        assert_eq!(pass_seconds([(at(3), at(3))].into_iter()), None);
        assert_eq!(pass_seconds(std::iter::empty()), None);
    }
}
