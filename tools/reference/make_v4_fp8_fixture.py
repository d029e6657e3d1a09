#!/usr/bin/env python3
"""Write tests/fixtures/models/deepseek-v4-fp8/: a DeepSeek-V4 checkpoint stored the
way the published ones are, and its reference outputs.

  * FP8 linears: every attention projection (wq_a, wq_b, wkv, wo_a, wo_b), the
    indexer's wq_b and the shared expert's w1/w3 as `F8_E4M3` with one e8m0 scale
    per 128x128 block in `<stem>.scale` (`F8_E8M0`, DeepSeek's own spelling and
    scale format, "scale_fmt": "ue8m0"); the shared expert's w2 with an f32 scale
    (amax / 448, not a power of two) in `<name>_scale_inv`, the spelling
    transformers and the V3-era FP8 releases use. The compressor and indexer
    kv/gate/weights projections stay in float, as in DeepSeek-V4-Flash.
  * FP4 routed experts: w1/w2/w3 as two e2m1 codes per byte (`I8`, last dim
    halved, low nibble first) with an e8m0 scale per 32 values of a row in
    `<stem>.scale` (`F8_E8M0`), as transformers' FP8/FP4 loader reads them.

The shape is make_v4_fixtures' (every attention kind, hash routing, mHC with 3
streams, random sinks and position biases), widened so that each FP8 matrix's
input is a whole number of 128-column blocks: hidden 128, q LoRA 128, heads of 64
(4 heads, 2 output groups of rank 64), expert width 128. Rows need not be: wkv
has 64 (half a row block).

The reference is transformers' DeepseekV4ForCausalLM run in float32 on the
dequantized weights (`e4m3 * scale`, `e2m1 * 2^(e-127)`, exact in f32 but for the
f32-scaled matrix, whose products round once as kvant's dequantizer rounds them):
kvant reading the stored codes must give the same logits as transformers reading
the same numbers in float.

Run from the repository root: .venv/bin/python tools/reference/make_v4_fp8_fixture.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import DeepseekV4Config  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixture_json  # noqa: E402
import make_model_fixtures as base  # noqa: E402
import make_v4_fixtures as v4  # noqa: E402
import make_moe_fixtures as moe  # noqa: E402
import moe_models  # noqa: E402
import reference_outputs  # noqa: E402
import tiny_models  # noqa: E402

NAME = "deepseek-v4-fp8"
BLOCK = 128
FP4_BLOCK = 32
E4M3_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# make_v4_fixtures' tilt of the indexer's queries, doubled: over 128-wide rows
# its 0.25 left index scores tied at exactly 0 (both ReLU'd heads clipped).
INDEX_TILT = 0.5
FP8_E8M0 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[13]\.weight$")
FP8_F32 = re.compile(r"\.shared_experts\.w2\.weight$")
FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
WIDER = {
    "hidden_size": 128,
    "q_lora_rank": 128,
    "head_dim": 64,
    "o_lora_rank": 64,
    "moe_intermediate_size": 128,
    # Rope takes a quarter of each 64-wide head (16 dims); the indexer's heads
    # keep 16 rope-free dims next to it (the fixture's tilt acts on those).
    "index_head_dim": 32,
}


def _config() -> DeepseekV4Config:
    cfg = v4._config().to_dict()
    cfg.update(WIDER)
    return DeepseekV4Config.from_dict(cfg)


SPEC = tiny_models.Spec(NAME, _config, seed=757, config_form="rope_parameters")


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """w [R, C] as [ceil(R/128), 128, C/128, 128] blocks, rows padded with zeros."""
    rows, cols = w.shape
    pad = -rows % BLOCK
    w = torch.cat([w, w.new_zeros(pad, cols)]) if pad else w
    return w.view(-1, BLOCK, cols // BLOCK, BLOCK)


def fp8(w: torch.Tensor, power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 codes, scale grid, dequantized w) with |w / scale| <= 448 per block."""
    rows, _ = w.shape
    b = _blocks(w)
    amax = b.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = amax / E4M3_MAX
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    full = scale[:, None, :, None].expand_as(b)
    codes = (b / full).to(torch.float8_e4m3fn)
    deq = (codes.float() * full).reshape(-1, w.shape[1])[:rows]
    codes = codes.reshape(-1, w.shape[1])[:rows]
    if torch.isnan(codes.float()).any():
        raise AssertionError("an FP8 code is NaN")
    return codes, scale, deq


def fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes as int8 [R, C/2], e8m0 exponents [R, C/32], dequantized w)."""
    rows, cols = w.shape
    b = w.view(rows, cols // FP4_BLOCK, FP4_BLOCK)
    amax = b.abs().amax(dim=2).clamp_min(1e-12)
    exp = torch.ceil(torch.log2(amax / 6.0))
    scale = torch.exp2(exp)[..., None]
    q = b / scale
    mag = (q.abs()[..., None] - E2M1).abs().argmin(dim=-1)
    code = mag + 8 * (q < 0).long()
    deq = (E2M1[mag] * torch.where(q < 0, -1.0, 1.0) * scale).view(rows, cols)
    code = code.view(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    e8m0 = (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, e8m0, deq


def quantize_file(path: Path) -> tuple[dict, dict, dict]:
    """The stored tensors with the targets replaced by codes and scales, the same
    tensors dequantized (for the reference model), and a per-kind count."""
    tensors = load_file(path)
    stored, dequantized, counts = {}, {}, {"fp8_e8m0": 0, "fp8_f32": 0, "fp4": 0}
    for name, w in tensors.items():
        stem = name.removesuffix(".weight")
        if FP8_E8M0.search(name):
            codes, scale, deq = fp8(w, power_of_two=True)
            stored[name] = codes
            stored[f"{stem}.scale"] = scale.to(torch.float8_e8m0fnu)
            if not torch.equal(stored[f"{stem}.scale"].float(), scale):
                raise AssertionError(f"{name}: scale not a power of two")
            counts["fp8_e8m0"] += 1
        elif FP8_F32.search(name):
            codes, scale, deq = fp8(w, power_of_two=False)
            stored[name] = codes
            stored[f"{name}_scale_inv"] = scale.float()
            counts["fp8_f32"] += 1
        elif FP4.search(name):
            packed, e8m0, deq = fp4(w)
            stored[name] = packed
            stored[f"{stem}.scale"] = e8m0
            counts["fp4"] += 1
        else:
            stored[name] = w
            deq = w
        dequantized[name] = deq.contiguous()
    return stored, dequantized, counts


def make(tok) -> None:
    v4.INDEX_TILT = INDEX_TILT
    text, ids = v4.tiny_prompt(tok)
    out = base.MODELS / NAME
    model = v4.build(SPEC, ids)
    moe_models.save(model, out, SPEC.config_form, tok)
    weights = out / "model.safetensors"
    stored, dequantized, counts = quantize_file(weights)
    with tempfile.TemporaryDirectory() as tmp:
        for f in out.iterdir():
            shutil.copy(f, tmp)
        save_file(dequantized, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        reloaded = tiny_models.load(Path(tmp))
    save_file(stored, weights, metadata={"format": "pt"})
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    meta = {
        "model": NAME,
        "source": "tiny random checkpoint, FP8 (128x128 block scales) linears and FP4 experts; "
        "reference from transformers on the dequantized weights",
        "config_form": SPEC.config_form,
        "prompt_text": text,
    }
    ref = reference_outputs.tiny_reference(reloaded, ids, v4.GREEDY_NEW, meta)
    seq = ref["prompt_ids"] + ref["greedy_ids"][:-1]
    stats, _ = v4.routing(reloaded, seq)
    indexer, _ = v4.indexer_reference(reloaded, ids)
    # Raises where a top-k over the greedy tokens is a tie (which engines break
    # in their own order).
    full_index, _ = v4.indexer_reference(reloaded, seq)
    notes = [
        f"stored: {counts['fp8_e8m0']} FP8 matrices with e8m0 block scales (.scale), {counts['fp8_f32']} with "
        f"f32 scales (_scale_inv), {counts['fp4']} FP4 expert matrices with e8m0 scales per 32",
        f"routing over prompt + greedy: smallest winning margin {stats.min_margin:.3g}; index top-k margin "
        f"min {indexer['min_margin']} over the prompt, {full_index['min_margin']} over prompt + greedy",
    ]
    final = {}
    for key, value in ref.items():
        if key == "prompt_ids":
            final["notes"] = notes
        final[key] = value
        if key == "greedy_min_margin":
            final["routing_margins"] = [round(m, 6) for m in stats.per_position[: len(ids)]]
    final["indexer"] = indexer
    fixture_json.write_json(out / "reference.json", final)
    print(f"{NAME}: ppl {ref['ppl']:.3f} greedy {ref['greedy_ids']} margin {ref['greedy_min_margin']}")
    for n in notes:
        print(f"  {n}")


def main() -> None:
    base.setup_determinism()
    hf_logging.set_verbosity_error()
    make(moe.tokenizer())


if __name__ == "__main__":
    main()
