#!/usr/bin/env python3
"""Quantizer fixtures made by ggml itself: f32 rows and the bytes llama.cpp's
reference quantizers write for them.

gguf-py can quantize the legacy 32-value types but none of the k-quants, so
for these this script calls ggml's own `quantize_row_<type>_ref` (what
`llama-quantize` runs without an importance matrix) through ctypes, from the
`libggml-base.so` of a llama.cpp build (see tools/reference/README.md for
building one). It writes tests/fixtures/quant/quantize.json:
`{"cases": [{"type", "source", "input_f32_le", "expected"}]}` with hex strings,
so the comparison in crates/kvant-kernels/tests/quant_fixtures.rs is exact.

Inputs per type: standard-normal rows, rows mixing group magnitudes over six
orders (some groups' scales round to zero against the block's largest), all
zeros, constant groups, all-positive and all-negative rows, and outliers.

Run: .venv/bin/python tools/reference/make_quantizer_fixtures.py \\
         --ggml PATH/build/bin/libggml-base.so
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

SEED = 0x4B56_5154  # "KVQT"
OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "quant" / "quantize.json"
# The types kvant quantizes to, and ggml's reference quantizer of each.
TYPES = {T.Q8_0: "q8_0", T.Q4_0: "q4_0", T.Q5_0: "q5_0", T.Q4_K: "q4_K", T.MXFP4: "mxfp4"}


def rows(rng: np.random.Generator, n: int) -> list[tuple[str, np.ndarray]]:
    """Named inputs of `n` values (a whole number of 256-value blocks)."""
    groups = n // 32
    mixed = rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-6, 0, groups), 32)
    constant = np.repeat(rng.standard_normal(groups), 32)
    outliers = rng.standard_normal(n) * 0.01
    outliers[rng.choice(n, 5, replace=False)] = rng.choice([-40.0, 25.0], 5)
    sparse = np.where(rng.random(n) < 0.9, 0.0, rng.standard_normal(n))
    return [
        ("normal", rng.standard_normal(n)),
        ("normal_small", rng.standard_normal(n) * 1e-3),
        ("mixed_magnitudes", mixed),
        ("zeros", np.zeros(n)),
        ("constant_groups", constant),
        ("positive", np.abs(rng.standard_normal(n)) + 0.5),
        ("negative", -np.abs(rng.standard_normal(n)) - 0.1),
        ("outliers", outliers),
        ("sparse", sparse),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ggml", type=Path, required=True, help="libggml-base.so of a llama.cpp build")
    args = ap.parse_args()
    lib = ctypes.CDLL(str(args.ggml.resolve()))
    rng = np.random.default_rng(SEED)
    cases = []
    for qtype, name in TYPES.items():
        fn = getattr(lib, f"quantize_row_{name}_ref")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
        block, size = GGML_QUANT_SIZES[qtype]
        for source, x in rows(rng, 512):
            x = np.ascontiguousarray(x, dtype=np.float32)
            out = np.zeros(len(x) // block * size, dtype=np.uint8)
            fn(x.ctypes.data, out.ctypes.data, len(x))
            cases.append(
                {
                    "type": qtype.name,
                    "source": source,
                    "input_f32_le": x.astype("<f4").tobytes().hex(),
                    "expected": out.tobytes().hex(),
                }
            )
    OUT.write_text(json.dumps({"cases": cases}, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
