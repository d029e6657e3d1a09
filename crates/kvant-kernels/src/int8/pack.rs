//! Weights repacked at load time into the row-interleaved layout of the
//! int8 kernels.
//!
//! GGUF stores each row's blocks back to back. The int8 kernels instead
//! work on 8 rows at once with one 256-bit register holding the same 4
//! consecutive weights of each of the 8 rows (one 32-bit lane per row), so
//! one broadcast of 4 activation bytes feeds an integer multiply-add for all
//! 8 rows and the 8 rows' sums land in 8 lanes: the block scales are then
//! applied with one vector FMA per block for 8 rows, never per row, and no
//! horizontal sum is needed (ggml's `block_q4_0x8` repacking makes the same
//! trade). Sizes are unchanged: a packed block of 8 rows is exactly 8 of
//! the source blocks, reordered, so decode streams the same bytes.
//!
//! Packed block of 8 rows × 32 weights (group `g`, block `b` at
//! `(g * blocks_per_row + b) * block_bytes`):
//! - `Q4Sym` (from Q4_0, `w = d (q - 8)`): `d: [f16; 8]`, then 4 chunks of
//!   32 bytes; chunk `c`, lane `r` holds source bytes `4c..4c+4` of row `r`
//!   (low nibbles: weights `4c..4c+4`, high nibbles: `16+4c..16+4c+4`).
//! - `Q4Asym` (from Q4_1, `w = d q + m`): `d: [f16; 8]`, `m: [f16; 8]`, chunks as above.
//! - `Q8` (from Q8_0, `w = d q`, and from Q5_0, `w = d (q - 16)` with the
//!   5-bit `q - 16` widened to a byte: exact, at 34 instead of 22 bytes per
//!   block): `d: [f16; 8]`, then 8 chunks of 32 bytes, chunk `c`, lane `r`
//!   holding weights `4c..4c+4` of row `r`.
//! - `Q4K` (from Q4_K: 256 weights in 8 sub-blocks of 32, `w = d·sc_j q -
//!   dmin·m_j`): `d: [f16; 8]`, `dmin: [f16; 8]`, `sc: [[u8; 8]; 8]` and
//!   `m: [[u8; 8]; 8]` (sub-block-major: the 8 rows' 6-bit scales of
//!   sub-block `j` are 8 consecutive bytes, widened to lanes by one load),
//!   then 32 chunks of 32 bytes: chunk `k = 8p + c`, lane `r` holds source
//!   bytes `4k..4k+4` of row `r` (low nibbles: sub-block `2p`, weights
//!   `4c..4c+4`; high nibbles: sub-block `2p+1`). 1184 bytes per 8 rows
//!   instead of 1152: the scales unpacked.
//! - `Q5K` (from Q5_K: `Q4K` with a fifth bit per weight): as `Q4K`, then
//!   8 chunks of 32 bytes, chunk `c`, lane `r` holding source bytes
//!   `4c..4c+4` of row `r`'s `qh`, whose bit `j` is the fifth bit of the
//!   weight of sub-block `j` that the low chunks hold in the same byte
//!   position (`4c + i`). 1440 bytes per 8 rows instead of 1408.
//! - `Q6K` (from Q6_K: 256 weights in 16 sub-blocks of 16, `w = d·sc_j
//!   (q - 32)`, `q` 6-bit, `sc_j` a signed byte): `d: [f16; 8]`, `sc:
//!   [[i8; 8]; 16]` (sub-block-major, as for `Q4K`), then 32 chunks of 32
//!   low-nibble bytes and 16 chunks of 32 high-bit bytes. Weight `w = 64u +
//!   32s + 16h + 4k + i` (`u < 4`; `s`, `h < 2`; `k`, `i < 4`) of row `r`
//!   has its low 4 bits in nibble `s` of byte `i` of lane `r` of low chunk
//!   `8u + 4h + k`, and its top 2 bits at bit `2(s + 2h)` of byte `i` of
//!   lane `r` of high chunk `4u + k`: one high chunk completes the values of
//!   two low chunks, side `s` picks the activation block (`2u + s`) and `h`
//!   its half (sub-block `4u + 2s + h`). The 6 bits stay 6 bits: 1680 bytes
//!   per 8 rows, as stored, since decoding reads every weight once from
//!   memory and a widened byte per weight would read 30% more.
//! - `Mxfp4` (from MXFP4: `w = kvalues[q] · 2^(e − 128)`, `kvalues` the
//!   doubled e2m1 values −12…12): `e: [u8; 8]` (the rows' scale bytes as
//!   stored), then 4 chunks of 32 bytes as for `Q4Sym` (the nibbles are
//!   codes, looked up per chunk). 136 bytes per 8 rows, as stored.
//!
//! Rows past the end of the matrix (the last group) are zero.

use crate::error::KernelError;
use kvant_core::dtype::{QK, QK_K};
use kvant_core::{DType, Tensor};

/// Sub-blocks of 32 in a Q4_K super-block.
pub(crate) const SUBS: usize = QK_K / QK;

/// The most quant bytes a source block gives [`source_block`] (Q5_K's).
const SOURCE_QUANTS: usize = QK_K / 2 + QK_K / 8;

/// Offset of the fifth-bit chunks in a packed `Q5K` block (after the
/// header and the 32 low-nibble chunks).
pub(crate) const Q5K_HIGH: usize = 4 * GROUP + 2 * SUBS * GROUP + GROUP * QK_K / 2;

/// Sub-blocks of 16 (one scale each) in a Q6_K super-block.
pub(crate) const Q6K_SUBS: usize = QK_K / 16;

/// Offset of the high-bit chunks in a packed `Q6K` block (after the
/// header and the 32 low-nibble chunks).
pub(crate) const Q6K_HIGH: usize = 2 * GROUP + Q6K_SUBS * GROUP + GROUP * QK_K / 2;

/// Rows per interleaved group: one 32-bit lane each in a 256-bit register.
pub const GROUP: usize = 8;

/// The packed formats, named by what one weight holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedFormat {
    /// 4-bit `q` with `w = d (q - 8)` (Q4_0).
    Q4Sym,
    /// 4-bit `q` with `w = d q + m` (Q4_1).
    Q4Asym,
    /// 8-bit signed `q` with `w = d q` (Q8_0, and Q5_0 widened).
    Q8,
    /// 4-bit `q` in super-blocks of 256 with 6-bit sub-block scales and
    /// minimums (Q4_K).
    Q4K,
    /// 5-bit `q`, otherwise as `Q4K` (Q5_K).
    Q5K,
    /// 6-bit `q` with `w = d·sc_j (q - 32)` in super-blocks of 256, a signed
    /// 8-bit scale per sub-block of 16 (Q6_K).
    Q6K,
    /// 4-bit e2m1 codes with a power-of-two (e8m0) scale per block of 32 (MXFP4).
    Mxfp4,
}

impl PackedFormat {
    /// The packed format for a stored type, if the int8 kernels handle it.
    pub fn for_dtype(dtype: DType) -> Option<PackedFormat> {
        match dtype {
            DType::Q4_0 => Some(PackedFormat::Q4Sym),
            DType::Q4_1 => Some(PackedFormat::Q4Asym),
            DType::Q8_0 | DType::Q5_0 => Some(PackedFormat::Q8),
            DType::Q4_K => Some(PackedFormat::Q4K),
            DType::Q5_K => Some(PackedFormat::Q5K),
            DType::Q6_K => Some(PackedFormat::Q6K),
            DType::MXFP4 => Some(PackedFormat::Mxfp4),
            _ => None,
        }
    }

    /// Weights per block of one row.
    const fn block_elems(self) -> usize {
        match self {
            PackedFormat::Q4K | PackedFormat::Q5K | PackedFormat::Q6K => QK_K,
            PackedFormat::Q4Sym | PackedFormat::Q4Asym | PackedFormat::Q8 | PackedFormat::Mxfp4 => {
                QK
            }
        }
    }

    /// Bytes before the quants in a packed block: the scales (and minimums).
    pub(crate) const fn header(self) -> usize {
        match self {
            PackedFormat::Q4Asym => 4 * GROUP,
            PackedFormat::Q4Sym | PackedFormat::Q8 => 2 * GROUP,
            PackedFormat::Q4K | PackedFormat::Q5K => 4 * GROUP + 2 * SUBS * GROUP,
            PackedFormat::Q6K => 2 * GROUP + Q6K_SUBS * GROUP,
            PackedFormat::Mxfp4 => GROUP,
        }
    }

    /// Quant bytes of one source block.
    const fn quant_bytes(self) -> usize {
        match self {
            PackedFormat::Q8 => QK,
            PackedFormat::Q4Sym | PackedFormat::Q4Asym | PackedFormat::Mxfp4 => QK / 2,
            PackedFormat::Q4K => QK_K / 2,
            PackedFormat::Q5K => QK_K / 2 + QK_K / 8,
            PackedFormat::Q6K => QK_K / 2 + QK_K / 4,
        }
    }

    /// Bytes of one packed block of [`GROUP`] rows.
    pub(crate) const fn block_bytes(self) -> usize {
        self.header() + GROUP * self.quant_bytes()
    }
}

/// One source block in packed terms: the f16 scale and minimum as stored,
/// and the quant bytes in the packed format's order (nibble pairs for the
/// 4-bit formats, one signed byte per weight for `Q8`).
fn source_block(dtype: DType, src: &[u8], quants: &mut [u8; SOURCE_QUANTS]) -> ([u8; 2], [u8; 2]) {
    let d = [src[0], src[1]];
    match dtype {
        DType::Q4_1 => {
            quants[..QK / 2].copy_from_slice(&src[4..4 + QK / 2]);
            (d, [src[2], src[3]])
        }
        DType::Q5_0 => {
            let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
            let qs = &src[6..6 + QK / 2];
            for (j, q) in quants[..QK].iter_mut().enumerate() {
                let nib = if j < QK / 2 {
                    qs[j] & 0x0F
                } else {
                    qs[j - QK / 2] >> 4
                };
                let hi = ((qh >> j) & 1) as u8;
                *q = ((nib | hi << 4) as i8 - 16) as u8;
            }
            (d, [0, 0])
        }
        DType::Q8_0 => {
            quants[..QK].copy_from_slice(&src[2..2 + QK]);
            (d, [0, 0])
        }
        DType::MXFP4 => {
            // The e8m0 byte in place of an f16 scale.
            quants[..QK / 2].copy_from_slice(&src[1..1 + QK / 2]);
            ([src[0], 0], [0, 0])
        }
        DType::Q4_K => {
            quants[..QK_K / 2].copy_from_slice(&src[16..16 + QK_K / 2]);
            (d, [src[2], src[3]])
        }
        DType::Q5_K => {
            // `qs` (after the 32 `qh` bytes), then `qh`.
            let qs = 16 + QK_K / 8;
            quants[..QK_K / 2].copy_from_slice(&src[qs..qs + QK_K / 2]);
            quants[QK_K / 2..QK_K / 2 + QK_K / 8].copy_from_slice(&src[16..qs]);
            (d, [src[2], src[3]])
        }
        // Q4_0 (the only other type packed through here; Q6_K goes
        // through `place_q6k`).
        _ => {
            quants[..QK / 2].copy_from_slice(&src[2..2 + QK / 2]);
            (d, [0, 0])
        }
    }
}

/// The 6-bit value (`0..64`, before the offset of 32) of weight `w` of a
/// Q6_K source block (layout in `crate::quant::q6_k`).
fn q6k_source(src: &[u8], w: usize) -> u8 {
    let (half, quarter, l) = (w / 128, w % 128 / 32, w % 32);
    let low = src[64 * half + 32 * (quarter % 2) + l] >> (4 * (quarter / 2)) & 0x0F;
    let high = src[QK_K / 2 + 32 * half + l] >> (2 * quarter) & 3;
    low | high << 4
}

/// Writes the Q6_K source block `src` as lane `lane` of the packed block
/// `dst` (zeroed before its first lane is written).
fn place_q6k(src: &[u8], dst: &mut [u8], lane: usize) {
    let d = QK_K / 2 + QK_K / 4 + Q6K_SUBS;
    dst[2 * lane..2 * lane + 2].copy_from_slice(&src[d..d + 2]);
    for (j, &sc) in src[QK_K / 2 + QK_K / 4..d].iter().enumerate() {
        dst[2 * GROUP + GROUP * j + lane] = sc;
    }
    let (low, high) =
        dst[PackedFormat::Q6K.header()..].split_at_mut(Q6K_HIGH - PackedFormat::Q6K.header());
    for w in 0..QK_K {
        let q = q6k_source(src, w);
        let (u, s, h, k, i) = (w / 64, w / 32 % 2, w / 16 % 2, w / 4 % 4, w % 4);
        low[32 * (8 * u + 4 * h + k) + 4 * lane + i] |= (q & 0x0F) << (4 * s);
        high[32 * (4 * u + k) + 4 * lane + i] |= (q >> 4) << (2 * (s + 2 * h));
    }
}

/// A `[rows, cols]` weight in the interleaved layout.
#[derive(Clone, Debug)]
pub struct PackedMatrix {
    format: PackedFormat,
    rows: usize,
    cols: usize,
    data: kvant_core::HugeSlice<u8>,
}

impl PackedMatrix {
    /// Repacks a 2-D weight of a type [`PackedFormat::for_dtype`] knows;
    /// `None` for other types.
    ///
    /// # Errors
    /// [`KernelError::NotAMatrix`] unless `w` is 2-D (its byte length was
    /// checked against its shape when the tensor was made).
    pub fn pack(w: &Tensor) -> Result<Option<PackedMatrix>, KernelError> {
        let Some(format) = PackedFormat::for_dtype(w.dtype()) else {
            return Ok(None);
        };
        let &[rows, cols] = w.shape() else {
            return Err(KernelError::NotAMatrix {
                op: "pack",
                shape: w.shape().to_vec(),
            });
        };
        let nb = cols / format.block_elems();
        let src_bb = w.dtype().block_bytes();
        let row_bytes = w.dtype().bytes_for(cols)?;
        crate::error::check_len(
            "packed weight bytes",
            crate::error::checked_mul("pack", rows, row_bytes)?,
            w.bytes().len(),
        )?;
        let groups = rows.div_ceil(GROUP);
        let bb = format.block_bytes();
        let mut data = vec![0u8; crate::error::checked_mul("pack", groups * nb, bb)?];
        let (hdr, qb) = (format.header(), format.quant_bytes());
        for (r, row) in w.bytes().chunks_exact(row_bytes.max(1)).enumerate() {
            let (g, lane) = (r / GROUP, r % GROUP);
            let mut quants = [0u8; SOURCE_QUANTS];
            for (b, src) in row.chunks_exact(src_bb).enumerate() {
                let dst = &mut data[(g * nb + b) * bb..][..bb];
                if format == PackedFormat::Q6K {
                    place_q6k(src, dst, lane);
                    continue;
                }
                let (d, m) = source_block(w.dtype(), src, &mut quants);
                if format == PackedFormat::Mxfp4 {
                    dst[lane] = d[0];
                } else {
                    dst[2 * lane..2 * lane + 2].copy_from_slice(&d);
                }
                let k_quant = matches!(format, PackedFormat::Q4K | PackedFormat::Q5K);
                if k_quant || format == PackedFormat::Q4Asym {
                    dst[2 * GROUP + 2 * lane..][..2].copy_from_slice(&m);
                }
                if k_quant {
                    let packed: &[u8] = &src[4..16];
                    for j in 0..SUBS {
                        let (sc, mn) = crate::quant::q4_k::scale_min(j, packed);
                        dst[4 * GROUP + GROUP * j + lane] = sc;
                        dst[4 * GROUP + GROUP * (SUBS + j) + lane] = mn;
                    }
                }
                for (c, four) in quants[..qb].chunks_exact(4).enumerate() {
                    dst[hdr + 32 * c + 4 * lane..][..4].copy_from_slice(four);
                }
            }
        }
        Ok(Some(PackedMatrix {
            format,
            rows,
            cols,
            // On huge pages: decode streams every weight once per token.
            data: kvant_core::HugeSlice::from_vec(data),
        }))
    }

    pub fn format(&self) -> PackedFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes streamed by one pass over the weight.
    pub fn byte_len(&self) -> usize {
        self.data.len()
    }

    /// Row groups, the last possibly padded.
    pub(crate) fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Blocks per row.
    pub(crate) fn blocks(&self) -> usize {
        self.cols / self.format.block_elems()
    }

    /// The packed blocks of group `g`.
    pub(crate) fn group(&self, g: usize) -> &[u8] {
        let len = self.blocks() * self.format.block_bytes();
        &self.data[g * len..(g + 1) * len]
    }
}
