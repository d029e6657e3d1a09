#!/usr/bin/env python3
"""Write the DeepSeek-V4 fixture: a tiny random checkpoint from transformers'
DeepseekV4Config / DeepseekV4ForCausalLM and its reference outputs.

  tests/fixtures/models/deepseek-v4/   config.json (transformers 5 spelling: nested
                                       rope_parameters main/compress, layer_types,
                                       mlp_layer_types, compress_rates),
                                       model.safetensors (float32, as save_pretrained
                                       writes it), tokenizer, reference.json

save_pretrained runs transformers' DeepSeek-V4 conversion mapping backwards, so
the tensor names are DeepSeek's own inside the layers under transformers'
`model.` prefix (`model.layers.1.attn.wq_a.weight`, `...attn.compressor.ape`,
`...attn.indexer.compressor.wkv.weight`, `...ffn.experts.3.w1.weight`,
`...ffn.gate.bias`, `...ffn.gate.tid2eid` (int64), `model.layers.0.hc_attn_fn`),
with `model.embed_tokens.weight`, `model.norm.weight`, `model.hc_head.hc_{fn,base,
scale}` and `head.weight` outside them.

Every V4 path engages in a PROMPT_LEN-token prompt (the start of
tests/fixtures/text/ppl.txt) plus GREEDY_NEW greedy tokens:
  * attention: shared-KV MQA (4 heads of 32 over one K=V head), q LoRA 32 with the
    unweighted per-head q norm, partial interleaved rope on the last 8 dims of a
    head (undone on the output with -sin), per-head attention sinks, grouped
    output projection (2 groups, rank 16), sliding window 8;
  * layer types sliding / CSA (compress rate 4, overlapping windows, Lightning
    indexer: 2 heads of 16, top-3) / HCA (rate 8, shrunk from 128 so that it
    engages here) / CSA; the compressed branches use the "compress" rope
    (theta 160000, YaRN factor 4 over 1024 original positions: one rope pair is
    half interpolated), the sliding layer the plain "main" rope (theta 10000);
  * mHC residual: 3 streams (not 2, so that unequal stream counts show indexing
    bugs), 20 Sinkhorn iterations, the final hc_head collapse;
  * MoE in every layer: layer 0 hash-routed (tid2eid), the rest sqrtsoftplus
    top-2 of 8 with e_score_correction_bias, renormalised x 1.5, one shared
    expert; SwiGLU clamped at SWIGLU_LIMIT (low enough to bite).

Weights are drawn as in tiny_models.py / moe_models.py; everything transformers
initialises to zero or one (sinks, compressor/indexer position_bias, router bias,
mHC base/scale, hc_head base/scale, tid2eid) is drawn at random too. Two shaping
steps keep the indexer's top-k decidable (2 heads: with random weights a quarter
of the index scores are exactly 0, both ReLUs clipped, and ties at the k-th
place are common): the embeddings share a common direction (EMBED_OFFSET, as
trained models' activations do), and each indexer's q_b_proj gets a rank-one
tilt (INDEX_TILT) that aligns the rope-free part of its queries with the
layer's mean compressed key, so most q.k are positive (the ReLU still clips
some of them, and changes some selections; the notes count both).

reference.json: the usual keys (reference_outputs.py) plus
  `routing_margins`   per prompt position, the smallest expert-choice margin over
                      the top-k-routed layers (hash routing has no margin)
  `layers`            per layer: attention type, compress rate, rope, MLP type, and
                      how many SwiGLU inputs the clamp changed (prompt forward)
  `indexer`           per CSA layer, over the prompt (no-cache forward): the
                      compressed entries transformers' indexer selected for every
                      position (sorted; positions that see no more than top-k
                      entries select all they see) and the k-th/(k+1)-th
                      index-score gap where more than k are visible
and notes with the self-checks (the script stops if one fails): generate's
cached per-step logits against full no-cache forwards (same argmax; the max
difference is recorded), top-k against all-entries attention (index_topk 1024:
equal before position 15, different after), each compressed branch dropped
(equal before its first entry, different after), plain rope instead of YaRN,
routing and index margins, clamp counts and what the indexer's ReLU changes.

With --converter PATH (or $LLAMA_CPP_CONVERTER), llama.cpp's convert_hf_to_gguf.py,
the fixture is also converted to tests/fixtures/models/gguf/deepseek-v4.F32.gguf
(architecture deepseek4) with llama.cpp's own DeepseekV4Model conversion, which
reads only DeepSeek's published checkpoint layout. So the conversion runs on a
copy in that layout (`published_copy`: names without transformers' `model.`
prefix, `embed.weight`, `norm.weight`, `hc_head_{fn,base,scale}`, `attn.kv_norm`,
and the config keys that converter reads: `compress_ratios`, `num_hash_layers`,
top-level `rope_scaling`), through convert_with_llama_cpp.py (pre-tokenizer
`smollm`), with one documented change for float experts (`_float_experts`). Every
weight stays float32, so the GGUF's reference.json is this reference with the
provenance changed; the script checks every GGUF tensor against model.safetensors
bit for bit.

Same determinism as make_model_fixtures.py. Run from the repository root:
  .venv/bin/python tools/reference/make_v4_fixtures.py [--converter PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ------------------------------------------ llama.cpp's converter (child process)
#
# This part runs in a process of its own (`python make_v4_fixtures.py
# --llama-cpp-child ...`, started by make_gguf) and before the imports below:
# the converter must import the gguf-py next to it (deepseek4 is not in the
# venv's gguf 0.19.0), and make_moe_fixtures imports the venv's `gguf` first.

CHILD_FLAG = "--llama-cpp-child"
CHECK_MARK = "V4-GGUF-CHECK "

# transformers' names in model.safetensors -> the GGUF's (llama.cpp's names for
# DeepSeek's own; no tensor is permuted or transposed).
GGUF_ROOT = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "head.weight": "output.weight",
    "model.hc_head.hc_fn": "output_hc_fn.weight",
    "model.hc_head.hc_base": "output_hc_base.weight",
    "model.hc_head.hc_scale": "output_hc_scale.weight",
}
GGUF_LAYER = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    **{f"hc_{b}_{t}": f"hc_{b}_{t}.weight" for b in ("attn", "ffn") for t in ("fn", "base", "scale")},
    "attn.attn_sink": "attn_sinks.weight",
    "attn.wq_a.weight": "attn_q_a.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wq_b.weight": "attn_q_b.weight",
    "attn.wkv.weight": "attn_kv.weight",
    "attn.norm.weight": "attn_kv_a_norm.weight",  # DeepSeek's attn.kv_norm
    "attn.wo_a.weight": "attn_output_a.weight",
    "attn.wo_b.weight": "attn_output_b.weight",
    **{f"attn.compressor.{a}": f"attn_compressor_{b}.weight" for a, b in
       (("wkv.weight", "kv"), ("wgate.weight", "gate"), ("ape", "ape"), ("norm.weight", "norm"))},
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    **{f"attn.indexer.compressor.{a}": f"indexer_compressor_{b}.weight" for a, b in
       (("wkv.weight", "kv"), ("wgate.weight", "gate"), ("ape", "ape"), ("norm.weight", "norm"))},
    "ffn.gate.weight": "ffn_gate_inp.weight",
    "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",  # int64 -> I32
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
}
# Routed experts: ffn.experts.{e}.{w} -> one [n_experts, rows, cols] stack per layer.
GGUF_EXPERTS = {"w1": "ffn_gate_exps.weight", "w3": "ffn_up_exps.weight", "w2": "ffn_down_exps.weight"}


def expected_gguf_tensors(safetensors_path: Path) -> tuple[dict, int]:
    """What the GGUF must hold, from model.safetensors through the tables above
    (every source tensor used once), and the number of expert matrices stacked."""
    import re

    import numpy as np
    from safetensors.numpy import load_file

    want: dict = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, value in load_file(str(safetensors_path)).items():
        if name in GGUF_ROOT:
            want[GGUF_ROOT[name]] = value
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            raise AssertionError(f"unexpected tensor {name}")
        bid, rest = int(m.group(1)), m.group(2)
        e = re.fullmatch(r"ffn\.experts\.(\d+)\.(w[123])\.weight", rest)
        if e:
            experts.setdefault((bid, e.group(2)), {})[int(e.group(1))] = value
        elif rest == "ffn.gate.tid2eid":
            as_i32 = value.astype(np.int32)
            if not np.array_equal(as_i32.astype(value.dtype), value):
                raise AssertionError(f"{name} does not fit int32")
            want[f"blk.{bid}.{GGUF_LAYER[rest]}"] = as_i32
        else:
            want[f"blk.{bid}.{GGUF_LAYER[rest]}"] = value
    for (bid, w), mats in experts.items():
        want[f"blk.{bid}.{GGUF_EXPERTS[w]}"] = np.stack([mats[i] for i in range(len(mats))])
    return want, sum(len(m) for m in experts.values())


def _float_experts(self, bid: int, proj: str, tensor_key) -> list[str]:
    """Stands in for DeepseekV4Model._write_mxfp4_expert_tensor, the converter's
    only step that needs DeepSeek's FP4 experts: the published checkpoint stores
    each routed expert as packed FP4 `weight` + e8m0 `scale`, which the converter
    repacks into one MXFP4 [n_experts, rows, cols] tensor per layer and
    projection. The tiny fixture's experts are float32 (no `.scale`; the FP4
    encoding is deepseek-v4-fp8's, make_v4_fp8_fixture.py), so this writes the
    same stack, in the same place and under the same name, as F32. Everything
    else is the converter's own code."""
    import numpy as np
    import torch
    from conversion.base import LazyTorchTensor

    mats, consumed = [], []
    for eid in range(self.hparams["n_routed_experts"]):
        name = f"layers.{bid}.ffn.experts.{eid}.{proj}.weight"
        data = LazyTorchTensor.to_eager(self.model_tensors[name]())
        if data.dtype != torch.float32:
            raise TypeError(f"{name}: {data.dtype}; this stand-in takes float32 experts only")
        mats.append(data.numpy())
        consumed.append(name)
    self.gguf_writer.add_tensor(self.format_tensor_name(tensor_key, bid), np.stack(mats))
    return consumed


def _llama_cpp_child(argv: list[str]) -> None:
    """argv: --check-against FIXTURE_DIR (or --convert-only), then
    convert_with_llama_cpp.py's arguments (--converter PATH, the published-layout
    copy, --outtype f32, --outfile, ...). Converts, then reads the GGUF back with
    the converter's gguf-py and checks it against FIXTURE_DIR/model.safetensors;
    prints one CHECK_MARK line (JSON). --convert-only leaves the check to the caller
    (make_v4_mtp_fixture.py's MTP file)."""
    import importlib

    import numpy as np

    if argv[0] == "--convert-only":
        fixture, wrapper_args = None, argv[1:]
    elif argv[0] == "--check-against":
        fixture, wrapper_args = Path(argv[1]), argv[2:]
    else:
        raise SystemExit(f"{CHILD_FLAG}: --check-against DIR or --convert-only first")
    converter = Path(wrapper_args[wrapper_args.index("--converter") + 1]).resolve()
    outfile = Path(wrapper_args[wrapper_args.index("--outfile") + 1])
    sys.path.insert(0, str(converter.parent))
    importlib.import_module(converter.stem)  # puts its own gguf-py on sys.path
    import gguf
    from conversion.deepseek import DeepseekV4Model

    import convert_with_llama_cpp

    DeepseekV4Model._write_mxfp4_expert_tensor = _float_experts
    # DeepseekV4Model.prepare_tensors only adds `ftype = MOSTLY_MXFP4_MOE` (and the
    # flag behind it) to the base class's; without it general.file_type stays
    # ALL_F32, which is what the file holds.
    del DeepseekV4Model.prepare_tensors
    sys.argv = [convert_with_llama_cpp.__file__, *wrapper_args]
    convert_with_llama_cpp.main()
    if fixture is None:
        print(CHECK_MARK + json.dumps({"gguf_py": str(Path(gguf.__file__).parent)}), flush=True)
        return

    reader = gguf.GGUFReader(str(outfile))
    arch = reader.fields["general.architecture"].contents()
    file_type = reader.fields["general.file_type"].contents()
    if arch != "deepseek4" or file_type != gguf.LlamaFileType.ALL_F32:
        raise AssertionError(f"architecture {arch}, file type {file_type}")
    got = {t.name: t for t in reader.tensors}
    want, n_expert_mats = expected_gguf_tensors(fixture / "model.safetensors")
    if set(got) != set(want):
        raise AssertionError(f"tensor names differ: {sorted(set(got) ^ set(want))}")
    types: dict[str, int] = {}
    for name, w in want.items():
        t = got[name]
        qtype = gguf.GGMLQuantizationType(t.tensor_type).name
        ok_type = qtype == ("I32" if w.dtype == np.int32 else "F32")
        data = np.asarray(t.data)
        if not ok_type or data.shape != w.shape or data.dtype != w.dtype or data.tobytes() != w.tobytes():
            raise AssertionError(f"{name}: {qtype} {data.dtype} {data.shape}, not the checkpoint's {w.shape}")
        types[qtype] = types.get(qtype, 0) + 1
    summary = {
        "tensors": len(want),
        "types": types,
        "expert_matrices": n_expert_mats,
        "expert_stacks": sum(1 for n in want if n.endswith("_exps.weight")),
        "metadata": [f for f in reader.fields if not f.startswith("GGUF.")],
        "gguf_py": str(Path(gguf.__file__).parent),
    }
    print(CHECK_MARK + json.dumps(summary), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == [CHILD_FLAG]:
    _llama_cpp_child(sys.argv[2:])
    sys.exit(0)

# ------------------------------------------------------------ the fixture script

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixture_json  # noqa: E402
import make_model_fixtures as base  # noqa: E402
import make_moe_fixtures as moe  # noqa: E402
import moe_models  # noqa: E402
import moe_routing_checks  # noqa: E402
import reference_outputs  # noqa: E402
import tiny_models  # noqa: E402

NAME = "deepseek-v4"
PROMPT_LEN = 72
GREEDY_NEW = base.GREEDY_NEW
TOPK = 3
CSA_RATE = 4
HCA_RATE = 8
LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]
MLP_LAYER_TYPES = ["hash_moe", "moe", "moe", "moe"]
# Routed and shared experts' gate/up pre-activations are ~N(0, 1.2) here; 1.5
# clamps about a sixth of them (counted in `layers`). Published V4: 10.
SWIGLU_LIMIT = 1.5
# Norm of the direction every embedding row shares (rows are otherwise 0.15 x N(0, 1)
# per entry, norm ~1.2).
EMBED_OFFSET = 2.0
# Strength of the rank-one tilt of each indexer's q_b_proj (its entries are ~0.15).
INDEX_TILT = 0.25
# Spreads of the parameters transformers initialises to constants.
SINK_SPREAD = 1.0
POSITION_BIAS_SPREAD = 0.5
HC_BASE_SPREAD = 0.5
HC_SCALE_SPREAD = 0.3  # around 1
# Index scores are a 2-term sum of ReLU'd f32 dot products of scale ~1; another
# engine's summation order moves them by ~1e-6. 1e-4 at the k-th place leaves 100x.
MIN_INDEX_MARGIN = 1e-4


def _config(index_topk: int = TOPK) -> DeepseekV4Config:
    return DeepseekV4Config(
        **{**moe_models.BASE, "max_position_embeddings": 4096},
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        partial_rotary_factor=0.25,  # qk_rope_head_dim 8
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        swiglu_limit=SWIGLU_LIMIT,
        hc_mult=3,
        hc_sinkhorn_iters=20,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=index_topk,
        sliding_window=8,
        layer_types=LAYER_TYPES,
        mlp_layer_types=MLP_LAYER_TYPES,
        compress_rates={"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE},
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        # The config folds these into rope_parameters["compress"] (rope_type yarn,
        # attention_factor 1.0); "main" stays plain rope at rope_theta.
        # max_position_embeddings = factor x original: no transformers warning.
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        num_nextn_predict_layers=0,
    )


SPEC = tiny_models.Spec(NAME, _config, seed=701, config_form="rope_parameters")


def tiny_prompt(tok: Tokenizer) -> tuple[str, list[int]]:
    """The first PROMPT_LEN ids of ppl.txt, as text that encodes back to exactly them."""
    ids = tok.encode(base.PPL_TEXT.read_text(encoding="utf-8")).ids[:PROMPT_LEN]
    text = tok.decode(ids)
    if tok.encode(text).ids != ids:
        raise AssertionError("the prompt's text does not encode back to its ids")
    return text, ids


def _csa_layers(model: torch.nn.Module) -> list[int]:
    layers = model.model.layers
    return [i for i, layer in enumerate(layers) if isinstance(layer.self_attn.compressor, DeepseekV4CSACompressor)]


def _tilt_indexers(model: torch.nn.Module, ids: list[int]) -> None:
    """Per CSA layer, in order (a layer's indexer only changes later layers' inputs):
    add INDEX_TILT * k^ r^T to the rope-free rows of every indexer head's q_b_proj,
    with r^ the mean direction of the indexer's q_residual input and k^ that of the
    rope-free part of its compressed keys, over the prompt."""
    for i in _csa_layers(model):
        indexer = model.model.layers[i].self_attn.compressor.indexer
        got: dict[str, torch.Tensor] = {}
        hooks = [
            indexer.register_forward_hook(lambda mod, args, out: got.update(r=args[1][0])),
            indexer.scorer.register_forward_hook(lambda mod, args, out: got.update(k=args[1][0])),
        ]
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
        for h in hooks:
            h.remove()
        nope = indexer.head_dim - model.config.qk_rope_head_dim
        r = got["r"].mean(0)
        k = got["k"][:, :nope].mean(0)
        tilt = INDEX_TILT * torch.outer(k / k.norm(), r / r.norm())
        with torch.no_grad():
            w = indexer.q_b_proj.weight.view(indexer.num_heads, indexer.head_dim, -1)
            w[:, :nope, :] += tilt


def build(spec: tiny_models.Spec, ids: list[int]) -> torch.nn.Module:
    """moe_models.build (every parameter random, router bias random), then the V4
    constants redrawn, a random tid2eid, the embedding offset and the indexer tilt."""
    model = moe_models.build(spec)
    n_exp, top_k = model.config.n_routed_experts, model.config.num_experts_per_tok

    def draw(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor | None:
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "sinks":
            return SINK_SPREAD * torch.randn(shape, generator=gen)
        if leaf == "position_bias":
            return POSITION_BIAS_SPREAD * torch.randn(shape, generator=gen)
        if leaf in ("base", "hc_base"):
            return HC_BASE_SPREAD * torch.randn(shape, generator=gen)
        if leaf in ("scale", "hc_scale"):
            return 1.0 + HC_SCALE_SPREAD * torch.randn(shape, generator=gen)
        if leaf == "tid2eid":
            # Distinct experts per token: the first top_k of a random permutation.
            return torch.rand(shape[0], n_exp, generator=gen).argsort(dim=-1)[:, :top_k]
        return None

    tiny_models.redraw(model.named_parameters(), spec.seed + 2, draw)
    tiny_models.redraw(model.named_buffers(), spec.seed + 3, draw)
    gen = torch.Generator().manual_seed(spec.seed + 4)
    direction = torch.randn(model.config.hidden_size, generator=gen)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(EMBED_OFFSET * direction / direction.norm())
    _tilt_indexers(model, ids)
    return model.eval()


# ---------------------------------------------------------------- self-checks


def cache_check(model: torch.nn.Module, ids: list[int], greedy_ids: list[int]) -> dict:
    """generate's per-step logits (prefill, then one token at a time through the
    DeepSeek-V4 cache) against full no-cache forwards over prompt + greedy."""
    gen_cfg = model.generation_config
    saved = (gen_cfg.eos_token_id, gen_cfg.do_sample)
    gen_cfg.eos_token_id, gen_cfg.do_sample = None, False
    try:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=len(greedy_ids),
                min_new_tokens=len(greedy_ids),
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
    finally:
        gen_cfg.eos_token_id, gen_cfg.do_sample = saved
    if out.sequences[0, len(ids) :].tolist() != greedy_ids:
        raise AssertionError("generate's tokens are not the reference greedy ids")
    cached = torch.stack([step[0] for step in out.logits]).numpy()
    full = reference_outputs.prompt_logits(model, ids + greedy_ids[:-1])[len(ids) - 1 :]
    if not np.array_equal(cached.argmax(-1), full.argmax(-1)):
        raise AssertionError("cached and full-forward argmax differ")
    diff = np.abs(cached - full).max(axis=-1)
    return {"prefill": float(diff[0]), "incremental": float(diff[1:].max()), "steps": len(greedy_ids)}


def routing(model: torch.nn.Module, ids: list[int]) -> tuple[moe_routing_checks.RoutingStats, int]:
    """Margins of every top-k expert choice (DeepseekV4TopKRouter: choice score
    sqrtsoftplus(logits) + e_score_correction_bias) over `ids`, and the number of
    hash-routed token-layer choices."""
    seen: list[tuple[torch.nn.Module, torch.Tensor]] = []
    routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV4TopKRouter"]
    hooks = [r.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0]))) for r in routers]
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    total = moe_routing_checks.RoutingStats()
    for router, h in seen:
        with torch.no_grad():
            scores = router.score_fn(torch.nn.functional.linear(h.reshape(-1, h.shape[-1]), router.weight))
            choice = scores + router.e_score_correction_bias
            k = router.top_k
            margin = moe_routing_checks._kth_gap(choice, k)
            chosen = moe_routing_checks._selection(choice, k)
            unbiased = moe_routing_checks._selection(scores, k)
        stats = moe_routing_checks.RoutingStats(
            routings=choice.shape[0],
            min_margin=float(margin.min()),
            bias_changed=int((chosen != unbiased).any(dim=-1).sum()),
        )
        total.add(stats, margin)
    if total.min_margin < moe_routing_checks.MIN_ROUTING_MARGIN:
        raise AssertionError(f"an expert choice is decided by {total.min_margin:.3g}; pick another seed")
    if total.bias_changed == 0:
        raise AssertionError("e_score_correction_bias changes no expert choice")
    hashed = sum(len(ids) for t in model.config.mlp_layer_types if t == "hash_moe")
    return total, hashed


def clamp_counts(model: torch.nn.Module, ids: list[int]) -> list[dict]:
    """Per MoE layer, over a no-cache forward of `ids`: how many routed (one row per
    token and chosen expert) and shared-expert gate / up pre-activations the SwiGLU
    clamp changed (gate > limit; |up| > limit)."""
    counts = []
    restore = []
    hooks = []
    for layer in model.model.layers:
        c = {"routed_rows": 0, "routed_gate": 0, "routed_up": 0, "shared_rows": 0, "shared_gate": 0, "shared_up": 0}
        counts.append(c)
        experts = layer.mlp.experts
        limit = experts.limit

        def counted(gate_up, c=c, limit=limit, original=experts._apply_gate):
            gate, up = gate_up.chunk(2, dim=-1)
            c["routed_rows"] += gate.shape[0]
            c["routed_gate"] += int((gate > limit).sum())
            c["routed_up"] += int((up.abs() > limit).sum())
            return original(gate_up)

        experts._apply_gate = counted
        restore.append(experts)
        shared = layer.mlp.shared_experts

        def gate_hook(mod, args, out, c=c, limit=shared.limit):
            c["shared_rows"] += out.reshape(-1, out.shape[-1]).shape[0]
            c["shared_gate"] += int((out > limit).sum())

        def up_hook(mod, args, out, c=c, limit=shared.limit):
            c["shared_up"] += int((out.abs() > limit).sum())

        hooks += [shared.gate_proj.register_forward_hook(gate_hook), shared.up_proj.register_forward_hook(up_hook)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        for experts in restore:
            del experts._apply_gate
    width = model.config.moe_intermediate_size
    for i, c in enumerate(counts):
        c["values_per_row"] = width
        if c["routed_gate"] + c["routed_up"] == 0:
            raise AssertionError(f"layer {i}: the routed SwiGLU clamp never fires; lower SWIGLU_LIMIT")
    return counts


def indexer_reference(model: torch.nn.Module, ids: list[int]) -> tuple[dict, dict]:
    """Per CSA layer, from a no-cache forward over `ids`: the entries transformers'
    indexer selected at every position and the k-th/(k+1)-th score gaps; checks the
    recomputed top-k is transformers'. Also counts the ReLU's effect."""
    layers = _csa_layers(model)
    captured: dict[int, dict] = {}
    hooks = []
    for i in layers:
        indexer = model.model.layers[i].self_attn.compressor.indexer
        c = captured.setdefault(i, {})
        hooks.append(indexer.register_forward_hook(lambda mod, args, out, c=c: c.update(sel=out)))
        hooks.append(
            indexer.scorer.register_forward_hook(
                lambda mod, args, out, c=c: c.update(scores=out, q=args[0], k=args[1], h=args[2])
            )
        )
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    k = model.config.index_topk
    rate = model.config.compress_rates["compressed_sparse_attention"]
    out_layers = []
    smallest = float("inf")
    relu = {"terms": 0, "clipped": 0, "selections_changed": 0, "zero_scores": 0}
    for i in layers:
        c = captured[i]
        scorer = model.model.layers[i].self_attn.compressor.indexer.scorer
        scores = c["scores"][0]
        with torch.no_grad():
            dots = torch.einsum("shd,td->sht", c["q"][0].float(), c["k"][0].float())
            weights = scorer.weights_proj(c["h"][0]).float() * scorer.weights_scaling
            linear = (dots * scorer.softmax_scale * weights.unsqueeze(-1)).sum(dim=1)
        selected, margins = [], []
        first_sparse = None
        for t in range(len(ids)):
            visible = (t + 1) // rate
            theirs = sorted(x for x in c["sel"][0, t].tolist() if x >= 0)
            if visible <= k:
                if theirs != list(range(visible)):
                    raise AssertionError(f"layer {i} pos {t}: sees {visible} entries, selected {theirs}")
                selected.append(theirs)
                continue
            if first_sparse is None:
                first_sparse = t
            row = scores[t, :visible]
            top = torch.topk(row, k + 1)
            margin = float(top.values[k - 1] - top.values[k])
            if margin < MIN_INDEX_MARGIN:
                raise AssertionError(
                    f"layer {i} pos {t}: an index top-k is decided by {margin:.3g} < {MIN_INDEX_MARGIN}; "
                    "pick another seed"
                )
            mine = sorted(top.indices[:k].tolist())
            if mine != theirs:
                raise AssertionError(f"layer {i} pos {t}: recomputed top-k {mine} != transformers' {theirs}")
            smallest = min(smallest, margin)
            selected.append(mine)
            margins.append(round(margin, 6))
            relu["terms"] += dots.shape[1] * visible
            relu["clipped"] += int((dots[t, :, :visible] <= 0).sum())
            relu["zero_scores"] += int((row == 0).sum())
            if sorted(torch.topk(linear[t, :visible], k).indices.tolist()) != mine:
                relu["selections_changed"] += 1
        out_layers.append(
            {
                "layer": i,
                "compressed_entries": len(ids) // rate,
                "first_sparse_pos": first_sparse,
                "selected": selected,
                "margins": margins,
            }
        )
    if relu["selections_changed"] == 0:
        raise AssertionError("the indexer's ReLU changes no selection")
    section = {
        "topk": k,
        "compress_rate": rate,
        "positions": len(ids),
        "convention": (
            "position t sees compressed entries 0..(t+1)//compress_rate-1 (entry w covers source tokens "
            "w*rate..w*rate+rate-1, and with the overlap also the rate tokens before); `selected[t]` lists "
            "the entries attended at t, sorted (all visible ones where no more than topk are visible); "
            "`margins` are the k-th minus (k+1)-th index score for t >= first_sparse_pos"
        ),
        "min_margin": round(smallest, 6),
        "layers": out_layers,
    }
    return section, relu


def _twin(model: torch.nn.Module, cfg: DeepseekV4Config) -> torch.nn.Module:
    twin = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    twin.load_state_dict(model.state_dict(), strict=True)
    return twin


def sparse_twin(model: torch.nn.Module, ids: list[int]) -> tuple[float, float, int]:
    """The same weights with index_topk above the number of compressed entries (every
    CSA query attends to every entry it may see): max |logit diff| before and from
    the first position that sees more than TOPK entries."""
    cfg = copy.deepcopy(model.config)
    cfg.index_topk = 1024
    twin = _twin(model, cfg)
    first = (TOPK + 1) * CSA_RATE - 1
    with torch.no_grad():
        a = model(torch.tensor([ids]), use_cache=False).logits[0]
        b = twin(torch.tensor([ids]), use_cache=False).logits[0]
    before = float((a[:first] - b[:first]).abs().max())
    after = float((a[first:] - b[first:]).abs().max())
    if after < 1e-3:
        raise AssertionError("sparse selection changes nothing; pick another seed")
    return before, after, first


def yarn_effect(model: torch.nn.Module, ids: list[int]) -> float:
    """Max |logit diff| against the same weights with plain rope (same theta) on the
    compressed branches: YaRN must matter."""
    cfg = copy.deepcopy(model.config)
    compress = cfg.rope_parameters["compress"]
    cfg.rope_parameters["compress"] = {
        "rope_type": "default",
        "rope_theta": compress["rope_theta"],
        "partial_rotary_factor": compress["partial_rotary_factor"],
    }
    twin = _twin(model, cfg)
    with torch.no_grad():
        diff = float((model(torch.tensor([ids])).logits - twin(torch.tensor([ids])).logits).abs().max())
    if diff < 1e-3:
        raise AssertionError("YaRN on the compress rope changes nothing")
    return diff


def compressed_branch_effect(model: torch.nn.Module, ids: list[int], layer: int) -> tuple[float, float, int]:
    """Max |logit diff| when `layer`'s compressor contributes no entries, before and
    from the first position that sees one (must be float noise, and > 1e-3)."""
    compressor = model.model.layers[layer].self_attn.compressor
    hook = compressor.register_forward_hook(lambda mod, args, out: (out[0][:, :, :0], None))
    try:
        with torch.no_grad():
            without = model(torch.tensor([ids]), use_cache=False).logits[0]
    finally:
        hook.remove()
    with torch.no_grad():
        full = model(torch.tensor([ids]), use_cache=False).logits[0]
    first = compressor.compress_rate - 1
    before = float((full[:first] - without[:first]).abs().max())
    after = float((full[first:] - without[first:]).abs().max())
    if before > 1e-4 or after < 1e-3:
        raise AssertionError(f"layer {layer}: compressed entries change {before} before, {after} after")
    return before, after, first


# ---------------------------------------------------------------- the fixture


def _layer_table(model: torch.nn.Module, clamps: list[dict]) -> list[dict]:
    cfg = model.config
    out = []
    for i, (attn, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)):
        rate = cfg.compress_rates.get(attn)
        out.append(
            {
                "layer": i,
                "attention": attn,
                "compress_rate": rate,
                "rope": "main" if attn == "sliding_attention" else "compress",
                "mlp": mlp,
                "swiglu_clamp_fired": clamps[i]["routed_gate"] + clamps[i]["routed_up"] > 0,
                "swiglu_clamped": clamps[i],
            }
        )
    return out


def make(tok: Tokenizer) -> dict:
    text, ids = tiny_prompt(tok)
    out = base.MODELS / NAME
    model = build(SPEC, ids)
    moe_models.save(model, out, SPEC.config_form, tok)
    reloaded = tiny_models.load(out)
    tiny_models.reload_matches(model, reloaded, torch.tensor([ids]), exact=True)
    for name, buf in model.named_buffers():
        if name.endswith(("tid2eid", "e_score_correction_bias")) and not torch.equal(buf, reloaded.get_buffer(name)):
            raise AssertionError(f"{name} did not survive save/load")
    meta = {
        "model": NAME,
        "source": "tiny random checkpoint, weights stored float32",
        "config_form": SPEC.config_form,
        "prompt_text": text,
    }
    ref = reference_outputs.tiny_reference(reloaded, ids, GREEDY_NEW, meta)
    seq = ref["prompt_ids"] + ref["greedy_ids"][:-1]
    cache = cache_check(reloaded, ids, ref["greedy_ids"])
    stats, hashed = routing(reloaded, seq)
    clamps = clamp_counts(reloaded, ids)
    indexer, relu = indexer_reference(reloaded, ids)
    full_index, _ = indexer_reference(reloaded, seq)
    before, after, first = sparse_twin(reloaded, ids)
    yarn = yarn_effect(reloaded, ids)
    branches = []
    for i, attn in enumerate(reloaded.config.layer_types):
        if attn != "sliding_attention":
            still, moved, start = compressed_branch_effect(reloaded, ids, i)
            branches.append(f"layer {i} ({attn}) by {moved:.3g} from position {start} ({still:.2g} before)")
    rope = reloaded.config.rope_parameters
    emb = reloaded.model.rotary_emb
    routed = sum(c["routed_gate"] + c["routed_up"] for c in clamps)
    routed_all = sum(2 * c["routed_rows"] * c["values_per_row"] for c in clamps)
    shared = sum(c["shared_gate"] + c["shared_up"] for c in clamps)
    shared_all = sum(2 * c["shared_rows"] * c["values_per_row"] for c in clamps)
    notes = [
        f"layer types {reloaded.config.layer_types}, mlp {reloaded.config.mlp_layer_types}, "
        f"compress_rates {dict(reloaded.config.compress_rates)}, sliding_window {reloaded.config.sliding_window}, "
        f"hc_mult {reloaded.config.hc_mult}",
        f"rope_parameters (as transformers holds them) {rope}",
        f"inv_freq main {[float(f'{x:.6g}') for x in emb.main_inv_freq.tolist()]}, compress "
        f"{[float(f'{x:.6g}') for x in emb.compress_inv_freq.tolist()]}; cos/sin factor "
        f"{emb.compress_attention_scaling:g}",
        f"cached generate vs full no-cache forward over prompt + greedy: same argmax at all {cache['steps']} "
        f"steps; max |logit diff| {cache['prefill']:.3g} at the prefill step, {cache['incremental']:.3g} over "
        "the incremental steps",
        f"index_topk {TOPK}: CSA positions >= {first} see more than {TOPK} compressed entries; against the same "
        f"weights with index_topk 1024: max |logit diff| {before:.3g} before, {after:.3g} from position {first}",
        "dropping a layer's compressed entries moves the logits: " + "; ".join(branches),
        f"plain rope instead of YaRN on the compressed branches moves the logits by {yarn:.3g}",
        f"index top-k margins: min {indexer['min_margin']} over the prompt, {full_index['min_margin']} over "
        "prompt + greedy",
        f"indexer ReLU (prompt, sparse positions): clips {relu['clipped']} of {relu['terms']} head-entry dot "
        f"products, {relu['zero_scores']} index scores exactly 0, changes {relu['selections_changed']} top-k "
        "selections",
        f"routing over prompt + greedy tokens: {stats.routings} top-k token-layer expert choices, smallest "
        f"winning margin {stats.min_margin:.3g} (sqrtsoftplus score + e_score_correction_bias); the bias changes "
        f"{stats.bias_changed} of them; {hashed} hash-routed token-layer choices (tid2eid, no margin)",
        f"SwiGLU clamp (limit {SWIGLU_LIMIT}, prompt forward): routed experts {routed} of {routed_all} gate/up "
        f"values ({100 * routed / routed_all:.1f}%), shared experts {shared} of {shared_all} "
        f"({100 * shared / shared_all:.1f}%); per layer in `layers`",
        f"shaping: embeddings share a direction of norm {EMBED_OFFSET}; indexer q_b_proj tilted by {INDEX_TILT} "
        "(see make_v4_fixtures.py)",
    ]
    margins = [round(m, 6) for m in stats.per_position[: len(ids)]]
    final = {}
    for key, value in ref.items():
        if key == "prompt_ids":
            final["notes"] = notes
        final[key] = value
        if key == "greedy_min_margin":
            final["routing_margins"] = margins
    final["layers"] = _layer_table(reloaded, clamps)
    final["indexer"] = indexer
    fixture_json.write_json(out / "reference.json", final)
    print(f"{NAME}: ppl {ref['ppl']:.3f} greedy {ref['greedy_ids']} margin {ref['greedy_min_margin']}")
    for n in notes:
        print(f"  {n}")
    return final


# ---------------------------------------------------------------- the GGUF


def published_copy(src: Path, dst: Path) -> Path:
    """The fixture in DeepSeek's published checkpoint layout, which is all that
    llama.cpp's DeepseekV4Model reads: tensor names without transformers' `model.`
    prefix, `embed.weight`, `norm.weight`, `hc_head_{fn,base,scale}` and
    `layers.N.attn.kv_norm.weight` (transformers' reverse mapping writes
    `attn.norm`); and the config keys it takes from the published config.json
    (`compress_ratios` per layer, `num_hash_layers`, top-level `rope_scaling` for
    the compressed layers' YaRN; `qk_rope_head_dim` is already there). transformers'
    own keys stay; the converter does not read them for these. Values unchanged."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    rates = cfg["compress_rates"]
    cfg["compress_ratios"] = [0 if t == "sliding_attention" else rates[t] for t in cfg["layer_types"]]
    n_hash = cfg["mlp_layer_types"].count("hash_moe")
    if cfg["mlp_layer_types"][:n_hash] != ["hash_moe"] * n_hash:
        raise AssertionError("DeepSeek's layout puts the hash-routed layers first")
    cfg["num_hash_layers"] = n_hash
    yarn = cfg["rope_parameters"]["compress"]
    cfg["rope_scaling"] = {
        "type": yarn["rope_type"],
        "factor": yarn["factor"],
        "original_max_position_embeddings": yarn["original_max_position_embeddings"],
        "beta_fast": yarn["beta_fast"],
        "beta_slow": yarn["beta_slow"],
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    root = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    renamed = {}
    for name, value in load_file(str(src / "model.safetensors")).items():
        if name in root:
            name = root[name]
        elif name.startswith("model.hc_head.hc_"):
            name = "hc_head_" + name.removeprefix("model.hc_head.hc_")
        elif name.startswith("model.layers."):
            name = name.removeprefix("model.")
            if name.endswith(".attn.norm.weight"):
                name = name.removesuffix(".attn.norm.weight") + ".attn.kv_norm.weight"
        elif name != "head.weight":
            raise AssertionError(f"unexpected tensor {name}")
        renamed[name] = value
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def make_gguf(ref: dict, converter: Path) -> None:
    """gguf/deepseek-v4.F32.gguf through llama.cpp's converter (in a child process,
    see _llama_cpp_child), checked tensor by tensor; its reference is `ref`."""
    src = base.MODELS / NAME
    moe.GGUF_DIR.mkdir(parents=True, exist_ok=True)
    path = moe.GGUF_DIR / f"{NAME}.F32.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        published = published_copy(src, Path(tmp) / NAME)
        cmd = [sys.executable, str(Path(__file__).resolve()), CHILD_FLAG, "--check-against", str(src)]
        cmd += ["--converter", str(converter), str(published), "--outtype", "f32", "--outfile", str(path)]
        cmd += ["--model-name", NAME]
        run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"converter failed on {NAME}:\n{run.stdout}\n{run.stderr}")
    marks = [line for line in run.stdout.splitlines() if line.startswith(CHECK_MARK)]
    if len(marks) != 1:
        raise RuntimeError(f"no GGUF check from the converter process:\n{run.stdout}\n{run.stderr}")
    check = json.loads(marks[0].removeprefix(CHECK_MARK))
    types = ", ".join(f"{n} {t}" for t, n in sorted(check["types"].items()))
    note = (
        f"GGUF: llama.cpp's DeepseekV4Model conversion (--outtype f32) of this checkpoint in DeepSeek's published "
        f"layout; routed experts stacked as F32 [n_experts, rows, cols] where the published FP4 experts would be "
        f"repacked to MXFP4 (make_v4_fixtures.py); {check['tensors']} tensors ({types}), each bit-identical to "
        f"model.safetensors' ({check['expert_matrices']} expert matrices in {check['expert_stacks']} stacks, "
        "tid2eid int64 as I32)"
    )
    gref = dict(ref)
    gref["model"] = f"{NAME}.F32"
    gref["source"] = (
        f"{NAME} converted by llama.cpp's convert_hf_to_gguf.py --outtype f32 (architecture deepseek4): the same "
        "float32 weights, so transformers' outputs of the safetensors checkpoint (this file's content is "
        f"{NAME}/reference.json's)"
    )
    gref["notes"] = [note, *ref["notes"]]
    gref["gguf_file"] = path.name
    # llama.cpp's deepseek4 loader accepts only compress ratios 0, 4 and 128
    # and its graph asserts 4 mHC streams; this fixture has HCA 8 and 3.
    gref["llama_cpp_skip"] = "llama.cpp's deepseek4 runs only HCA ratio 128 and hc_mult 4 (this fixture: 8 and 3)"
    fixture_json.write_json(moe.GGUF_DIR / f"{NAME}.F32.reference.json", gref)
    print(f"{path.name}: {path.stat().st_size} bytes; {note}")
    print(f"  metadata ({len(check['metadata'])} keys, read with {check['gguf_py']}): {', '.join(check['metadata'])}")


def converter_arg(doc: str | None) -> Path | None:
    """The command line's --converter PATH (or $LLAMA_CPP_CONVERTER), resolved;
    None without one. Also sets up determinism and quiet logging for a fixture run."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--converter", type=Path, default=os.environ.get("LLAMA_CPP_CONVERTER") or None)
    args = ap.parse_args()
    if args.converter is not None and not args.converter.is_file():
        sys.exit(f"no converter at {args.converter}")
    base.setup_determinism()
    hf_logging.set_verbosity_error()
    return None if args.converter is None else args.converter.resolve()


def main() -> None:
    converter = converter_arg(__doc__)
    ref = make(moe.tokenizer())
    if converter is not None:
        make_gguf(ref, converter)


if __name__ == "__main__":
    main()
