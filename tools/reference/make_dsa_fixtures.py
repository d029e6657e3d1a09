#!/usr/bin/env python3
"""Write the DeepSeek-V3.2 (DSA: indexer-selected sparse attention) fixtures.

  tests/fixtures/models/deepseek-v32/        tiny random checkpoint (transformers'
                                             DeepseekV32Config) + reference.json
  tests/fixtures/models/gguf/deepseek-v32.Q8_0.gguf (+ .reference.json)
                                             the same through llama.cpp's converter
                                             (architecture deepseek32); needs
                                             --converter PATH or $LLAMA_CPP_CONVERTER

The model is deepseek-v3's toy shape (MLA 4 heads, q LoRA 32, kv latent 32, rope
16 with YaRN, sigmoid group-limited MoE) with a DSA indexer in every layer: 4
indexer heads of 32 (rope 16 first, then 16 without), top-k 8. A token at
position >= 8 sees more than 8 positions, so 16 of the 24 prompt tokens and every
greedy step attend sparsely.

Besides the usual reference (prompt logits, greedy ids, perplexity), reference.json
holds an `indexer` section: for every layer, the indexer's inputs over prompt +
greedy tokens (the normed hidden state `xn` and MLA's query latent `q_resid`),
the top-k positions transformers selected for every sparse position, and the gap
between the k-th and (k+1)-th index score (a selection is only as certain as
that gap; the script stops if any gap is below MIN_INDEX_MARGIN). It also proves
that with no more visible tokens than `index_topk` DeepSeek-V3.2 is dense MLA:
the same weights in DeepseekV3ForCausalLM give the same logits there.

Same determinism and self-checks as make_moe_fixtures.py. Run with the
reference venv from the repository root:
  .venv/bin/python tools/reference/make_dsa_fixtures.py --converter PATH
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV32Config  # noqa: E402
from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixture_json  # noqa: E402
import gguf_readback  # noqa: E402
import make_model_fixtures as base  # noqa: E402
import make_moe_fixtures as moe  # noqa: E402
import moe_models  # noqa: E402
import reference_outputs  # noqa: E402
import tiny_models  # noqa: E402

NAME = "deepseek-v32"
TOPK = 8
# Index scores are sums of a few ReLU'd f32 dot products (noise ~1e-6 of their
# scale ~1); another engine's summation order moves them by that much. 1e-4
# between the k-th and (k+1)-th score leaves 100x room.
MIN_INDEX_MARGIN = 1e-4


def _config(topk: int = TOPK) -> DeepseekV32Config:
    return moe_models.deepseek(
        DeepseekV32Config,
        num_hidden_layers=3,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=topk,
        rope_parameters=moe_models.deepseek_yarn(4.0, 64, 1.0),
        # Published V3.2 configs carry these (transformers' router is sigmoid
        # whatever they say); llama.cpp's converter writes the gating
        # function from `scoring_func`, and llama.cpp requires it.
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )


SPEC = tiny_models.Spec(NAME, _config, seed=472, config_form="deepseek")


def index_scores(indexer, hidden: torch.Tensor, q_resid: torch.Tensor, cos, sin) -> torch.Tensor:
    """The indexer's scores [S, T] for one sequence (causal, -inf above the diagonal):
    the same arithmetic as DeepseekV32Indexer.forward, kept to read the margins."""
    s = hidden.shape[1]
    q = indexer.wq_b(q_resid).view(1, s, indexer.n_heads, indexer.head_dim)
    rope = indexer.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden).float() * (indexer.n_heads**-0.5)
    out = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)[0]
    return out.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))


def indexer_reference(model: torch.nn.Module, ids: list[int]) -> dict:
    """Per layer: the indexer's inputs over `ids`, its top-k for every sparse position,
    and the k-th/(k+1)-th score gaps; checks the recomputed top-k is transformers'."""
    captured: dict[int, dict] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):

        def hook(mod, args, kwargs, out, i=i):
            hidden, q_resid, (cos, sin) = args[0], args[1], args[2]
            captured[i] = {"hidden": hidden, "q_resid": q_resid, "cos": cos, "sin": sin, "topk": out}

        hooks.append(layer.self_attn.indexer.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    layers = []
    smallest = float("inf")
    for i in sorted(captured):
        c = captured[i]
        indexer = model.model.layers[i].self_attn.indexer
        with torch.no_grad():
            scores = index_scores(indexer, c["hidden"], c["q_resid"], c["cos"], c["sin"])
        k = indexer.index_topk
        selected, margins = [], []
        for t in range(len(ids)):
            if t + 1 <= k:
                continue
            row = scores[t, : t + 1]
            top = torch.topk(row, k + 1)
            mine = sorted(top.indices[:k].tolist())
            theirs = sorted(c["topk"][0, t].tolist())
            if mine != theirs:
                raise AssertionError(f"layer {i} pos {t}: recomputed top-k {mine} != transformers' {theirs}")
            margin = float(top.values[k - 1] - top.values[k])
            smallest = min(smallest, margin)
            selected.append(mine)
            margins.append(round(margin, 6))
        hidden = c["hidden"][0].numpy()
        q_resid = c["q_resid"][0].numpy()
        layers.append(
            {
                "xn": fixture_json.f32_rows(hidden),
                "q_resid": fixture_json.f32_rows(q_resid),
                "first_sparse_pos": k,
                "selected": selected,
                "margins": margins,
            }
        )
    if smallest < MIN_INDEX_MARGIN:
        raise AssertionError(f"an index top-k is decided by {smallest:.3g} < {MIN_INDEX_MARGIN}; pick another seed")
    return {"topk": TOPK, "positions": len(ids), "min_margin": round(smallest, 6), "layers": layers}


def dense_equivalence(model: torch.nn.Module, ids: list[int]) -> float:
    """Max |logit difference| between this model and the same weights as dense MLA
    (DeepseekV3ForCausalLM) over the positions that see no more than index_topk tokens."""
    cfg = model.config.to_dict()
    keep = {k: v for k, v in cfg.items() if not k.startswith("index_") and k not in ("model_type", "architectures")}
    v3 = DeepseekV3Config(**{**keep, "rope_interleave": True})
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_config(v3, attn_implementation="eager", dtype=torch.float32).eval()
    state = {k: v for k, v in model.state_dict().items() if ".indexer." not in k}
    missing, unexpected = dense.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise AssertionError(f"dense twin: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        a = model(torch.tensor([ids])).logits[0, :TOPK]
        b = dense(torch.tensor([ids])).logits[0, :TOPK]
        # Past the top-k the two must differ, or sparsity is not engaged.
        far = (model(torch.tensor([ids])).logits[0, TOPK:] - dense(torch.tensor([ids])).logits[0, TOPK:]).abs().max()
    if float(far) < 1e-3:
        raise AssertionError("sparse attention changes nothing past the top-k; pick another seed")
    return float((a - b).abs().max())


def make_tiny(tok) -> tuple:
    text, ids = base.tiny_prompt(tok)
    out = base.MODELS / NAME
    model = moe_models.build(SPEC)
    moe_models.save(model, out, SPEC.config_form, tok)
    reloaded = tiny_models.load(out)
    tiny_models.reload_matches(model, reloaded, torch.tensor([ids]), exact=True)
    meta = {
        "model": NAME,
        "source": "tiny random checkpoint, weights stored float32",
        "config_form": SPEC.config_form,
        "prompt_text": text,
    }
    ref = reference_outputs.tiny_reference(reloaded, ids, base.GREEDY_NEW, meta)
    dense = dense_equivalence(reloaded, ids)
    notes = [
        f"index_topk {TOPK}: positions >= {TOPK} attend to their indexer's top-{TOPK} only",
        f"positions < {TOPK}: max |logit - dense MLA twin (DeepseekV3ForCausalLM, same weights)| {dense:.3g}",
    ]
    ref = moe._finish(reloaded, ref, notes)
    ref["indexer"] = indexer_reference(reloaded, ref["prompt_ids"] + ref["greedy_ids"][:-1])
    fixture_json.write_json(out / "reference.json", ref)
    print(f"{NAME}: ppl {ref['ppl']:.3f} greedy {ref['greedy_ids']} margin {ref['greedy_min_margin']}")
    print(f"  index top-k margin {ref['indexer']['min_margin']}; dense twin diff {dense:.3g}")
    return reloaded, ref, out


def make_gguf(tok, built: tuple, converter: Path) -> None:
    model, hf_ref, src = built
    moe.GGUF_DIR.mkdir(parents=True, exist_ok=True)
    text, ids = base.tiny_prompt(tok)
    with tempfile.TemporaryDirectory() as tmp:
        f32_path = moe.convert(converter, src, NAME, "F32", Path(tmp))
        moe._check_same_weights(f32_path, gguf_readback.read_state(f32_path, model.config), model)
        file_type = "Q8_0"
        path = moe.convert(converter, src, NAME, file_type)
        arch = gguf_readback.architecture(path)
        if arch != "deepseek32":
            raise AssertionError(f"{path.name}: architecture {arch}")
        state = gguf_readback.read_state(path, model.config)
        notes = [
            f"converted by llama.cpp's convert_hf_to_gguf.py --outtype {file_type.lower()} "
            f"(through convert_with_llama_cpp.py), architecture {arch}"
        ]
        notes += moe._check_quantized(path, f32_path)
        source = (
            f"{NAME} converted to GGUF {file_type}; reference computed in float32 from the weights "
            "dequantized with gguf.quants and mapped back to transformers' names (gguf_readback.py)"
        )
        ref_model = moe._model_from_state(model.config, state)
        meta = {"model": f"{NAME}.{file_type}", "source": source, "gguf_file": path.name, "prompt_text": text}
        ref = reference_outputs.tiny_reference(ref_model, ids, base.GREEDY_NEW, meta)
        diff = float(np.abs(np.asarray(ref["logits"]) - np.asarray(hf_ref["logits"])).max())
        notes.append(f"max |logit - F32 reference| {diff:.3g}")
        ref = moe._finish(ref_model, ref, notes)
        ref["indexer"] = indexer_reference(ref_model, ref["prompt_ids"] + ref["greedy_ids"][:-1])
        fixture_json.write_json(moe.GGUF_DIR / f"{NAME}.{file_type}.reference.json", ref)
        print(f"{path.name}: {path.stat().st_size} bytes, ppl {ref['ppl']:.3f} greedy {ref['greedy_ids']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="only the HF checkpoint")
    ap.add_argument("--converter", type=Path, default=Path(os.environ.get("LLAMA_CPP_CONVERTER", "")))
    args = ap.parse_args()
    if not args.tiny and not args.converter.is_file():
        sys.exit("the GGUF files need llama.cpp's convert_hf_to_gguf.py: --converter PATH or $LLAMA_CPP_CONVERTER")
    base.setup_determinism()
    hf_logging.set_verbosity_error()
    tok = moe.tokenizer()
    built = make_tiny(tok)
    if not args.tiny:
        make_gguf(tok, built, args.converter.resolve())


if __name__ == "__main__":
    main()
