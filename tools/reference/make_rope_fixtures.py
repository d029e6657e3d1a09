#!/usr/bin/env python3
"""Rope scaling far past the original context: tiny models whose prompts run
ten times beyond `original_max_position_embeddings`.

The other tiny fixtures' prompts (24 tokens, 16 greedy) stay inside the 64
original positions of their rope scaling (llama-gqa's llama3, deepseek-v3's
YaRN), where a wrong wavelength band or ramp barely shows. These run a
PROMPT_LEN-token prompt (the start of tests/fixtures/text/ppl.txt) and
GREEDY_NEW greedy tokens, positions 0..655 against 64 original ones:

  llama3-long        Llama, llama3 scaling (factor 16, low/high freq factor 1/4,
                     original 64), classic spelling (`rope_scaling` with
                     `rope_type`)
  qwen3-yarn-long    Qwen3 (q/k norm), YaRN as Qwen2.5/Qwen3 publish it:
                     `rope_scaling: {"type": "yarn", "factor": 16,
                     "original_max_position_embeddings": 64}`, nothing else, so
                     beta_fast/beta_slow default to 32/1 and the rotated q/k are
                     multiplied by 0.1 ln 16 + 1 (transformers scales cos/sin)
  deepseek-yarn-long DeepSeek-V3 MLA (q LoRA, interleaved rope), every layer
                     dense (first_k_dense_replace = layers: no router whose
                     near-ties could flip), YaRN factor 16 with mscale 1 and
                     mscale_all_dim 0.707: cos/sin scaled by
                     mscale(16, 1) / mscale(16, 0.707) = 1.0679 and the softmax
                     scale by mscale(16, 0.707)^2 = 1.4305, both != 1 (published
                     DeepSeek configs set the two equal, which hides the first)

max_position_embeddings is 1024 = 16 x 64. Same recipe, determinism and
self-checks as make_model_fixtures.py (seeded random weights, float32, eager
attention, one thread; the saved dir must reload into bit-identical logits,
generate must equal uncached greedy, greedy margins >= 1e-3). reference.json
has the usual keys except that `logits` holds only the rows listed in
`logit_rows` (`logits_shape` = [len(logit_rows), vocab]), to keep the files
small; `ppl`/`mean_nll` are over the whole prompt.

    .venv/bin/python tools/reference/make_rope_fixtures.py
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import DeepseekV3Config, LlamaConfig, PretrainedConfig, Qwen3Config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixture_json  # noqa: E402
import make_model_fixtures as base  # noqa: E402
import moe_models  # noqa: E402
import reference_outputs  # noqa: E402
import tiny_models  # noqa: E402
import tiny_tokenizer  # noqa: E402

MODELS = base.MODELS
PROMPT_LEN = 640
GREEDY_NEW = 16
ORIGINAL = 64
FACTOR = 16.0
MAX_POS = 1024
# Recorded logits rows: every 32nd position, and both sides of the original context's end.
LOGIT_ROWS = sorted(set(range(0, PROMPT_LEN, 32)) | {ORIGINAL - 1, ORIGINAL, PROMPT_LEN - 1})


def _dense_long(cls: type[PretrainedConfig], rope_parameters: dict, **switches) -> PretrainedConfig:
    """A tiny_models dense config stretched to MAX_POS positions, no attention bias."""
    return tiny_models.config(
        cls, max_position_embeddings=MAX_POS, attention_bias=False, rope_parameters=rope_parameters, **switches
    )


def _llama3_long() -> PretrainedConfig:
    return _dense_long(LlamaConfig, tiny_models.llama3_rope(FACTOR, ORIGINAL))


def _qwen3_yarn_long() -> PretrainedConfig:
    return _dense_long(Qwen3Config, tiny_models.yarn_rope(FACTOR, ORIGINAL), num_attention_heads=8)


def _deepseek_yarn_long() -> PretrainedConfig:
    return moe_models.deepseek(
        DeepseekV3Config,
        max_position_embeddings=MAX_POS,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        rope_interleave=True,
        num_nextn_predict_layers=0,
        rope_parameters=moe_models.deepseek_yarn(FACTOR, ORIGINAL, 0.707),
    )


# Seeds picked so that every greedy step has a top-1/top-2 gap >= 1e-3 and the
# continuation varies.
SPECS = [
    (tiny_models.Spec("llama3-long", _llama3_long, seed=601, config_form="classic"), "classic"),
    (tiny_models.Spec("qwen3-yarn-long", _qwen3_yarn_long, seed=602, config_form="classic"), "qwen"),
    (tiny_models.Spec("deepseek-yarn-long", _deepseek_yarn_long, seed=603, config_form="deepseek"), "deepseek"),
]


def long_prompt(tok: Tokenizer) -> tuple[str, list[int]]:
    """The first PROMPT_LEN ids of ppl.txt, as text that encodes back to exactly them."""
    ids = tok.encode(base.PPL_TEXT.read_text(encoding="utf-8")).ids[:PROMPT_LEN]
    text = tok.decode(ids)
    if tok.encode(text).ids != ids:
        raise AssertionError("the prompt's text does not encode back to its ids")
    return text, ids


def _qwen_spelling(out_dir: Path) -> None:
    """Rewrite rope_scaling as Qwen's published configs spell it: `type`, and
    only factor and original_max_position_embeddings."""
    import json

    path = out_dir / "config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    s = cfg["rope_scaling"]
    if s.get("rope_type") != "yarn":
        raise AssertionError(f"expected yarn, got {s}")
    extra = set(s) - {"rope_type", "factor", "original_max_position_embeddings"}
    if extra:
        raise AssertionError(f"unexpected yarn keys {extra}")
    cfg["rope_scaling"] = {
        "factor": s["factor"],
        "original_max_position_embeddings": s["original_max_position_embeddings"],
        "type": "yarn",
    }
    path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


def reference(model: torch.nn.Module, ids: list[int], meta: dict) -> dict:
    """reference_outputs.tiny_reference with only LOGIT_ROWS of the logits."""
    ref = reference_outputs.tiny_reference(model, ids, GREEDY_NEW, meta)
    logits = reference_outputs.prompt_logits(model, ids)
    kept = logits[LOGIT_ROWS]
    rows = fixture_json.f32_rows(kept)
    fixture_json.check_roundtrip(kept, rows)
    ref["logit_rows"] = LOGIT_ROWS
    ref["logits_shape"] = [len(LOGIT_ROWS), int(logits.shape[1])]
    ref["logits"] = rows
    return ref


def rope_notes(model: torch.nn.Module) -> list[str]:
    rope = model.config.rope_parameters
    notes = [
        f"prompt positions 0..{PROMPT_LEN - 1} and greedy up to {PROMPT_LEN + GREEDY_NEW - 2}, against "
        f"original_max_position_embeddings {ORIGINAL} (factor {FACTOR:g}, max_position_embeddings {MAX_POS})",
        f"transformers' rope parameters: {dict(sorted(rope.items()))}",
    ]
    emb = model.model.rotary_emb
    notes.append(
        f"inv_freq {[float(f'{x:.6g}') for x in emb.inv_freq.tolist()]}, "
        f"attention_scaling (cos/sin factor) {emb.attention_scaling:.6g}"
    )
    if model.config.model_type == "deepseek_v3":
        scale = model.model.layers[0].self_attn.scaling
        notes.append(f"softmax scale {scale:.6g} = 32^-0.5 x {scale * math.sqrt(32):.6g}")
    return notes


def make(tok: Tokenizer) -> None:
    text, ids = long_prompt(tok)
    ids_t = torch.tensor([ids])
    for spec, spelling in SPECS:
        model = moe_models.build(spec)
        out = MODELS / spec.name
        moe_models.save(model, out, spec.config_form, tok)
        if spelling == "qwen":
            _qwen_spelling(out)
        reloaded = tiny_models.load(out)
        tiny_models.reload_matches(model, reloaded, ids_t, exact=True)
        meta = {
            "model": spec.name,
            "source": "tiny random checkpoint, weights stored float32",
            "config_form": spelling,
            "prompt_text": text,
            "notes": rope_notes(reloaded),
        }
        ref = reference(reloaded, ids, meta)
        fixture_json.write_json(out / "reference.json", ref)
        print(f"{spec.name}: ppl {ref['ppl']:.3f} greedy {ref['greedy_ids']} margin {ref['greedy_min_margin']}")
        for n in ref["notes"]:
            print(f"  {n}")


def main() -> None:
    base.setup_determinism()
    tok = tiny_tokenizer.train(base.PPL_TEXT.read_text(encoding="utf-8"))
    committed = Tokenizer.from_file(str(MODELS / "tokenizer" / "tokenizer.json"))
    if tok.to_str() != committed.to_str():
        raise AssertionError("tiny tokenizer differs from tests/fixtures/models/tokenizer; run make_model_fixtures.py")
    make(tok)


if __name__ == "__main__":
    main()
