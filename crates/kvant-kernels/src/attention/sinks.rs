//! Attention of one query token over a gathered set of shared K = V rows,
//! with a learned sink logit per head (DeepSeek-V4, gpt-oss): every head
//! reads the same rows (one KV head, keys and values the same vectors), and
//! the softmax runs over the rows' scaled scores plus the head's sink,
//! which takes probability mass but contributes no value:
//!
//! `p_j = exp(s_j − M) / (Σ_i exp(s_i − M) + exp(sink − M))`,
//! `M = max(max_j s_j, sink)`, `out = Σ_j p_j · row_j`.
//!
//! The caller hands the rows over by index ([`SinkRows`]: a sliding
//! window's, compressed entries, an indexer's top-k of them, wherever they
//! live), so the kernel is the same whatever selected them and nothing is
//! copied. [`sink_attention_ref`] is the f64 reference.

use crate::cpu::SimdTier;
use crate::error::{check_len, KernelError};
use crate::lanes::RowSet;
use crate::vecops::{exp_shifted, scale, weighted_rows_group};

/// One query's shapes: `heads` heads of `dim` values, `scale` on the
/// scores (`1/√dim` in DeepSeek-V4), one sink per head.
#[derive(Clone, Copy, Debug)]
pub struct SinkAttn<'a> {
    pub heads: usize,
    pub dim: usize,
    pub scale: f32,
    pub sinks: &'a [f32],
}

/// The K = V rows one query attends over: `n` of them, row `j` given by
/// `row(j)` (each `dim` values).
#[derive(Clone, Copy)]
pub struct SinkRows<'a> {
    pub n: usize,
    pub row: &'a (dyn Fn(usize) -> &'a [f32] + Sync),
}

impl SinkAttn<'_> {
    /// Checks `q` (`[heads, dim]`), every row (`[dim]`) and `out`
    /// (`[heads, dim]`); returns the row count.
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] naming the first bad length.
    pub fn check(&self, q: &[f32], rows: SinkRows<'_>, out: &[f32]) -> Result<usize, KernelError> {
        if self.heads > MAX_HEADS {
            return Err(KernelError::LengthMismatch {
                what: "sink attention heads (at most MAX_HEADS)",
                expected: MAX_HEADS,
                actual: self.heads,
            });
        }
        let qd = self.heads * self.dim;
        check_len("sink attention sinks [heads]", self.heads, self.sinks.len())?;
        check_len("sink attention query [heads, dim]", qd, q.len())?;
        check_len("sink attention output [heads, dim]", qd, out.len())?;
        for j in 0..rows.n {
            check_len("sink attention row [dim]", self.dim, (rows.row)(j).len())?;
        }
        Ok(rows.n)
    }
}

/// Each head's output for one query over `rows` (see the module docs),
/// `scores` a scratch of at least `heads × rows` values. An empty row set
/// gives zeros (all mass on the sink).
///
/// The scores go through the attention tiles' [`super::rows::scores`]
/// (register tiles of four rows by up to three heads on AVX2, six on
/// AVX-512: each row and query vector loaded once per tile) and the
/// outputs through [`weighted_rows_group`] (each head's accumulators held
/// in registers across the rows, every row loaded once per three heads),
/// where a row per head was one dot product and one `axpy` (two loads per
/// multiply-add, and each output read and written once per row). The rows
/// go a chunk of about 64 KiB at a time, every head over a chunk before
/// the next, so that a CSA query's 640 rows of 512 values (1.3 MB) are not
/// streamed from the L3 cache once per group of heads. Each score is
/// still one dot product and each output one chain of multiply-adds over
/// the rows in order, whatever the head count (a query's heads may be
/// split over threads) or the chunk. DeepSeek-V4 bench model, 2 threads,
/// prefill at depth 4096 (Zen 3, AVX2): the dot products and `axpy`s were
/// a third of `perf`'s samples; then the tiles of four heads, which spill
/// 16 accumulators on AVX2, and the unchunked passes 27%; now 18%.
///
/// # Errors
/// As [`SinkAttn::check`], and for a `scores` shorter than that.
pub fn sink_attention(
    tier: SimdTier,
    a: &SinkAttn<'_>,
    (q, rows): (&[f32], SinkRows<'_>),
    scores: &mut [f32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    sink_attention_in(tier, a, (q, rows), (scores, chunk_rows(a.dim)), out)
}

/// [`sink_attention`] over the rows `chunk` at a time.
fn sink_attention_in(
    tier: SimdTier,
    a: &SinkAttn<'_>,
    (q, rows): (&[f32], SinkRows<'_>),
    (scores, chunk): (&mut [f32], usize),
    out: &mut [f32],
) -> Result<(), KernelError> {
    let n = a.check(q, rows, out)?;
    let (d, heads) = (a.dim, a.heads);
    if scores.len() < n * heads {
        return Err(KernelError::LengthMismatch {
            what: "sink attention scores scratch [heads, rows]",
            expected: n * heads,
            actual: scores.len(),
        });
    }
    out.fill(0.0);
    if n == 0 {
        return Ok(());
    }
    let scores = &mut scores[..n * heads];
    let list: Vec<&[f32]> = (0..n).map(|j| (rows.row)(j)).collect();
    let qs: Vec<&[f32]> = q.chunks_exact(d).collect();
    // Rows a chunk at a time, every head over the chunk before the next:
    // a chunk stays in the L2 cache while each group of heads reads it.
    let chunk = chunk.max(1);
    for c0 in (0..n).step_by(chunk) {
        let part = RowSet::gathered(&list[c0..(c0 + chunk).min(n)], d);
        let out = &mut scores[c0..];
        super::rows::scores(tier, (heads, |h| qs[h]), (part, &[]), (out, n));
    }
    let mut sums = [0f32; MAX_HEADS];
    for (h, s) in scores.chunks_exact_mut(n).enumerate() {
        s.iter_mut().for_each(|v| *v *= a.scale);
        let sink = a.sinks[h];
        let max = s.iter().copied().fold(sink, f32::max);
        sums[h] = exp_shifted(tier, s, max) + (sink - max).exp();
    }
    // Each output's chain of multiply-adds goes on from chunk to chunk
    // (the accumulators start from `out`), so its bits are one pass's.
    for c0 in (0..n).step_by(chunk) {
        let set = RowSet::gathered(&list[c0..(c0 + chunk).min(n)], d);
        weighted_rows_group(tier, (&scores[c0..], n), (set, &[]), out, d);
    }
    for (h, o) in out.chunks_exact_mut(d).enumerate() {
        scale(tier, 1.0 / sums[h], o);
    }
    Ok(())
}

/// Rows of `dim` f32 values per chunk of [`sink_attention`]: about 64 KiB,
/// a multiple of the score tile's 4 rows.
fn chunk_rows(dim: usize) -> usize {
    ((64 << 10) / (4 * dim.max(1))).max(4) / 4 * 4
}

/// Heads one call takes at most (a query's heads, or a share of them).
pub const MAX_HEADS: usize = 256;

/// [`sink_attention`] in f64: scores, exponentials and sums, each
/// output rounded once.
///
/// # Errors
/// As [`SinkAttn::check`].
pub fn sink_attention_ref(
    a: &SinkAttn<'_>,
    (q, rows): (&[f32], SinkRows<'_>),
    out: &mut [f32],
) -> Result<(), KernelError> {
    a.check(q, rows, out)?;
    let d = a.dim;
    let all: Vec<&[f32]> = (0..rows.n).map(|j| (rows.row)(j)).collect();
    for (h, o) in out.chunks_exact_mut(d).enumerate() {
        let qh = &q[h * d..(h + 1) * d];
        let s: Vec<f64> = all
            .iter()
            .map(|r| {
                let dot: f64 = qh
                    .iter()
                    .zip(r.iter())
                    .map(|(&x, &y)| x as f64 * y as f64)
                    .sum();
                dot * a.scale as f64
            })
            .collect();
        let sink = a.sinks[h] as f64;
        let max = s.iter().copied().fold(sink, f64::max);
        let e: Vec<f64> = s.iter().map(|&v| (v - max).exp()).collect();
        let sum: f64 = e.iter().sum::<f64>() + (sink - max).exp();
        for (i, o) in o.iter_mut().enumerate() {
            let v: f64 = e.iter().zip(&all).map(|(&p, r)| p * r[i] as f64).sum();
            *o = (v / sum) as f32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu;
    use rand::{Rng, SeedableRng};

    /// f32 scores over `dim` products and f32 sums over the rows: within
    /// 2e-5 of the f64 reference relative to max(1, |value|) at these
    /// sizes (values of order 1).
    const TOL: f32 = 2e-5;

    #[test]
    fn every_tier_matches_the_reference_on_odd_sizes() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(39);
        for (heads, dim, n) in [
            (1, 1, 1),
            (3, 17, 0),
            (4, 33, 5),
            (5, 64, 41),
            (2, 512, 9),
            (9, 40, 130),
        ] {
            let r = |len: usize, rng: &mut rand_chacha::ChaCha8Rng| -> Vec<f32> {
                (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
            };
            let q = r(heads * dim, &mut rng);
            let rows = r(n * dim, &mut rng);
            let sinks: Vec<f32> = (0..heads).map(|_| rng.random_range(-2.0..2.0)).collect();
            let a = SinkAttn {
                heads,
                dim,
                scale: 1.0 / (dim as f32).sqrt(),
                sinks: &sinks,
            };
            let get = |j: usize| &rows[j * dim..(j + 1) * dim];
            let rows = SinkRows { n, row: &get };
            let mut want = vec![f32::NAN; heads * dim];
            sink_attention_ref(&a, (&q, rows), &mut want).expect("reference");
            for tier in cpu::available_tiers() {
                let mut got = vec![f32::NAN; heads * dim];
                let mut scores = vec![0.0; heads * n + 3];
                sink_attention(tier, &a, (&q, rows), &mut scores, &mut got).expect("kernel");
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= TOL * w.abs().max(1.0),
                        "{tier} heads {heads} dim {dim} n {n} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }

    /// Rows in chunks (here 32 rows of 512 values, ten of them and a short
    /// one) give the bits of one pass over all of them, on every tier.
    #[test]
    fn chunking_the_rows_changes_no_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(41);
        let (heads, dim, n) = (16, 512, 333);
        assert_eq!(chunk_rows(dim), 32);
        let q: Vec<f32> = (0..heads * dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let rows: Vec<f32> = (0..n * dim).map(|_| rng.random_range(-1.0..1.0)).collect();
        let sinks: Vec<f32> = (0..heads).map(|_| rng.random_range(-2.0..2.0)).collect();
        let get = |j: usize| &rows[j * dim..(j + 1) * dim];
        let rows = SinkRows { n, row: &get };
        let a = SinkAttn {
            heads,
            dim,
            scale: 1.0 / (dim as f32).sqrt(),
            sinks: &sinks,
        };
        let mut want = vec![0.0; heads * dim];
        sink_attention_ref(&a, (&q, rows), &mut want).expect("reference");
        for tier in cpu::available_tiers() {
            let run = |chunk: usize| {
                let mut out = vec![f32::NAN; heads * dim];
                let mut scores = vec![0.0; heads * n];
                sink_attention_in(tier, &a, (&q, rows), (&mut scores, chunk), &mut out)
                    .expect("kernel");
                out
            };
            let (chunked, whole, odd) = (run(chunk_rows(dim)), run(n), run(7));
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&chunked), bits(&whole), "{tier}");
            assert_eq!(bits(&odd), bits(&whole), "{tier}");
            for (&g, &w) in chunked.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= TOL * w.abs().max(1.0),
                    "{tier}: {g} vs {w}"
                );
            }
        }
    }

    /// A query's heads split over two calls (as a decode step spreads them
    /// over threads) give the bits of one call, on every tier.
    #[test]
    fn splitting_the_heads_changes_no_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(40);
        let (heads, dim, n) = (9, 72, 37);
        let r = |len: usize, rng: &mut rand_chacha::ChaCha8Rng| -> Vec<f32> {
            (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
        };
        let (q, rows) = (r(heads * dim, &mut rng), r(n * dim, &mut rng));
        let sinks: Vec<f32> = (0..heads).map(|_| rng.random_range(-2.0..2.0)).collect();
        let get = |j: usize| &rows[j * dim..(j + 1) * dim];
        let rows = SinkRows { n, row: &get };
        let run = |tier, hs: std::ops::Range<usize>| {
            let a = SinkAttn {
                heads: hs.len(),
                dim,
                scale: 0.125,
                sinks: &sinks[hs.clone()],
            };
            let mut out = vec![0.0; hs.len() * dim];
            let mut scores = vec![0.0; hs.len() * n];
            let q = &q[hs.start * dim..hs.end * dim];
            sink_attention(tier, &a, (q, rows), &mut scores, &mut out).expect("kernel");
            out
        };
        for tier in cpu::available_tiers() {
            let whole = run(tier, 0..heads);
            let parts = [run(tier, 0..5), run(tier, 5..heads)].concat();
            assert!(
                whole
                    .iter()
                    .zip(&parts)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{tier}"
            );
        }
    }

    #[test]
    fn the_sink_takes_mass_and_bad_lengths_are_errors() {
        // One row equal to the query direction, a sink far above: the
        // output shrinks toward zero; far below: it is the row.
        let (q, row) = (vec![1.0, 0.0], vec![2.0, 0.0]);
        let get = |_: usize| &row[..];
        let rows = SinkRows { n: 1, row: &get };
        let run = |sink: f32| {
            let sinks = [sink];
            let a = SinkAttn {
                heads: 1,
                dim: 2,
                scale: 1.0,
                sinks: &sinks,
            };
            let mut out = vec![0.0; 2];
            sink_attention(cpu::tier(), &a, (&q, rows), &mut [0.0], &mut out).expect("kernel");
            out[0]
        };
        assert!(run(50.0) < 1e-6);
        assert!((run(-50.0) - 2.0).abs() < 1e-6);
        let sinks = [0.0];
        let a = SinkAttn {
            heads: 1,
            dim: 2,
            scale: 1.0,
            sinks: &sinks,
        };
        let mut out = vec![0.0; 2];
        let short = [1.0; 3];
        let get_short = |_: usize| &short[..];
        let bad = SinkRows {
            n: 1,
            row: &get_short,
        };
        assert!(sink_attention(cpu::tier(), &a, (&q, bad), &mut [0.0; 2], &mut out).is_err());
        assert!(sink_attention(cpu::tier(), &a, (&q, rows), &mut [], &mut out).is_err());
        let many = vec![0.0; MAX_HEADS + 1];
        let too_many = SinkAttn {
            heads: MAX_HEADS + 1,
            dim: 2,
            scale: 1.0,
            sinks: &many,
        };
        let (q2, mut out2) = (
            vec![0.0; 2 * (MAX_HEADS + 1)],
            vec![0.0; 2 * (MAX_HEADS + 1)],
        );
        assert!(sink_attention(
            cpu::tier(),
            &too_many,
            (&q2, rows),
            &mut [0.0; 600],
            &mut out2
        )
        .is_err());
    }
}
