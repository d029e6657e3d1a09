//! Rotary position embeddings for training: forward and backward in place,
//! on strided `[batch, heads, seq, head_dim]` views (q and k as the
//! attention projections leave them, e.g. `[b, s, h, d]` memory viewed as
//! `[b, h, s, d]`), with cos/sin tables the caller computed.
//!
//! Each rotated pair `(x1, x2)` of a row, with `c, s` the table entries of
//! the pair's index `i < rot_dim/2` at the row's (batch, position):
//!
//! ```text
//! forward:  (x1, x2) ← (x1·c − x2·s, x2·c + x1·s)
//! backward: (g1, g2) ← (g1·c + g2·s, g2·c − g1·s)   (the transpose: s → −s)
//! ```
//!
//! Pairs are `(i, i + rot/2)` ([`RopeLayout::HalfSplit`], `rotate_half`)
//! or `(2i, 2i+1)` ([`RopeLayout::Interleaved`]); values past `rot_dim`
//! pass through untouched (partial rotary). Nothing is saved for the
//! backward beyond the tables, and every value is computed in f32 and
//! rounded once (torch's bf16 `q·cos + rotate_half(q)·sin` rounds each
//! product and the sum).
//!
//! Rows are visited in memory order (innermost stride first), so a
//! `[b, s, h, d]` tensor viewed as `[b, h, s, d]` streams like a
//! contiguous one. Measured on `[4, 32, 512, 128]` (2 threads, shared
//! Zen 4 VM, read probe 21–29 GB/s; the tensor is 17–34 MB, partly in the
//! 32 MB L3 between runs): f32 37–39 GB/s, bf16 23–30 GB/s.

use crate::norm::row_chunk;
use crate::Elem;
use kvant_kernels::cpu::{self, SimdTier};
use kvant_kernels::error::{check_len, checked_mul};
use kvant_kernels::pool::{self, DisjointSlice};
use kvant_kernels::vecops::{Fma, Plain};
use kvant_kernels::KernelError;
use std::ops::Range;

/// How the rotated dimensions of a row are paired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// rotate_half: pairs (i, i + rot/2) as Hugging Face Llama
    HalfSplit,
    /// pairs (2i, 2i+1) as GPT-J / rope_interleave
    Interleaved,
}

/// The view of `x` a RoPE call rotates.
#[derive(Clone, Copy, Debug)]
pub struct RopeShape {
    pub batch: usize,
    pub heads: usize,
    pub seq: usize,
    pub head_dim: usize,
    /// leading dims rotated (partial rotary); even, <= head_dim; the rest pass through
    pub rot_dim: usize,
    /// element strides of x for (batch, head, seq); head_dim is contiguous (stride 1)
    pub strides: [usize; 3],
    /// cos/sin tables are [batch, seq, rot_dim/2] (true) or [1, seq, rot_dim/2] shared (false)
    pub per_batch_tables: bool,
    pub layout: RopeLayout,
}

/// A checked shape: the rows in memory order (innermost stride first).
struct Plan {
    rows: usize,
    /// (count, stride, which of b/h/s) innermost first.
    dims: [(usize, usize, usize); 3],
    half: usize,
}

impl Plan {
    /// Row `t` (in memory order): its offset in `x` and its table row.
    #[inline(always)]
    fn row(&self, s: &RopeShape, mut t: usize) -> (usize, usize) {
        let mut idx = [0usize; 3];
        let mut off = 0;
        for &(count, stride, which) in &self.dims {
            let k = t % count;
            t /= count;
            idx[which] = k;
            off += k * stride;
        }
        let b = if s.per_batch_tables { idx[0] } else { 0 };
        (off, (b * s.seq + idx[2]) * self.half)
    }
}

fn invalid(why: String) -> KernelError {
    KernelError::InvalidShape {
        op: "rope_apply",
        why,
    }
}

/// Checks the shape against the lengths: rot_dim, the tables' length,
/// the strided extent inside `x`, and that no two rows overlap.
fn plan(s: &RopeShape, x_len: usize, cos_len: usize, sin_len: usize) -> Result<Plan, KernelError> {
    if !s.rot_dim.is_multiple_of(2) || s.rot_dim > s.head_dim {
        return Err(invalid(format!(
            "rot_dim {} must be even and at most head_dim {}",
            s.rot_dim, s.head_dim
        )));
    }
    let half = s.rot_dim / 2;
    let op = "rope_apply";
    let rows = checked_mul(op, checked_mul(op, s.batch, s.heads)?, s.seq)?;
    let tb = if s.per_batch_tables { s.batch } else { 1 };
    let table = checked_mul(op, checked_mul(op, tb, s.seq)?, half)?;
    check_len("rope cos table", table, cos_len)?;
    check_len("rope sin table", table, sin_len)?;
    let counts = [s.batch, s.heads, s.seq];
    let mut dims = [0, 1, 2].map(|k| (counts[k], s.strides[k], k));
    // Innermost first; dims of one entry have no stride that matters.
    dims.sort_by_key(|&(c, st, _)| if c > 1 { (1, st) } else { (0, 0) });
    if rows > 0 && s.head_dim > 0 {
        let mut end = s.head_dim;
        // Non-overlapping when each dim steps past everything inside it.
        let mut inner = s.head_dim;
        for &(c, st, k) in &dims {
            if c <= 1 {
                continue;
            }
            if st < inner {
                return Err(invalid(format!(
                    "rows overlap: stride {st} of {} (x{c}) is less than the {inner} values inside it",
                    ["batch", "heads", "seq"][k]
                )));
            }
            inner = checked_mul(op, st, c)?;
            end = checked_mul(op, c - 1, st)?
                .checked_add(end)
                .ok_or(KernelError::SizeOverflow { op, a: end, b: st })?;
        }
        if end > x_len {
            return Err(KernelError::IndexOutOfRange {
                what: "rope: the strided rows' last value",
                index: end - 1,
                len: x_len,
            });
        }
    }
    Ok(Plan { rows, dims, half })
}

#[inline(always)]
fn rotate_row<E: Elem, F: Fma>(row: &mut [E], cos: &[E], sin: &[E], layout: RopeLayout, sg: f32) {
    let half = cos.len();
    match layout {
        RopeLayout::HalfSplit => {
            let (x1, rest) = row.split_at_mut(half);
            let x2 = &mut rest[..half];
            for ((a, b), (c, s)) in x1.iter_mut().zip(x2.iter_mut()).zip(cos.iter().zip(sin)) {
                let (u, v, c, s) = (a.to_f32(), b.to_f32(), c.to_f32(), sg * s.to_f32());
                *a = E::from_f32(F::fma(u, c, -v * s));
                *b = E::from_f32(F::fma(v, c, u * s));
            }
        }
        RopeLayout::Interleaved => {
            for (p, (c, s)) in row[..2 * half].chunks_exact_mut(2).zip(cos.iter().zip(sin)) {
                let (u, v, c, s) = (p[0].to_f32(), p[1].to_f32(), c.to_f32(), sg * s.to_f32());
                p[0] = E::from_f32(F::fma(u, c, -v * s));
                p[1] = E::from_f32(F::fma(v, c, u * s));
            }
        }
    }
}

/// The tensors of a RoPE call: `x` rotated in place, or every row of
/// `src` (rotated part and the rest) rotated into the same place of `x`.
pub struct RopeIo<'a, E> {
    pub x: &'a mut [E],
    /// Out of place: only read, with `x`'s strides and length (what an
    /// autograd op needs: no copy first).
    pub src: Option<&'a [E]>,
    /// `[batch or 1, seq, rot_dim/2]` (see [`RopeShape::per_batch_tables`]).
    pub cos: &'a [E],
    pub sin: &'a [E],
}

impl<E> RopeIo<'_, E> {
    /// The checks shared by [`rope_apply`] and its reference.
    fn plan(&self, s: &RopeShape) -> Result<Plan, KernelError> {
        if let Some(src) = self.src {
            check_len("rope out", src.len(), self.x.len())?;
        }
        plan(s, self.x.len(), self.cos.len(), self.sin.len())
    }
}

/// What the tasks of one call share: [`RopeIo`] with `x` split between
/// them, and the sign of sin (−1 for the backward).
struct Shared<'a, E> {
    x: DisjointSlice<'a, E>,
    src: Option<&'a [E]>,
    cos: &'a [E],
    sin: &'a [E],
    sg: f32,
}

#[inline(always)]
fn rotate_rows<E: Elem, F: Fma>(t: &Shared<'_, E>, s: &RopeShape, p: &Plan, rows: Range<usize>) {
    for r in rows {
        let (off, tab) = p.row(s, r);
        let (c, sn) = (&t.cos[tab..tab + p.half], &t.sin[tab..tab + p.half]);
        match t.src {
            Some(src) => {
                // SAFETY: as below, whole rows (`plan` checked head_dim values).
                let row = unsafe { t.x.range(off..off + s.head_dim) };
                // The copy is from memory, the rotation then in L1: one
                // read of `src` and one write of `x`, as in place.
                row.copy_from_slice(&src[off..off + s.head_dim]);
                rotate_row::<E, F>(&mut row[..s.rot_dim], c, sn, s.layout, t.sg);
            }
            None => {
                // SAFETY: `plan` checked that rows do not overlap and lie
                // inside `x`; each row index is handled by one task.
                let row = unsafe { t.x.range(off..off + s.rot_dim) };
                rotate_row::<E, F>(row, c, sn, s.layout, t.sg);
            }
        }
    }
}

kvant_kernels::per_tier! {
    /// [`rotate_rows`] on `tier`.
    fn rotate_rows_on<E: Elem>(tier: SimdTier, t: &Shared<'_, E>, s: &RopeShape, p: &Plan, rows: Range<usize>)
        [F = Plain, kvant_kernels::vecops::Fused]
    {
        rotate_rows::<E, F>(t, s, p, rows)
    }
}

/// Rotates each pair (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin), with
/// cos/sin of index i = pair index, on `tier` (lowered to one the CPU
/// supports; [`cpu::tier`] is the process's own); the backward is the same
/// with sin negated (`inverse = true`). Errors if the strided extent
/// leaves `x` or if two (batch, head, seq) rows overlap (the strides must
/// describe non-overlapping rows, in any order).
pub fn rope_apply<E: Elem>(
    tier: SimdTier,
    t: RopeIo<'_, E>,
    s: &RopeShape,
    inverse: bool,
) -> Result<(), KernelError> {
    let p = t.plan(s)?;
    if p.half == 0 && t.src.is_none() {
        return Ok(());
    }
    let tier = cpu::clamp(tier);
    let cr = row_chunk(p.rows, s.head_dim.max(1));
    let shared = Shared {
        x: DisjointSlice::new(t.x),
        src: t.src,
        cos: t.cos,
        sin: t.sin,
        sg: if inverse { -1.0 } else { 1.0 },
    };
    pool::global().run(p.rows.div_ceil(cr), &|c| {
        let rows = c * cr..((c + 1) * cr).min(p.rows);
        rotate_rows_on(tier, &shared, s, &p, rows)
    });
    Ok(())
}

/// f64 reference of [`rope_apply`]: rows in (batch, head, seq) order,
/// each pair rotated in f64 and rounded once.
pub fn rope_apply_ref<E: Elem>(
    t: RopeIo<'_, E>,
    s: &RopeShape,
    inverse: bool,
) -> Result<(), KernelError> {
    let p = t.plan(s)?;
    let sg = if inverse { -1.0 } else { 1.0 };
    let x = t.x;
    for b in 0..s.batch {
        for h in 0..s.heads {
            for q in 0..s.seq {
                let off = b * s.strides[0] + h * s.strides[1] + q * s.strides[2];
                if let Some(src) = t.src {
                    x[off..off + s.head_dim].copy_from_slice(&src[off..off + s.head_dim]);
                }
                let tb = if s.per_batch_tables { b } else { 0 };
                let tab = (tb * s.seq + q) * p.half;
                for i in 0..p.half {
                    let (i1, i2) = match s.layout {
                        RopeLayout::HalfSplit => (i, i + p.half),
                        RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (u, v) = (x[off + i1].to_f32() as f64, x[off + i2].to_f32() as f64);
                    let c = t.cos[tab + i].to_f32() as f64;
                    let sn = sg * t.sin[tab + i].to_f32() as f64;
                    x[off + i1] = E::from_f32((u * c - v * sn) as f32);
                    x[off + i2] = E::from_f32((v * c + u * sn) as f32);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::norm::tests::{assert_close, f32s, rand_vec, tol};
    use half::bf16;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// `x` rotated in place.
    fn in_place<'a, E>(x: &'a mut [E], cos: &'a [E], sin: &'a [E]) -> RopeIo<'a, E> {
        RopeIo {
            x,
            src: None,
            cos,
            sin,
        }
    }

    /// Real tables: angle = pos·θ^(−2i/rot) (positions offset per batch).
    fn tables<E: Elem>(s: &RopeShape) -> (Vec<E>, Vec<E>) {
        let half = s.rot_dim / 2;
        let tb = if s.per_batch_tables { s.batch } else { 1 };
        let (mut c, mut sn) = (Vec::new(), Vec::new());
        for b in 0..tb {
            for q in 0..s.seq {
                for i in 0..half {
                    let ang =
                        (q + 7 * b) as f64 * 10000f64.powf(-((2 * i) as f64) / s.rot_dim as f64);
                    c.push(E::from_f32(ang.cos() as f32));
                    sn.push(E::from_f32(ang.sin() as f32));
                }
            }
        }
        (c, sn)
    }

    /// Shapes: (b, h, s, d, rot), strided as [b,h,s,d] contiguous, as
    /// [b,s,h,d] memory viewed as [b,h,s,d], and with padded rows.
    fn shapes() -> Vec<RopeShape> {
        let mut out = Vec::new();
        for (b, h, q, d, rot) in [
            (1, 1, 1, 2, 2),
            (1, 1, 7, 6, 2),
            (2, 3, 7, 10, 6),
            (1, 2, 31, 64, 64),
            (3, 1, 5, 7, 4),
            (2, 4, 33, 128, 128),
            (2, 2, 17, 80, 32),
        ] {
            let contiguous = [h * q * d, q * d, d];
            let bshd = [q * h * d, d, h * d];
            let padded = [h * q * (d + 3) + 5, q * (d + 3), d + 3];
            for strides in [contiguous, bshd, padded] {
                for per_batch_tables in [false, true] {
                    for layout in [RopeLayout::HalfSplit, RopeLayout::Interleaved] {
                        out.push(RopeShape {
                            batch: b,
                            heads: h,
                            seq: q,
                            head_dim: d,
                            rot_dim: rot,
                            strides,
                            per_batch_tables,
                            layout,
                        });
                    }
                }
            }
        }
        out
    }

    fn extent(s: &RopeShape) -> usize {
        (s.batch - 1) * s.strides[0]
            + (s.heads - 1) * s.strides[1]
            + (s.seq - 1) * s.strides[2]
            + s.head_dim
            + 2
    }

    /// Which of `len` values lie in the first `width` of some row.
    fn covered(s: &RopeShape, len: usize, width: usize) -> Vec<bool> {
        let mut c = vec![false; len];
        for b in 0..s.batch {
            for h in 0..s.heads {
                for q in 0..s.seq {
                    let off = b * s.strides[0] + h * s.strides[1] + q * s.strides[2];
                    c[off..off + width].iter_mut().for_each(|t| *t = true);
                }
            }
        }
        c
    }

    fn case<E: Elem>(rng: &mut ChaCha8Rng, s: &RopeShape) {
        let x: Vec<E> = rand_vec(rng, extent(s), -2.0, 2.0);
        let (c, sn) = tables::<E>(s);
        for inverse in [false, true] {
            let mut want = x.clone();
            rope_apply_ref(in_place(&mut want, &c, &sn), s, inverse).unwrap();
            for tier in cpu::available_tiers() {
                let mut got = x.clone();
                rope_apply(tier, in_place(&mut got, &c, &sn), s, inverse).unwrap();
                let what = format!(
                    "{s:?} inverse {inverse} {tier} {}",
                    std::any::type_name::<E>()
                );
                assert_close(&what, &f32s(&got), &f32s(&want), tol::<E>());
                // Values outside the rotated part of every row (padding,
                // pass-through dims) are untouched.
                let touched = covered(s, x.len(), s.rot_dim);
                for (k, t) in touched.iter().enumerate() {
                    if !t {
                        assert_eq!(
                            got[k].to_f32().to_bits(),
                            x[k].to_f32().to_bits(),
                            "{what}: [{k}]"
                        );
                    }
                }
                // Out of place: each row (all head_dim values) as in place,
                // nothing else of `out` written.
                let mut into = vec![E::from_f32(f32::NAN); x.len()];
                rope_apply(
                    tier,
                    RopeIo {
                        src: Some(&x),
                        ..in_place(&mut into, &c, &sn)
                    },
                    s,
                    inverse,
                )
                .unwrap();
                let row = covered(s, x.len(), s.head_dim);
                for (k, &r) in row.iter().enumerate() {
                    let v = into[k].to_f32();
                    if r {
                        assert_eq!(v.to_bits(), got[k].to_f32().to_bits(), "{what} into [{k}]");
                    } else {
                        assert!(v.is_nan(), "{what} into wrote [{k}]");
                    }
                }
            }
        }
    }

    #[test]
    fn every_tier_matches_the_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        for s in shapes() {
            case::<f32>(&mut rng, &s);
            case::<bf16>(&mut rng, &s);
        }
    }

    /// The backward undoes the forward (the rotation is orthogonal), and
    /// the forward moves values (x is rotated in place, so the "poison"
    /// check of this op is that a row left unwritten would differ from
    /// the reference above wherever its angle is not 0).
    #[test]
    fn inverse_undoes_forward() {
        let tier = cpu::tier();
        let mut rng = ChaCha8Rng::seed_from_u64(22);
        for s in shapes() {
            let x: Vec<f32> = rand_vec(&mut rng, extent(&s), -2.0, 2.0);
            let (c, sn) = tables::<f32>(&s);
            let mut y = x.clone();
            rope_apply(tier, in_place(&mut y, &c, &sn), &s, false).unwrap();
            if s.seq > 1 {
                assert_ne!(x, y, "{s:?}: nothing rotated");
            }
            rope_apply(tier, in_place(&mut y, &c, &sn), &s, true).unwrap();
            assert_close(&format!("{s:?}"), &y, &x, (0.0, 2e-6));
        }
    }

    /// The rotation is linear in x, so central differences of
    /// `L = Σ g·rope(x)` with a large step are exact up to f32 rounding
    /// of the outputs: the backward (`inverse`) of g is dL/dx.
    #[test]
    fn reference_backward_matches_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(23);
        for layout in [RopeLayout::HalfSplit, RopeLayout::Interleaved] {
            let s = RopeShape {
                batch: 2,
                heads: 2,
                seq: 3,
                head_dim: 6,
                rot_dim: 4,
                strides: [3 * 2 * 6, 6, 2 * 6],
                per_batch_tables: true,
                layout,
            };
            let n = 2 * 2 * 3 * 6;
            let x: Vec<f32> = rand_vec(&mut rng, n, -1.0, 1.0);
            let g: Vec<f32> = rand_vec(&mut rng, n, -1.0, 1.0);
            let (c, sn) = tables::<f32>(&s);
            let loss = |x: &[f32]| -> f64 {
                let mut y = x.to_vec();
                rope_apply_ref(in_place(&mut y, &c, &sn), &s, false).unwrap();
                y.iter().zip(&g).map(|(a, b)| *a as f64 * *b as f64).sum()
            };
            let mut dx = g.clone();
            rope_apply_ref(in_place(&mut dx, &c, &sn), &s, true).unwrap();
            for k in 0..n {
                let (mut xp, mut xm) = (x.clone(), x.clone());
                xp[k] += 0.5;
                xm[k] -= 0.5;
                let fd = (loss(&xp) - loss(&xm)) / 1.0;
                assert!(
                    (fd - dx[k] as f64).abs() < 1e-5,
                    "{layout:?} [{k}]: {fd} vs {}",
                    dx[k]
                );
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let tier = cpu::tier();
        let s = RopeShape {
            batch: 2,
            heads: 3,
            seq: 4,
            head_dim: 8,
            rot_dim: 8,
            strides: [96, 32, 8],
            per_batch_tables: false,
            layout: RopeLayout::HalfSplit,
        };
        let mut x = vec![0f32; 192];
        let t = vec![0f32; 16];
        assert!(rope_apply(tier, in_place(&mut x, &t, &t), &s, false).is_ok());
        assert!(rope_apply(tier, in_place(&mut x[..191], &t, &t), &s, false).is_err());
        assert!(rope_apply(tier, in_place(&mut x, &t[..15], &t), &s, false).is_err());
        assert!(rope_apply(tier, in_place(&mut x, &t, &t[..15]), &s, false).is_err());
        let mut out = vec![0f32; 192];
        assert!(rope_apply(
            tier,
            RopeIo {
                src: Some(&x),
                ..in_place(&mut out, &t, &t)
            },
            &s,
            false
        )
        .is_ok());
        assert!(rope_apply(
            tier,
            RopeIo {
                src: Some(&x),
                ..in_place(&mut out[..191], &t, &t)
            },
            &s,
            false
        )
        .is_err());
        assert!(rope_apply(
            tier,
            RopeIo {
                src: Some(&x[..191]),
                ..in_place(&mut out[..191], &t, &t)
            },
            &s,
            false
        )
        .is_err());
        let pb = RopeShape {
            per_batch_tables: true,
            ..s
        };
        assert!(rope_apply(tier, in_place(&mut x, &t, &t), &pb, false).is_err());
        let t2 = vec![0f32; 32];
        assert!(rope_apply(tier, in_place(&mut x, &t2, &t2), &pb, false).is_ok());
        for rot_dim in [7, 10] {
            assert!(rope_apply(
                tier,
                in_place(&mut x, &t, &t),
                &RopeShape { rot_dim, ..s },
                false
            )
            .is_err());
        }
        // Overlapping rows: seq stride below head_dim, equal strides, a
        // zero batch stride, heads interleaved into seq.
        for strides in [[96, 32, 7], [96, 8, 8], [0, 32, 8], [96, 16, 8]] {
            let r = rope_apply_ref(in_place(&mut x, &t, &t), &RopeShape { strides, ..s }, false);
            assert!(r.is_err(), "{strides:?}");
            assert!(rope_apply(
                tier,
                in_place(&mut x, &t, &t),
                &RopeShape { strides, ..s },
                false
            )
            .is_err());
        }
        // Any order of non-overlapping strides is fine; a dim of one
        // entry may have any stride.
        assert!(rope_apply(
            tier,
            in_place(&mut x, &t, &t),
            &RopeShape {
                strides: [8, 16, 48],
                ..s
            },
            false
        )
        .is_ok());
        let one = RopeShape {
            batch: 1,
            strides: [0, 32, 8],
            ..s
        };
        assert!(rope_apply(tier, in_place(&mut x, &t, &t), &one, false).is_ok());
        // Overflowing sizes are errors, not panics.
        let huge = RopeShape {
            batch: usize::MAX,
            strides: [usize::MAX, 32, 8],
            ..s
        };
        assert!(rope_apply(tier, in_place(&mut x, &t, &t), &huge, false).is_err());
        let huge2 = RopeShape {
            batch: 3,
            strides: [usize::MAX / 2, 32, 8],
            ..s
        };
        assert!(rope_apply(tier, in_place(&mut x, &t, &t), &huge2, false).is_err());
    }
}
