"""JSON output for reference fixtures.

Why a custom writer: reference logits are float32, and the natural `json.dumps`
of a float32 upcast to float64 prints 17 significant digits (`0.10000000149011612`).
We print each float32 as the *shortest decimal that parses back to the same
float32* (numpy's float32 repr). Any correctly rounding parser (Python's `json`,
Rust's `str::parse::<f32>`, serde_json followed by `as f32`) recovers the exact
bits, and the files stay about 40% smaller. `check_roundtrip` proves it for
every array before it is written.

Layout: objects are indented, lists of scalars stay on one line, lists of lists
put one inner list per line, so a diff of a regenerated fixture stays readable.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np


def f32_list(values: np.ndarray) -> list[float]:
    """Float32 values as Python floats whose repr is the shortest float32 decimal."""
    flat = np.asarray(values, dtype=np.float32).reshape(-1)
    out = [float(str(v)) for v in flat]
    for v in out:
        if not math.isfinite(v):
            raise ValueError("non-finite value in a reference array")
    return out


def f32_rows(matrix: np.ndarray) -> list[list[float]]:
    """A 2-D float32 array as a list of rows (see `f32_list`)."""
    m = np.asarray(matrix, dtype=np.float32)
    if m.ndim != 2:
        raise ValueError(f"expected a 2-D array, got shape {m.shape}")
    return [f32_list(row) for row in m]


def check_roundtrip(original: np.ndarray, parsed: Any) -> None:
    """Raise unless `parsed` (from JSON) is bit-identical to `original` as float32."""
    a = np.asarray(original, dtype=np.float32)
    b = np.asarray(parsed, dtype=np.float64).astype(np.float32)
    if a.shape != b.shape or not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
        raise AssertionError("float32 JSON round trip is not exact")


def _is_scalar(x: Any) -> bool:
    return x is None or isinstance(x, (bool, int, float, str))


def _dump(obj: Any, indent: int) -> str:
    pad = "  " * indent
    if _is_scalar(obj):
        return json.dumps(obj, ensure_ascii=False)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad}  {json.dumps(str(k), ensure_ascii=False)}: {_dump(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)):
        if all(_is_scalar(x) for x in obj):
            return json.dumps(list(obj), ensure_ascii=False, separators=(",", ":"))
        items = [pad + "  " + _dump(x, indent + 1) for x in obj]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` in the fixture layout, UTF-8, with a trailing newline."""
    text = _dump(obj, 0) + "\n"
    # The custom layout must still be plain JSON that means the same thing.
    if json.loads(text) != json.loads(json.dumps(obj)):
        raise AssertionError("fixture JSON layout changed the content")
    path.write_text(text, encoding="utf-8")
