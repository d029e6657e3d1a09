#!/usr/bin/env python3
"""Dequantization fixtures for kvant's quant kernels, made with the gguf package.

For every GGUF weight type kvant reads, this writes
tests/fixtures/quant/<TYPE>.json holding raw blocks and the f32 values that
`gguf.quants.dequantize` (a NumPy port of ggml's `dequantize_row_*`) gives for
them. crates/kvant-kernels/tests/quant_fixtures.rs checks that kvant's
reference and fast dequantizers reproduce those values bit for bit.

Two kinds of cases per type:
- "random_bytes": uniformly random block bytes, so every bit of every packed
  field (nibbles, high-bit masks, 6-bit scales) is exercised, with the f16
  scale fields overwritten by random finite halves (magnitudes 2^-26..1,
  which includes f16 subnormals and zero) so no value is inf or NaN.
- "quantized": standard-normal data quantized by `gguf.quants.quantize`, for
  the types it can quantize (the k-quants it can only dequantize).

Bytes and expected values are hex strings (expected: little-endian f32), so
the comparison is exact with no decimal round trip. Deterministic: a fixed
seed per type.

Run: .venv/bin/python tools/reference/make_quant_fixtures.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

from fixture_json import write_json

SEED = 0x4B56_4E54  # "KVNT"
RANDOM_BLOCKS = 5
QUANTIZED_BLOCKS = 3
OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "quant"

# Byte offsets of the f16 scale fields in one block (ggml-common.h layouts).
SCALE_OFFSETS: dict[T, list[int]] = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    # Their scales are bytes (e8m0, ue4m3) where every value is finite.
    T.MXFP4: [],
    T.NVFP4: [],
}
FLOAT_TYPES = [T.F16, T.BF16]
QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16, T.MXFP4}


def random_halves(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random finite f16 values with magnitudes spread over 2^-26..1."""
    sign = rng.choice([-1.0, 1.0], size=n)
    mag = np.exp2(rng.uniform(-26.0, 0.0, size=n))
    return (sign * mag).astype(np.float16)


def random_blocks(rng: np.random.Generator, qtype: T, n_blocks: int) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype == T.F16:
        values = random_halves(rng, n_blocks * block_size)
        return values.view(np.uint8).copy()
    if qtype == T.BF16:
        bits = rng.integers(0, 1 << 16, size=n_blocks * block_size, dtype=np.uint16)
        # Clear one exponent bit where all eight are set: no inf or NaN.
        bits = np.where((bits & 0x7F80) == 0x7F80, bits & ~np.uint16(0x0080), bits).astype(np.uint16)
        return bits.astype("<u2").view(np.uint8).copy()
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        blocks[:, off : off + 2] = random_halves(rng, n_blocks).astype("<f2").view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def case(source: str, qtype: T, raw: np.ndarray) -> dict:
    expected = np.asarray(quants.dequantize(raw, qtype), dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(expected)):
        raise ValueError(f"{qtype.name} {source}: non-finite expected value")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if raw.size % type_size or expected.size != raw.size // type_size * block_size:
        raise ValueError(f"{qtype.name} {source}: size mismatch")
    return {
        "source": source,
        "elements": int(expected.size),
        "raw": raw.tobytes().hex(),
        "expected_f32_le": expected.astype("<f4").tobytes().hex(),
    }


def fixture(qtype: T) -> dict:
    rng = np.random.default_rng([SEED, int(qtype)])
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    # Float types have one-element "blocks": use as many elements as one Q4_0 row of 3 blocks.
    per_case = 1 if qtype in SCALE_OFFSETS else 96
    cases = [case("random_bytes", qtype, random_blocks(rng, qtype, RANDOM_BLOCKS * per_case))]
    if qtype in QUANTIZABLE:
        data = rng.standard_normal(QUANTIZED_BLOCKS * per_case * block_size).astype(np.float32)
        raw = np.asarray(quants.quantize(data, qtype)).view(np.uint8).reshape(-1)
        cases.append(case("quantized", qtype, raw))
    return {
        "dtype": qtype.name,
        "ggml_type": int(qtype),
        "block_size": block_size,
        "type_size": type_size,
        "cases": cases,
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for qtype in [*SCALE_OFFSETS, *FLOAT_TYPES]:
        path = OUT / f"{qtype.name}.json"
        write_json(path, fixture(qtype))
        print(f"wrote {path.relative_to(OUT.parents[2])}")


if __name__ == "__main__":
    main()
