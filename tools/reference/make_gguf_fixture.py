"""Writes tests/fixtures/gguf/all_types.gguf with the reference writer (gguf-py).

The file holds one metadata entry of every value type (scalars, typed arrays,
nested arrays), one tensor of every kvant dtype with deterministic bytes, and
a non-default alignment. kvant's tests read it back and check that GgufWriter
reproduces it byte for byte. Run with the reference venv:

    python tools/reference/make_gguf_fixture.py
"""

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as T
from gguf import GGUFWriter

OUT = Path(__file__).resolve().parents[2] / "tests/fixtures/gguf/all_types.gguf"

# (name, ggml type, row-major shape); quantized rows are whole blocks.
TENSORS = [
    ("t.f32", Q.F32, (3, 5)),
    ("t.f16", Q.F16, (2, 7)),
    ("t.bf16", Q.BF16, (1, 3)),
    ("t.q4_0", Q.Q4_0, (2, 32)),
    ("t.q4_1", Q.Q4_1, (1, 64)),
    ("t.q5_0", Q.Q5_0, (3, 32)),
    ("t.q5_1", Q.Q5_1, (1, 32)),
    ("t.q8_0", Q.Q8_0, (2, 64)),
    ("t.q2_k", Q.Q2_K, (1, 256)),
    ("t.q3_k", Q.Q3_K, (2, 256)),
    ("t.q4_k", Q.Q4_K, (1, 512)),
    ("t.q5_k", Q.Q5_K, (1, 256)),
    ("t.q6_k", Q.Q6_K, (2, 256)),
    ("t.mxfp4", Q.MXFP4, (2, 64)),
    ("t.nvfp4", Q.NVFP4, (1, 128)),
    ("t.vec", Q.F32, (5,)),
    ("t.4d", Q.F32, (2, 1, 3, 2)),
    ("t.i32", Q.I32, (2, 3)),
]

BLOCK = {  # ggml type: (elements per block, bytes per block)
    Q.F32: (1, 4), Q.F16: (1, 2), Q.BF16: (1, 2), Q.I32: (1, 4),
    Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22), Q.Q5_1: (32, 24), Q.Q8_0: (32, 34),
    Q.Q2_K: (256, 84), Q.Q3_K: (256, 110), Q.Q4_K: (256, 144), Q.Q5_K: (256, 176), Q.Q6_K: (256, 210),
    Q.MXFP4: (32, 17), Q.NVFP4: (64, 36),
}


def tensor_bytes(index: int, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic bytes: byte j of tensor i is (7 j + 13 i) mod 251."""
    per_block, block_bytes = BLOCK[qtype]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    row_bytes = shape[-1] // per_block * block_bytes
    n = rows * row_bytes
    data = ((np.arange(n, dtype=np.int64) * 7 + index * 13) % 251).astype(np.uint8)
    return data.reshape(shape[:-1] + (row_bytes,))


def main() -> None:
    w = GGUFWriter(OUT, arch="llama")
    w.add_custom_alignment(64)
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4_000_000_000)
    w.add_int32("test.i32", -2_000_000_000)
    w.add_float32("test.f32", 1.5)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo ✓")
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float64("test.f64", 3.141592653589793)
    typed = [
        ("u8", T.UINT8, [1, 2, 255]),
        ("i8", T.INT8, [-1, 127]),
        ("u16", T.UINT16, [65535]),
        ("i16", T.INT16, [-5, 5, 0]),
        ("u32", T.UINT32, [7, 4_000_000_000]),
        ("i32", T.INT32, [-3, 49151]),
        ("f32", T.FLOAT32, [0.25, -2.0]),
        ("bool", T.BOOL, [True, False, True]),
        ("string", T.STRING, ["a", "", "ü"]),
        ("u64", T.UINT64, [2**64 - 1]),
        ("i64", T.INT64, [-(2**63), 1]),
        ("f64", T.FLOAT64, [1e-300, 2.5]),
    ]
    for name, sub, values in typed:
        w.add_key_value(f"test.arr.{name}", values, T.ARRAY, sub_type=sub)
    w.add_array("test.arr.nested", [[1, 2], [3]])
    w.add_array("test.arr.nested_str", [["x"], ["y", "z"]])
    for i, (name, qtype, shape) in enumerate(TENSORS):
        w.add_tensor(name, tensor_bytes(i, qtype, shape), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
