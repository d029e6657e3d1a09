#!/usr/bin/env python3
"""Write tests/fixtures/models/deepseek-v4-mtp/: the deepseek-v4 fixture with a
multi-token-prediction (MTP) module in DeepSeek's published layout, and the
module's reference logits.

transformers' deepseek_v4 has no MTP (it drops `mtp.*` on load), so the reference
is DeepSeek's `MTPBlock` (inference/model.py; vLLM's deepseek_v4_mtp.py reads the
same weights) computed from transformers' own parts. For the L prompt ids:

  s_i      the main model's residual streams at position i BEFORE its hc_head
           collapse, [hc_mult, hidden] (what vLLM's target hands its drafter);
  x_i,k    = e_proj(enorm(embed(ids[i+1]))) + h_proj(hnorm(s_i,k))   i in 0..L-2;
  out      = one DeepseekV4DecoderLayer (layer index num_hidden_layers: attention
           MTP_ATTENTION, top-k MoE, its own mHC) run causally over x_0..x_{L-2},
           x_i at position i (vLLM's placement: the compressor's windows line up
           with the main model's);
  logits_i = head(norm(hc_head_mtp(out_i))), the main model's head; predicts
           ids[i+2] (the last row: the token after the prompt).
No input is masked: DeepSeek's reference feeds every position (vLLM zeroes the
embedding at position 0; the first rows then differ).

The block is drawn as layer N of an (N+1)-layer model by make_v4_fixtures.build
(every V4 constant random) and saved by transformers, so it carries the names the
main layers have; the MTP-only tensors (e_proj, h_proj, enorm, hnorm, norm,
hc_head_{fn,base,scale}) come from their own seed. Names are the published
`mtp.0.*`.

Files: config.json is deepseek-v4's with num_nextn_predict_layers 1 and one more
entry in layer_types / mlp_layer_types (the published lists describe the MTP
layer after the main ones); model.safetensors.index.json maps the main weights to
model-00001-of-00002.safetensors, a symbolic link to ../deepseek-v4/model.safetensors
(no second copy), and the module to model-00002-of-00002.safetensors;
reference.json is the main fixture's (same weights; reference_models.rs checks
them through the index and the link) plus `mtp`.

With --converter PATH (or $LLAMA_CPP_CONVERTER; after make_v4_fixtures.py
--converter), the module also goes through llama.cpp's convert_hf_to_gguf.py --mtp,
which writes DeepSeek-V4's MTP to a GGUF of its own beside the main one:
tests/fixtures/models/gguf/mtp-deepseek-v4.F32.gguf (the main model's metadata with
block_count N+1 and nextn_predict_layers 1, its embedding, final norm and head, the
block as blk.N.*, `nextn.{enorm,hnorm,shared_head_norm}`, the module's hc_head as
output_hc_*, and e_proj/h_proj as one `nextn.eh_proj` = [e_proj | h_proj], which
the converter always stores as Q8_0). Its reference, mtp-deepseek-v4.F32.reference.json,
is the same computation with e_proj and h_proj dequantized from that Q8_0 tensor;
every other tensor is checked bit-identical to this fixture's. The converter runs in
make_v4_fixtures.py's child process with the same float-expert stand-in.

Run from the repository root after make_v4_fixtures.py:
  .venv/bin/python tools/reference/make_v4_mtp_fixture.py [--converter PATH]
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixture_json  # noqa: E402
import make_model_fixtures as base  # noqa: E402
import make_v4_fixtures as v4  # noqa: E402
import moe_routing_checks  # noqa: E402
import tiny_models  # noqa: E402

NAME = "deepseek-v4-mtp"
MAIN = base.MODELS / v4.NAME
# HCA: the module's block keeps a ring, a compressor tail and entries, all of
# which a rejected draft must leave valid.
MTP_ATTENTION = "heavily_compressed_attention"
SEED = 733
MAIN_SHARD = "model-00001-of-00002.safetensors"
MTP_SHARD = "model-00002-of-00002.safetensors"


def _norm(weight: torch.Tensor, eps: float):
    def apply(x: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    return apply


def build_block(main: torch.nn.Module, ids: list[int]) -> tuple[torch.nn.Module, dict, object]:
    """The MTP block (layer N of an (N+1)-layer V4 model drawn like the fixture), its
    checkpoint tensors under `mtp.0.`, and the (N+1)-layer config."""
    config = main.config
    n = config.num_hidden_layers
    longer = copy.deepcopy(config)
    longer.num_hidden_layers = n + 1
    longer.layer_types = list(config.layer_types) + [MTP_ATTENTION]
    longer.mlp_layer_types = list(config.mlp_layer_types) + ["moe"]
    spec = tiny_models.Spec(NAME, lambda: longer, seed=SEED, config_form="rope_parameters")
    big = v4.build(spec, ids)
    out = base.MODELS / NAME / "_block"
    big.save_pretrained(out, safe_serialization=True)
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    shutil.rmtree(out)
    prefix = f"model.layers.{n}."
    tensors = {"mtp.0." + k.removeprefix(prefix): v.clone() for k, v in saved.items() if k.startswith(prefix)}
    gen = torch.Generator().manual_seed(SEED + 10)
    h, hc = config.hidden_size, config.hc_mult
    own = {
        "e_proj.weight": (h, h),
        "h_proj.weight": (h, h),
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "norm.weight": (h,),
        "hc_head_fn": (hc, hc * h),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    for name, shape in sorted(own.items()):
        if name.endswith("norm.weight"):
            val = 1.0 + tiny_models.NORM_SPREAD * torch.randn(shape, generator=gen)
        elif name == "hc_head_base":
            val = v4.HC_BASE_SPREAD * torch.randn(shape, generator=gen)
        elif name == "hc_head_scale":
            val = 1.0 + v4.HC_SCALE_SPREAD * torch.randn(shape, generator=gen)
        else:
            val = config.initializer_range * torch.randn(shape, generator=gen)
        tensors["mtp.0." + name] = val
    return big.model.layers[n].eval(), tensors, longer


def main_streams(main: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The main model's streams before hc_head, [1, L, hc, hidden]; checks that
    hc_head, norm and lm_head of them give the model's own logits."""
    got = {}
    hook = main.model.hc_head.register_forward_hook(lambda m, args, out: got.update(s=args[0]))
    with torch.no_grad():
        logits = main(torch.tensor([ids]), use_cache=False).logits
    hook.remove()
    with torch.no_grad():
        again = main.lm_head(main.model.norm(main.model.hc_head(got["s"])))
    if not torch.equal(again, logits):
        raise AssertionError("the captured streams do not give the model's logits")
    return got["s"]


def mtp_logits(main, block, tensors: dict, longer, ids: list[int]) -> tuple[torch.Tensor, list[float]]:
    """MTP logits [L-1, vocab] (see the module doc) and each row's smallest expert
    choice margin in the block's router."""
    t = {k.removeprefix("mtp.0."): v for k, v in tensors.items()}
    eps = main.config.rms_norm_eps
    streams = main_streams(main, ids)
    head = DeepseekV4HyperHead(longer).to(torch.float32)
    with torch.no_grad():
        head.hc_fn.copy_(t["hc_head_fn"])
        head.hc_base.copy_(t["hc_head_base"])
        head.hc_scale.copy_(t["hc_head_scale"])
    seen = []
    router = block.mlp.gate
    hook = router.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    with torch.no_grad():
        inputs = torch.tensor([ids[1:]])
        e = _norm(t["enorm.weight"], eps)(main.model.embed_tokens(inputs))
        hs = _norm(t["hnorm.weight"], eps)(streams[:, :-1])
        x = torch.nn.functional.linear(e, t["e_proj.weight"]).unsqueeze(2) + torch.nn.functional.linear(
            hs, t["h_proj.weight"]
        )
        positions = torch.arange(len(ids) - 1)[None]
        rope = {kind: main.model.rotary_emb(e, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}
        mask = create_sliding_window_causal_mask(
            config=longer, inputs_embeds=e, attention_mask=None, cache=None, position_ids=positions
        )
        out = block(x, position_embeddings=rope, position_ids=positions, attention_mask=mask, input_ids=inputs)
        logits = main.lm_head(_norm(t["norm.weight"], eps)(head(out)))
    hook.remove()
    with torch.no_grad():
        hidden = seen[0].reshape(-1, seen[0].shape[-1])
        scores = router.score_fn(torch.nn.functional.linear(hidden, router.weight))
        margin = moe_routing_checks._kth_gap(scores + router.e_score_correction_bias, router.top_k)
    return logits[0], [float(m) for m in margin]


def write(tensors: dict, longer, ref: dict) -> None:
    out = base.MODELS / NAME
    out.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(MAIN / f, out / f)
    cfg = json.loads((MAIN / "config.json").read_text(encoding="utf-8"))
    cfg["num_nextn_predict_layers"] = 1
    cfg["layer_types"] = list(longer.layer_types)
    cfg["mlp_layer_types"] = list(longer.mlp_layer_types)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    link = out / MAIN_SHARD
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path("..") / v4.NAME / "model.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / MTP_SHARD), metadata={"format": "pt"})
    from safetensors import safe_open

    with safe_open(str(MAIN / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    weight_map = {k: MAIN_SHARD for k in names} | {k: MTP_SHARD for k in tensors}
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    fixture_json.write_json(out / "reference.json", ref)


def mtp_reference(logits: torch.Tensor, margins: list[float], ids: list[int], notes: list[str]) -> dict:
    """The `mtp` entry of a reference file: logits rows, argmax, mean NLL."""
    if min(margins) < moe_routing_checks.MIN_ROUTING_MARGIN:
        raise AssertionError(f"MTP routing margin {min(margins):.3g} too small; pick another SEED")
    arr = logits.numpy().astype(np.float32)
    rows = fixture_json.f32_rows(arr)
    fixture_json.check_roundtrip(arr, rows)
    targets = ids[2:]
    x = arr[: len(targets)].astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    logz = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    nll = float((logz - x[np.arange(len(targets)), targets]).mean())
    argmax = [int(i) for i in arr.argmax(axis=1)]
    hits = sum(int(a == b) for a, b in zip(argmax, targets))
    return {
        "convention": "s_i = main streams before hc_head; x_i,k = e_proj(enorm(embed(ids[i+1]))) + "
        "h_proj(hnorm(s_i,k)) for i in 0..L-2, at position i; out = the MTP block over x; "
        "logits_i = head(norm(hc_head_mtp(out_i))) predicts ids[i+2]",
        "attention": MTP_ATTENTION,
        "argmax": argmax,
        "mean_nll": nll,
        "routing_margins": [round(v, 6) for v in margins],
        "notes": [
            f"argmax equals the next prompt token at {hits} of {len(targets)} rows (random weights)",
            f"smallest expert-choice margin of the block's router {min(margins):.3g}",
            *notes,
        ],
        "logits_shape": [int(arr.shape[0]), int(arr.shape[1])],
        "logits": rows,
    }


# ---------------------------------------------------------------- the GGUF

GGUF_FILE = f"mtp-{v4.NAME}.F32.gguf"


def published_mtp_copy(tensors: dict, longer, dst: Path) -> Path:
    """deepseek-v4 in DeepSeek's published layout (make_v4_fixtures.published_copy)
    with the module added as the published checkpoints carry it: `mtp.0.*` in the
    shard (the block's kv norm as `attn.kv_norm`), num_nextn_predict_layers 1 and a
    `compress_ratios` entry for the MTP layer after the main ones."""
    from safetensors.torch import load_file

    pub = v4.published_copy(MAIN, dst)
    cfg = json.loads((pub / "config.json").read_text(encoding="utf-8"))
    cfg["num_nextn_predict_layers"] = 1
    cfg["layer_types"] = list(longer.layer_types)
    cfg["mlp_layer_types"] = list(longer.mlp_layer_types)
    rates = cfg["compress_rates"]
    cfg["compress_ratios"] = [0 if t == "sliding_attention" else rates[t] for t in cfg["layer_types"]]
    (pub / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    weights = load_file(str(pub / "model.safetensors"))
    for name, value in tensors.items():
        if name == "mtp.0.attn.norm.weight":
            name = "mtp.0.attn.kv_norm.weight"
        weights[name] = value.contiguous()
    save_file(weights, str(pub / "model.safetensors"), metadata={"format": "pt"})
    return pub


def expected_mtp_tensors(main_st: Path, tensors: dict, n: int) -> dict:
    """What the --mtp GGUF must hold but `nextn.eh_proj`: the main embedding, final
    norm and head, and the module under llama.cpp's names (make_v4_fixtures' tables)."""
    import re

    from safetensors.numpy import load_file

    main = load_file(str(main_st))
    want = {
        "token_embd.weight": main["model.embed_tokens.weight"],
        "output_norm.weight": main["model.norm.weight"],
        "output.weight": main["head.weight"],
    }
    experts: dict[str, dict[int, np.ndarray]] = {}
    own = {"enorm.weight": "enorm", "hnorm.weight": "hnorm", "norm.weight": "shared_head_norm"}
    for name, value in tensors.items():
        rest = name.removeprefix("mtp.0.")
        value = value.numpy()
        if rest.startswith("hc_head_"):
            want["output_hc_" + rest.removeprefix("hc_head_") + ".weight"] = value
        elif rest in own:
            want[f"blk.{n}.nextn.{own[rest]}.weight"] = value
        elif rest in ("e_proj.weight", "h_proj.weight"):
            continue
        elif e := re.fullmatch(r"ffn\.experts\.(\d+)\.(w[123])\.weight", rest):
            experts.setdefault(e.group(2), {})[int(e.group(1))] = value
        else:
            want[f"blk.{n}.{v4.GGUF_LAYER[rest]}"] = value
    for w, mats in experts.items():
        want[f"blk.{n}.{v4.GGUF_EXPERTS[w]}"] = np.stack([mats[i] for i in range(len(mats))])
    return want


def check_mtp_gguf(path: Path, tensors: dict, n: int, h: int) -> tuple[np.ndarray, dict]:
    """Reads the converter's file back (the venv's gguf-py: plain F32 and Q8_0) and
    checks its metadata and tensors; returns eh_proj dequantized, [h, 2h]."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    meta = {
        "general.architecture": field("general.architecture"),
        "deepseek4.block_count": field("deepseek4.block_count"),
        "deepseek4.nextn_predict_layers": field("deepseek4.nextn_predict_layers"),
        "deepseek4.attention.compress_ratios": field("deepseek4.attention.compress_ratios"),
    }
    if meta["general.architecture"] != "deepseek4" or meta["deepseek4.block_count"] != n + 1:
        raise AssertionError(f"metadata {meta}")
    if meta["deepseek4.nextn_predict_layers"] != 1:
        raise AssertionError(f"metadata {meta}")
    got = {t.name: t for t in reader.tensors}
    want = expected_mtp_tensors(MAIN / "model.safetensors", tensors, n)
    eh_name = f"blk.{n}.nextn.eh_proj.weight"
    if set(got) != set(want) | {eh_name}:
        raise AssertionError(f"tensor names differ: {sorted(set(got) ^ (set(want) | {eh_name}))}")
    for name, w in want.items():
        t = got[name]
        data = np.asarray(t.data)
        if t.tensor_type != GGMLQuantizationType.F32 or data.shape != w.shape or data.tobytes() != w.tobytes():
            raise AssertionError(f"{name}: {t.tensor_type.name} {data.shape}, not the checkpoint's {w.shape}")
    eh = got[eh_name]
    if eh.tensor_type != GGMLQuantizationType.Q8_0:
        raise AssertionError(f"{eh_name}: {eh.tensor_type.name}, the converter forces Q8_0")
    eh_deq = dequantize(np.asarray(eh.data), GGMLQuantizationType.Q8_0).reshape(h, 2 * h)
    exact = torch.cat((tensors["mtp.0.e_proj.weight"], tensors["mtp.0.h_proj.weight"]), dim=1).numpy()
    # Q8_0 (ggml's quantize_row_q8_0_ref): q = round(x · 127/amax) against the f32
    # step d = amax/127, the step then stored as f16: each value within d/2 plus
    # |q| ≤ 127 times f16's rounding of d (2^-11 relative), 0.562·d, of its block's.
    step = np.abs(exact.reshape(h, -1, 32)).max(axis=2, keepdims=True) / 127
    err = np.abs(eh_deq - exact).reshape(h, -1, 32)
    if not (err <= step * (0.5 + 127 * 2.0**-11) * (1 + 1e-4) + 1e-12).all():
        raise AssertionError(f"{eh_name}: not [e_proj | h_proj] within Q8_0's rounding")
    meta["tensors"] = len(got)
    meta["eh_proj_max_abs_error"] = float(err.max())
    return eh_deq.astype(np.float32), meta


def make_gguf(converter: Path, model, block, tensors: dict, longer, ids: list[int], float_logits) -> None:
    """gguf/mtp-deepseek-v4.F32.gguf through llama.cpp's converter --mtp, checked,
    and its reference (e_proj, h_proj as the file's Q8_0 eh_proj gives them)."""
    out_dir = base.MODELS / "gguf"
    path = out_dir / GGUF_FILE
    n, h = model.config.num_hidden_layers, model.config.hidden_size
    with tempfile.TemporaryDirectory() as tmp:
        published = published_mtp_copy(tensors, longer, Path(tmp) / v4.NAME)
        cmd = [sys.executable, str(Path(v4.__file__).resolve()), v4.CHILD_FLAG, "--convert-only"]
        cmd += ["--converter", str(converter), str(published), "--outtype", "f32", "--outfile", str(path)]
        cmd += ["--model-name", v4.NAME, "--mtp"]
        run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if run.returncode != 0 or not any(line.startswith(v4.CHECK_MARK) for line in run.stdout.splitlines()):
        raise RuntimeError(f"converter failed on {NAME}:\n{run.stdout}\n{run.stderr}")
    eh, meta = check_mtp_gguf(path, tensors, n, h)
    quantized = dict(tensors)
    quantized["mtp.0.e_proj.weight"] = torch.from_numpy(eh[:, :h].copy())
    quantized["mtp.0.h_proj.weight"] = torch.from_numpy(eh[:, h:].copy())
    logits, margins = mtp_logits(model, block, quantized, longer, ids)
    moved = float((logits - float_logits).abs().max())
    note = (
        f"GGUF: llama.cpp's DeepseekV4Model conversion --mtp --outtype f32 of {NAME} in DeepSeek's published "
        f"layout; {meta['tensors']} tensors, each bit-identical to the fixture's but nextn.eh_proj, which the "
        f"converter stores as Q8_0 (within Q8_0's rounding of [e_proj | h_proj]: max |err| "
        f"{meta['eh_proj_max_abs_error']:.3g}); routed experts stacked as F32 (make_v4_fixtures._float_experts); "
        f"this reference takes e_proj and h_proj from that Q8_0 tensor, which moves the logits by at most "
        f"{moved:.3g} from {NAME}'s"
    )
    ref = {
        "model": GGUF_FILE.removesuffix(".gguf"),
        "source": f"{NAME}'s MTP module converted by llama.cpp's convert_hf_to_gguf.py --mtp (architecture "
        f"deepseek4); the main model is gguf/{v4.NAME}.F32.gguf (its reference: {v4.NAME}.F32.reference.json)",
        "gguf_file": GGUF_FILE,
        "main_gguf_file": f"{v4.NAME}.F32.gguf",
        "metadata": {k: v for k, v in meta.items() if "." in k},
        "prompt_ids": ids,
        "notes": [note],
        # check_with_llama_cpp.py runs every gguf/*.reference.json's file as a model.
        "llama_cpp_skip": "an MTP module only (llama.cpp loads it as a draft beside its main model), and "
        "llama.cpp's deepseek4 runs only HCA ratio 128 and hc_mult 4 (this fixture: 8 and 3)",
        "mtp": mtp_reference(logits, margins, ids, []),
    }
    fixture_json.write_json(out_dir / GGUF_FILE.replace(".gguf", ".reference.json"), ref)
    print(f"{GGUF_FILE}: {path.stat().st_size} bytes; {note}")


def main() -> None:
    converter = v4.converter_arg(__doc__)
    main_ref = json.loads((MAIN / "reference.json").read_text(encoding="utf-8"))
    ids = main_ref["prompt_ids"]
    model = tiny_models.load(MAIN)
    block, tensors, longer = build_block(model, ids)
    logits, margins = mtp_logits(model, block, tensors, longer, ids)
    mtp = mtp_reference(logits, margins, ids, [])
    # The main model's reference is deepseek-v4's (the same weights, read here
    # through the index and the linked shard); `mtp` is this file's own.
    ref = {
        **main_ref,
        "model": NAME,
        "source": f"{v4.NAME}'s weights and reference plus a random MTP module (make_v4_mtp_fixture.py)",
        "mtp": mtp,
    }
    write(tensors, longer, ref)
    print(f"{NAME}: {len(tensors)} MTP tensors, mean nll {mtp['mean_nll']:.3f}, min routing margin {min(margins):.3g}")
    if converter is not None:
        make_gguf(converter, model, block, tensors, longer, ids, logits)


if __name__ == "__main__":
    main()
