#!/usr/bin/env python3
"""Write the model-correctness fixtures under tests/fixtures/.

Sections (all by default; pick with flags):
  --tiny     tiny random checkpoints (HF dirs) + reference.json each
  --gguf     llama-arch GGUF files (F32, Q8_0, Q4_0) of two tiny models + references
  --smollm2  references for the real default model (needs its GGUF, --smollm2-gguf)
  --gemma3   references for Gemma 3 270M Q4_K_M (needs its GGUF, --gemma3-gguf)

Deterministic: fixed seeds, float32, CPU, one thread, deterministic algorithms.
Run with the reference venv, from the repository root:
  .venv/bin/python tools/reference/make_model_fixtures.py
See tools/reference/README.md for the file formats.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixture_json  # noqa: E402
import gemma3_reference  # noqa: E402
import llama_gguf  # noqa: E402
import reference_outputs  # noqa: E402
import smollm2_reference  # noqa: E402
import tiny_models  # noqa: E402
import tiny_tokenizer  # noqa: E402
import window_checks  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
MODELS = FIXTURES / "models"
PPL_TEXT = FIXTURES / "text" / "ppl.txt"

PROMPT_LEN = 24
GREEDY_NEW = 16
# The tiny models' prompt: the shortest prefix of this text that encodes to
# PROMPT_LEN tokens (digits, punctuation and a newline included on purpose).
PROMPT_SOURCE = "At 6:45 the keeper lit the lamp.\nTwo ships passed, then a third; the fog came in before 11 o'clock."


def setup_determinism() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def tiny_prompt(tok: Tokenizer) -> tuple[str, list[int]]:
    """The prefix of PROMPT_SOURCE that encodes to exactly PROMPT_LEN ids."""
    for end in range(1, len(PROMPT_SOURCE) + 1):
        text = PROMPT_SOURCE[:end]
        ids = tok.encode(text).ids
        if len(ids) == PROMPT_LEN:
            return text, ids
        if len(ids) > PROMPT_LEN:
            break
    raise AssertionError("no prefix of PROMPT_SOURCE encodes to PROMPT_LEN tokens")


TOKENIZER_CASES = [
    "Hello world",
    "In  2024, 3.14 and 1000000 items",
    "a\n\n1. b",
    "   leading spaces and trailing   ",
    "Москва 東京 🙂",
    "<|im_start|>user\nHi<|im_end|>\n",
]
CHAT_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Light the lamp at 6."},
]


def train_tokenizer() -> Tokenizer:
    """Train and save the shared tiny tokenizer, plus encode/chat cases for it."""
    from transformers import AutoTokenizer

    tok = tiny_tokenizer.train(PPL_TEXT.read_text(encoding="utf-8"))
    out = MODELS / "tokenizer"
    tiny_tokenizer.save(tok, out)
    hf = AutoTokenizer.from_pretrained(out)
    cases = []
    for text in TOKENIZER_CASES:
        ids = tok.encode(text).ids
        if hf(text).input_ids != ids:
            raise AssertionError(f"transformers and tokenizers disagree on {text!r}")
        cases.append({"text": text, "ids": ids})
    rendered = hf.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    chat = {
        "messages": CHAT_MESSAGES,
        "add_generation_prompt": True,
        "rendered": rendered,
        "ids": tok.encode(rendered).ids,
    }
    fixture_json.write_json(out / "cases.json", {"add_special_tokens": False, "cases": cases, "chat": chat})
    return tok


def make_tiny(tok: Tokenizer) -> dict[str, torch.nn.Module]:
    """Write every tiny HF dir with its reference.json; return the f32 models by name."""
    text, ids = tiny_prompt(tok)
    ids_t = torch.tensor([ids])
    built: dict[str, torch.nn.Module] = {}
    for spec in tiny_models.SPECS:
        model = tiny_models.build(spec)
        out = MODELS / spec.name
        tiny_models.save(model, out, torch.float32, spec.config_form, tok)
        reloaded = tiny_models.load(out)
        tiny_models.reload_matches(model, reloaded, ids_t, exact=True)
        if getattr(reloaded.config, "sliding_window", None) is not None:
            window_checks.check_window_active(reloaded, ids)
            window_checks.check_window_semantics(reloaded, ids)
            print(f"{spec.name}: sliding window {reloaded.config.sliding_window} active, self + W-1 previous")
        meta = {
            "model": spec.name,
            "source": "tiny random checkpoint, weights stored float32",
            "config_form": spec.config_form,
            "prompt_text": text,
        }
        ref = reference_outputs.tiny_reference(reloaded, ids, GREEDY_NEW, meta)
        fixture_json.write_json(out / "reference.json", ref)
        built[spec.name] = model
        print(f"{spec.name}: ppl {ref['ppl']:.3f} greedy {ref['greedy_ids']} margin {ref['greedy_min_margin']}")
    for name, base, dtype, form in tiny_models.LOW_PRECISION:
        out = MODELS / name
        tiny_models.save(built[base], out, dtype, form, tok)
        reloaded = tiny_models.load(out)
        # The stored weights are the base ones rounded, so the outputs differ a little.
        diff = tiny_models.reload_matches(built[base], reloaded, ids_t, exact=False)
        meta = {
            "model": name,
            "source": f"{base} weights rounded to {str(dtype).removeprefix('torch.')}; "
            "reference computed in float32 from the stored (rounded) weights",
            "config_form": form,
            "prompt_text": text,
        }
        ref = reference_outputs.tiny_reference(reloaded, ids, GREEDY_NEW, meta)
        fixture_json.write_json(out / "reference.json", ref)
        print(f"{name}: max |logit - {base}| {diff:.4g}; greedy {ref['greedy_ids']}")
    return built


GGUF_MODELS = ["llama-gqa", "llama-mqa-tied"]
# transformers' GGUF model runs sdpa attention, the reference eager: float32 noise only.
GGUF_SELF_TOL = 1e-4
GGUF_DIR = MODELS / "gguf"


def _gguf_reference_model(spec_config, gguf_path: Path) -> tuple[torch.nn.Module, list[str]]:
    """Weights as transformers' GGUF loader gives them (dequantized, un-permuted),
    placed in a model built from the checkpoint's own config; and the notes on
    where transformers' GGUF-derived config falls short of it."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    loaded.eval()
    notes = []
    rope = spec_config.rope_parameters
    got = loaded.config.rope_parameters
    if got.get("rope_type", "default") != rope.get("rope_type", "default"):
        notes.append(
            f"transformers' GGUF loader ignores rope_freqs.weight (reads rope_type {got.get('rope_type')!r}, "
            f"checkpoint has {rope.get('rope_type')!r}); reference uses the checkpoint config"
        )
    model = AutoModelForCausalLM.from_config(spec_config, attn_implementation="eager", dtype=torch.float32).eval()
    model.load_state_dict(loaded.state_dict(), strict=True)
    # Where transformers read the whole GGUF right, its own model must agree.
    probe = torch.tensor([list(range(3, 3 + PROMPT_LEN))])
    with torch.no_grad():
        diff = float((loaded(probe).logits - model(probe).logits).abs().max())
    if not notes and diff > GGUF_SELF_TOL:
        raise AssertionError(f"{gguf_path.name}: transformers' GGUF model differs by {diff} with no known cause")
    if notes:
        notes.append(
            f"transformers' own GGUF-configured model differs from this reference by up to {diff:.3g} in logits"
        )
    return model, notes


def write_gguf_reference(path: Path, ref: dict) -> None:
    """`ref` as the reference of the GGUF file `path` (<name>.<type>.reference.json beside it)."""
    fixture_json.write_json(path.with_suffix(".reference.json"), ref)
    print(f"{path.name}: {path.stat().st_size} bytes, ppl {ref['ppl']:.3f} greedy {ref['greedy_ids']}")


def make_gguf(tok: Tokenizer, built: dict[str, torch.nn.Module]) -> None:
    """GGUF files of the tiny llama models in F32/Q8_0/Q4_0, each with its reference."""
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    text, ids = tiny_prompt(tok)
    for name in GGUF_MODELS:
        model = built[name]
        state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        for file_type in llama_gguf.FILE_TYPES:
            path = GGUF_DIR / f"{name}.{file_type}.gguf"
            llama_gguf.write(path, model.config, state, file_type, tok, name)
            ref_model, notes = _gguf_reference_model(model.config, path)
            # transformers' dequantize + un-permute must equal gguf's own round trip.
            want = llama_gguf.dequantized_state(model.config, state, file_type)
            for k, v in ref_model.state_dict().items():
                if not np.array_equal(v.numpy(), want[k]):
                    raise AssertionError(f"{path.name}: {k} differs from gguf.quants round trip")
            meta = {
                "model": f"{name}.{file_type}",
                "source": f"{name} weights written as a llama GGUF ({file_type}); reference computed in float32 "
                "from the dequantized weights as transformers loads them",
                "gguf_file": path.name,
                "prompt_text": text,
                "notes": notes,
            }
            ref = reference_outputs.tiny_reference(ref_model, ids, GREEDY_NEW, meta)
            write_gguf_reference(path, ref)


class RealModel(NamedTuple):
    """A real checkpoint whose reference is made from its GGUF (which is not committed)."""

    name: str  # the section flag; --{name}-gguf names the GGUF
    env: str  # the environment variable that names the GGUF otherwise
    what: str  # which checkpoint and quantization the GGUF holds
    module: ModuleType  # its reference builder: module.build(gguf, ppl_text, ppl_text_rel)
    stem: str  # the reference is tests/fixtures/models/{stem}.reference.json


REAL_MODELS = [
    RealModel("smollm2", "KVANT_MODEL", "SmolLM2-135M-Instruct Q4_1", smollm2_reference, "smollm2-135m-q4_1"),
    RealModel("gemma3", "KVANT_GEMMA3_MODEL", "Gemma 3 270M Q4_K_M", gemma3_reference, "gemma3-270m-q4_k_m"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--gguf", action="store_true")
    for real in REAL_MODELS:
        ap.add_argument(f"--{real.name}", action="store_true")
        ap.add_argument(f"--{real.name}-gguf", type=Path, default=Path(os.environ.get(real.env, "")))
    args = vars(ap.parse_args())
    every = not (args["tiny"] or args["gguf"] or any(args[real.name] for real in REAL_MODELS))
    setup_determinism()
    tok = train_tokenizer()
    built = make_tiny(tok) if (every or args["tiny"] or args["gguf"]) else {}
    if every or args["gguf"]:
        make_gguf(tok, built)
    for real in REAL_MODELS:
        if not (every or args[real.name]):
            continue
        gguf_path = args[f"{real.name}_gguf"]
        if not gguf_path.is_file():
            sys.exit(f"--{real.name} needs the {real.what} GGUF: pass --{real.name}-gguf PATH or set {real.env}")
        rel = PPL_TEXT.relative_to(REPO).as_posix()
        ref = real.module.build(gguf_path, PPL_TEXT, rel)
        fixture_json.write_json(MODELS / f"{real.stem}.reference.json", ref)


if __name__ == "__main__":
    main()
