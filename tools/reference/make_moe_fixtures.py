#!/usr/bin/env python3
"""Write the MoE / MLA model fixtures under tests/fixtures/models/.

Sections (both by default; pick with flags):
  --tiny   tiny random MoE/MLA checkpoints (HF dirs) + reference.json each
           (deepseek-v3 also with its MTP module and an `mtp` reference)
  --gguf   the same converted by llama.cpp's convert_hf_to_gguf.py (F32, and
           Q8_0 for qwen3-moe and deepseek-v3) + <name>.<type>.reference.json;
           needs the converter: --converter PATH or $LLAMA_CPP_CONVERTER
           (rebuilds --tiny first)

Same determinism, prompt, reference format and self-checks as
make_model_fixtures.py, plus MoE routing margins (moe_routing_checks.py).
Run with the reference venv, from the repository root:
  .venv/bin/python tools/reference/make_moe_fixtures.py --converter PATH
See tools/reference/README.md for what the files hold.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixture_json  # noqa: E402
import gguf_readback  # noqa: E402
import make_model_fixtures as base  # noqa: E402
import moe_models  # noqa: E402
import moe_routing_checks  # noqa: E402
import mtp_reference  # noqa: E402
import reference_outputs  # noqa: E402
import tiny_models  # noqa: E402
import tiny_tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS = base.MODELS
GGUF_DIR = MODELS / "gguf"
CONVERT_WRAPPER = HERE / "convert_with_llama_cpp.py"

# (model, GGUF file types). qwen2-moe's dense layer 0 has no place in llama.cpp's
# qwen2moe graph, so its all-MoE sibling is converted instead.
GGUF_JOBS = [
    ("mixtral-moe", ["Q8_0"]),
    ("qwen2-moe-sparse", ["Q8_0"]),
    ("qwen3-moe", ["Q8_0"]),
    ("deepseek-v2", ["Q8_0"]),
    ("deepseek-v3", ["Q8_0"]),
]


def tokenizer() -> Tokenizer:
    """The shared tiny tokenizer, retrained and checked equal to the committed one."""
    tok = tiny_tokenizer.train(base.PPL_TEXT.read_text(encoding="utf-8"))
    committed = Tokenizer.from_file(str(MODELS / "tokenizer" / "tokenizer.json"))
    if tok.to_str() != committed.to_str():
        raise AssertionError("tiny tokenizer differs from tests/fixtures/models/tokenizer; run make_model_fixtures.py")
    return tok


def _finish(model: torch.nn.Module, ref: dict, notes: list[str]) -> dict:
    """`ref` with its routing checked: `notes` (plus the routing summary) placed after the
    provenance keys, per-position routing margins after greedy_min_margin."""
    stats = moe_routing_checks.check_model(model, ref["prompt_ids"] + ref["greedy_ids"][:-1])
    cfg = model.config
    if cfg.model_type in ("deepseek_v3", "deepseek_v32"):
        if stats.bias_changed == 0:
            raise AssertionError("e_score_correction_bias changes no expert choice; raise BIAS_SCORE_SPREAD")
        if cfg.n_group > 1 and stats.group_changed == 0:
            raise AssertionError("the group limit changes no expert choice; pick another seed")
    notes = notes + ["routing over prompt + greedy tokens: " + stats.note()]
    margins = [round(m, 6) for m in stats.per_position[: len(ref["prompt_ids"])]]
    out = {}
    for k, v in ref.items():
        if k == "prompt_ids":
            out["notes"] = notes
        out[k] = v
        if k == "greedy_min_margin":
            out["routing_margins"] = margins
    return out


def reload_and_reference(model, spec: tiny_models.Spec, out: Path, text: str, ids: list[int]) -> tuple:
    """The checkpoint saved in `out` reloaded (checked to compute exactly what `model` does) and its
    reference outputs on `ids`; returns (reloaded, reference)."""
    reloaded = tiny_models.load(out)
    tiny_models.reload_matches(model, reloaded, torch.tensor([ids]), exact=True)
    meta = {
        "model": spec.name,
        "source": "tiny random checkpoint, weights stored float32",
        "config_form": spec.config_form,
        "prompt_text": text,
    }
    return reloaded, reference_outputs.tiny_reference(reloaded, ids, base.GREEDY_NEW, meta)


def make_one(spec: tiny_models.Spec, out: Path, tok: Tokenizer, text: str, ids: list[int]) -> tuple:
    """Build, save, reload and reference one checkpoint; returns (model, reference)."""
    mtp = None
    if getattr(spec.make_config(), "num_nextn_predict_layers", 0):
        model, mtp = mtp_reference.build_with_mtp(spec)
    else:
        model = moe_models.build(spec)
    moe_models.save(model, out, spec.config_form, tok)
    if mtp is not None:
        mtp_reference.append_to_checkpoint(out, mtp["tensors"])
    reloaded, ref = reload_and_reference(model, spec, out, text, ids)
    notes = []
    if mtp is not None:
        notes.append(
            f"model.safetensors also holds the MTP module as layer {model.config.num_hidden_layers} "
            "(transformers does not load it); its reference is `mtp`"
        )
        ref["mtp"] = mtp_reference.reference(model, mtp, ids, out)
    return model, _finish(reloaded, ref, notes)


def make_tiny(tok: Tokenizer) -> dict[str, tuple]:
    text, ids = base.tiny_prompt(tok)
    built = {}
    for spec in moe_models.SPECS:
        out = MODELS / spec.name
        model, ref = make_one(spec, out, tok, text, ids)
        fixture_json.write_json(out / "reference.json", ref)
        built[spec.name] = (model, ref, out)
        mtp = f", mtp argmax {ref['mtp']['argmax'][:6]}…" if "mtp" in ref else ""
        print(f"{spec.name}: ppl {ref['ppl']:.3f} greedy {ref['greedy_ids']} margin {ref['greedy_min_margin']}{mtp}")
        print(f"  {ref['notes'][-1]}")
    return built


def convert(
    converter: Path, src: Path, name: str, file_type: str, out_dir: Path = GGUF_DIR, extra: tuple[str, ...] = ()
) -> Path:
    path = out_dir / f"{name}.{file_type}.gguf"
    cmd = [sys.executable, str(CONVERT_WRAPPER), "--converter", str(converter), str(src)]
    cmd += ["--outtype", file_type.lower(), "--outfile", str(path), "--model-name", name, *extra]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"converter failed on {name} {file_type}:\n{run.stdout}\n{run.stderr}")
    return path


def _model_from_state(config, state: dict[str, np.ndarray]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    return model


def _check_same_weights(path: Path, state: dict[str, np.ndarray], model: torch.nn.Module) -> None:
    want = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if set(state) != set(want):
        raise AssertionError(f"{path.name}: tensors differ: {sorted(set(state) ^ set(want))}")
    for k, v in want.items():
        if not np.array_equal(state[k].view(np.uint32), v.view(np.uint32)):
            raise AssertionError(f"{path.name}: {k} is not the checkpoint's tensor")


def _round_trip(values: np.ndarray, qtype_name: str) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype == gguf.GGMLQuantizationType.F32:
        return values
    if qtype == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype)


def _check_quantized(path: Path, f32_path: Path) -> list[str]:
    """Every tensor of a quantized file is its F32 sibling's tensor through gguf-py's
    quantize + dequantize, so the converter and gguf.quants agree; returns type notes."""
    exact = gguf_readback.tensors(f32_path)
    by_type: dict[str, list[str]] = {}
    for name, (qtype, data) in gguf_readback.tensors(path).items():
        if not np.array_equal(data, _round_trip(exact[name][1], qtype)):
            raise AssertionError(f"{path.name}: {name} is not gguf.quants' {qtype} of the F32 tensor")
        by_type.setdefault(qtype, []).append(name)
    notes = [f"{len(v)} tensors {k}" for k, v in sorted(by_type.items())]
    f16 = sorted({re.sub(r"^blk\.\d+\.", "blk.N.", n) for n in by_type.get("F16", [])})
    if f16:
        notes.append(f"the converter fell back to F16 for {', '.join(f16)} (rows shorter than a 32-value Q8_0 block)")
    return ["tensor types: " + "; ".join(notes)]


def make_gguf(tok: Tokenizer, built: dict[str, tuple], converter: Path) -> None:
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    text, ids = base.tiny_prompt(tok)
    with tempfile.TemporaryDirectory() as tmp:
        sparse_dir = Path(tmp) / moe_models.QWEN2_MOE_SPARSE.name
        built[moe_models.QWEN2_MOE_SPARSE.name] = make_one(moe_models.QWEN2_MOE_SPARSE, sparse_dir, tok, text, ids) + (
            sparse_dir,
        )
        for name, file_types in GGUF_JOBS:
            model, hf_ref, src = built[name]
            # An F32 conversion, kept out of the repository, that the
            # committed files are checked against: it must hold the HF
            # checkpoint's weights bit for bit.
            f32_path = convert(converter, src, name, "F32", Path(tmp))
            _check_same_weights(f32_path, gguf_readback.read_state(f32_path, model.config), model)
            for file_type in file_types:
                path = convert(converter, src, name, file_type)
                arch = gguf_readback.architecture(path)
                state = gguf_readback.read_state(path, model.config)
                common = [
                    (
                        f"converted by llama.cpp's convert_hf_to_gguf.py --outtype {file_type.lower()} "
                        f"(through convert_with_llama_cpp.py), architecture {arch}"
                    )
                ]
                if name == "deepseek-v3":
                    common.append("the converter drops the MTP layer (model.layers.4.*); the GGUF has 4 blocks")
                if name == "deepseek-v2":
                    common.append(
                        "no attention.q_lora_rank: attention uses attn_q (llama.cpp itself infers that from a "
                        "block count of 26 or 27 and refuses this 3-block file; see tools/reference/README.md)"
                    )
                if name == "qwen2-moe-sparse":
                    common.append(
                        "qwen2-moe with every layer MoE (mlp_only_layers []), same seed: llama.cpp's qwen2moe "
                        "has no dense layers; the HF checkpoint is not committed, its reference is this file's"
                    )
                if file_type == "F32":
                    _check_same_weights(path, state, model)
                    source = (
                        f"{name} converted to GGUF F32; the weights read back from it equal the HF checkpoint's "
                        "bit for bit"
                    )
                    notes = common
                else:
                    notes = common + _check_quantized(path, f32_path)
                    source = (
                        f"{name} converted to GGUF {file_type}; reference computed in float32 from the weights "
                        "dequantized with gguf.quants and mapped back to transformers' names (gguf_readback.py)"
                    )
                ref_model = _model_from_state(model.config, state)
                meta = {
                    "model": f"{name}.{file_type}",
                    "source": source,
                    "gguf_file": path.name,
                    "prompt_text": text,
                }
                ref = reference_outputs.tiny_reference(ref_model, ids, base.GREEDY_NEW, meta)
                if file_type == "F32":
                    for key in ("logits", "greedy_ids", "ppl"):
                        if ref[key] != hf_ref[key]:
                            raise AssertionError(f"{path.name}: {key} differs from the HF checkpoint's reference")
                else:
                    diff = float(np.abs(np.asarray(ref["logits"]) - np.asarray(hf_ref["logits"])).max())
                    notes = notes + [f"max |logit - F32 reference| {diff:.3g}"]
                base.write_gguf_reference(path, _finish(ref_model, ref, notes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--gguf", action="store_true")
    ap.add_argument("--converter", type=Path, default=Path(os.environ.get("LLAMA_CPP_CONVERTER", "")))
    args = ap.parse_args()
    every = not (args.tiny or args.gguf)
    if (every or args.gguf) and not args.converter.is_file():
        sys.exit("--gguf needs llama.cpp's convert_hf_to_gguf.py: pass --converter PATH or set LLAMA_CPP_CONVERTER")
    base.setup_determinism()
    # The deepseek-v3 checkpoint's MTP tensors are, by design, unexpected to transformers.
    hf_logging.set_verbosity_error()
    tok = tokenizer()
    built = make_tiny(tok)
    if every or args.gguf:
        make_gguf(tok, built, args.converter.resolve())


if __name__ == "__main__":
    main()
