#!/usr/bin/env python3
"""Optional cross-check of the MoE / MLA GGUF fixtures against llama.cpp itself.

Like check_with_llama_cpp.py (same settings: F32 KV cache, one thread, full
re-evaluation per greedy step), for the files make_moe_fixtures.py writes. It
shows that llama.cpp reads their metadata (expert counts and groups, gating
function, weight normalisation and scale, MLA ranks, YaRN) as the references mean
it. Needs `llama-cpp-python` and gguf-py (`gguf`, or llama.cpp's gguf-py on
PYTHONPATH):
  /tmp/lcpp/bin/python tools/reference/check_moe_with_llama_cpp.py

llama.cpp decides whether a deepseek2 model has a q LoRA by its block count (26
or 27 blocks: "lite", plain attn_q), not by the metadata, so it refuses
deepseek-v2.F32.gguf (3 blocks, no q LoRA). The script then checks a temporary
copy padded to 27 blocks with blocks that add nothing (copies of the last block
whose attn_output and ffn down projections are zero, so the residual stream passes
through them unchanged).

F32 files must match the reference logits to F32_LOGIT_TOL with identical greedy
ids; for Q8_0 files the difference is printed (llama.cpp quantizes activations).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_with_llama_cpp import MODELS, _greedy, _open, _prompt_logits  # noqa: E402

FILES = [
    "mixtral-moe.F32",
    "qwen2-moe-sparse.F32",
    "qwen3-moe.F32",
    "qwen3-moe.Q8_0",
    "deepseek-v2.F32",
    "deepseek-v3.F32",
    "deepseek-v3.Q8_0",
]
# llama.cpp vs transformers on the same f32 weights: summation order only.
F32_LOGIT_TOL = 1e-3
LITE_BLOCKS = 27
# Zeroing these makes a block add nothing to the residual stream.
SILENT = ("attn_output.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight", "ffn_down.weight")


def padded_lite_copy(src: Path, dst: Path) -> None:
    """`src` (deepseek2, no q LoRA) padded with silent blocks to LITE_BLOCKS blocks."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    n_blocks = reader.fields[f"{arch}.block_count"].contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = LITE_BLOCKS if name == f"{arch}.block_count" else field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    last = {}
    for t in reader.tensors:
        data = np.array(t.data)
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
        m = re.fullmatch(rf"blk\.{n_blocks - 1}\.(.+)", t.name)
        if m:
            last[m.group(1)] = (data, t.tensor_type)
    for bid in range(n_blocks, LITE_BLOCKS):
        for rest, (data, qtype) in last.items():
            out = np.zeros_like(data) if rest in SILENT else data
            writer.add_tensor(f"blk.{bid}.{rest}", out, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def needs_lite_padding(path: Path) -> bool:
    fields = gguf.GGUFReader(str(path)).fields
    arch = fields["general.architecture"].contents()
    if arch != "deepseek2" or f"{arch}.attention.q_lora_rank" in fields:
        return False
    return fields[f"{arch}.block_count"].contents() not in (26, 27)


def check(name: str, tmp: Path) -> bool:
    ref = json.loads((MODELS / "gguf" / f"{name}.reference.json").read_text(encoding="utf-8"))
    path = MODELS / "gguf" / ref["gguf_file"]
    how = ""
    if needs_lite_padding(path):
        padded = tmp / path.name
        padded_lite_copy(path, padded)
        path, how = padded, f" (padded to {LITE_BLOCKS} blocks)"
    llm = _open(path)
    ids = llm.tokenize(ref["prompt_text"].encode("utf-8"), add_bos=False, special=True)
    tok_ok = ids == ref["prompt_ids"]
    logits = _prompt_logits(llm, ref["prompt_ids"])
    diff = float(np.abs(logits - np.asarray(ref["logits"], dtype=np.float32)).max())
    greedy = _greedy(llm, ref["prompt_ids"], ref["greedy_new_tokens"])
    agree = next((i for i, (a, b) in enumerate(zip(greedy, ref["greedy_ids"])) if a != b), len(greedy))
    llm.close()
    is_f32 = name.endswith(".F32")
    good = tok_ok and (not is_f32 or (diff <= F32_LOGIT_TOL and agree == len(greedy)))
    print(
        f"{'ok ' if good else 'BAD'} {ref['gguf_file']}{how}: tokenize {tok_ok}, max|logit diff| {diff:.3g}, "
        f"greedy ids agree for {agree}/{len(greedy)} steps"
    )
    return good


def main() -> None:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in FILES:
            ok &= check(name, Path(tmp))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
