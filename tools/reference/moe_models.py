"""Tiny random-weight mixture-of-experts and MLA checkpoints (Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V2, DeepSeek-V3 / GigaChat3).

Same recipe as tiny_models.py (hidden 64, vocab 320, 256 positions, seeded random
weights including norms and biases, float32), with every MoE switch these
architectures have:
  * routers: softmax top-k with and without renormalisation (Mixtral always
    renormalises, Qwen by `norm_topk_prob`); DeepSeek-V2 softmax "greedy" top-k,
    weights neither renormalised nor scaled (routed_scaling_factor 1); DeepSeek-V3
    sigmoid scores plus `e_score_correction_bias` for the choice only, group-limited
    (n_group / topk_group), renormalised, times routed_scaling_factor 2.5;
  * shared experts (Qwen2-MoE's with its sigmoid `shared_expert_gate`, DeepSeek's
    `n_shared_experts` × moe_intermediate_size wide, ungated) and dense layers
    inside a MoE model (Qwen2-MoE `mlp_only_layers`, DeepSeek `first_k_dense_replace`);
  * MLA attention with and without a q LoRA, YaRN rope with the mscale² softmax
    correction, interleaved rope pairs.
Every expert, dense and shared intermediate size is a multiple of 32.

transformers 5 keeps experts fused in memory (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) but save_pretrained writes them per expert with the
published names (`mlp.experts.{e}.{gate,up,down}_proj.weight`, Mixtral
`block_sparse_moe.experts.{e}.w1/w2/w3.weight`), which is what the fixtures hold.

`e_score_correction_bias` is a buffer that transformers initialises to zeros; here
it is drawn at random (BIAS_SCORE_SPREAD) so that it changes some expert choices.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

import tiny_models
import tiny_tokenizer

BASE = dict(tiny_models.SHARED, tie_word_embeddings=False)

# Spread of the random DeepSeek-V3 `e_score_correction_bias` (added to sigmoid
# scores in (0, 1) for the choice only): large enough to change some choices.
BIAS_SCORE_SPREAD = 0.1

def deepseek_yarn(factor: float, original: int, mscale_all_dim: float) -> dict:
    """YaRN as published DeepSeek configs spell it: beta_fast 32, beta_slow 1, mscale 1."""
    return tiny_models.yarn_rope(
        factor, original, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=mscale_all_dim
    )


def _mixtral() -> PretrainedConfig:
    # tiny_models' dense shape (2 layers, 4 heads over 2 KV heads of 16) with 4 experts.
    return tiny_models.config(
        MixtralConfig,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        rope_parameters=tiny_models.plain_rope(1000000.0),
    )


def _qwen2_moe(mlp_only_layers: list[int]) -> PretrainedConfig:
    # 4 heads x 16 = hidden; q/k/v bias (qkv_bias); layer 0 dense when mlp_only_layers = [0].
    return Qwen2MoeConfig(
        **BASE,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        mlp_only_layers=mlp_only_layers,
        decoder_sparse_step=1,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        norm_topk_prob=False,
        qkv_bias=True,
        use_sliding_window=False,
        rope_parameters=tiny_models.plain_rope(1000000.0),
    )


def _qwen3_moe() -> PretrainedConfig:
    # qwen3-qknorm's shape: 8 heads x 16 = 128 != hidden 64; every layer MoE, so
    # intermediate_size is unused.
    return tiny_models.config(
        Qwen3MoeConfig,
        num_attention_heads=8,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        attention_bias=False,
        use_sliding_window=False,
        rope_parameters=tiny_models.plain_rope(1000000.0),
    )


# MLA shapes shared by the DeepSeek fixtures: 4 heads, q/k head 16 nope + 16 rope,
# v head 32, kv latent 32.
MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=96,
)


# DeepSeek-V3's routing and attention switches at toy size, where every DeepSeek
# fixture starts: q LoRA, one dense layer first, one shared expert, 4 expert
# groups of which 2 are chosen, weights renormalised and scaled by 2.5.
DEEPSEEK_V3 = dict(
    q_lora_rank=32,
    first_k_dense_replace=1,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)


def deepseek(cls: type[PretrainedConfig], **switches) -> PretrainedConfig:
    """`cls` with BASE, MLA and DEEPSEEK_V3; `switches` add to or override them."""
    return cls(**{**BASE, **MLA, **DEEPSEEK_V3, **switches})


def _deepseek_v2() -> PretrainedConfig:
    # DeepSeek-V2-Lite's switches: plain q_proj, softmax "greedy" top-k, 2 shared experts,
    # weights not renormalised (transformers' V2 router never renormalises) nor scaled.
    return deepseek(
        DeepseekV2Config,
        num_hidden_layers=3,
        q_lora_rank=None,
        n_shared_experts=2,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        # Published V2 configs carry it; transformers ignores it (V2 is always softmax).
        scoring_func="softmax",
        rope_parameters=tiny_models.plain_rope(10000.0),
    )


def _deepseek_v3() -> PretrainedConfig:
    # GigaChat3 / DeepSeek-V3 switches at toy size, with one MTP module.
    return deepseek(
        DeepseekV3Config,
        num_hidden_layers=4,
        rope_interleave=True,
        num_nextn_predict_layers=1,
        # Published V3 configs carry these; transformers' V3 router always does this.
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        # DeepSeek-V3 YaRN scaled down: factor 4 over 64 original positions
        # (max_position_embeddings 256 = 4 x 64, so transformers' consistency check
        # is quiet). beta_fast 32 / beta_slow 1 put the 8 rope frequencies of a
        # 16-wide rope head into all three YaRN bands (kept, blended, divided by the
        # factor); mscale = mscale_all_dim = 1 leaves cos/sin unscaled and
        # multiplies the softmax scale by (0.1 ln 4 + 1)^2.
        rope_parameters=deepseek_yarn(4.0, 64, 1.0),
    )


def _deepseek_v3_qnull() -> PretrainedConfig:
    # No q LoRA, one expert group, plain rope, no MTP, every layer MoE; config.json
    # as transformers 5 writes it (no scoring_func / topk_method: model_type decides).
    return deepseek(
        DeepseekV3Config,
        num_hidden_layers=3,
        q_lora_rank=None,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        rope_interleave=True,
        num_nextn_predict_layers=0,
        rope_parameters=tiny_models.plain_rope(10000.0),
    )


# Config spellings: "classic" as tiny_models (rope_theta + rope_scaling, torch_dtype);
# "deepseek" is the classic spelling of published DeepSeek config.json files:
# rope_scaling {"type": "yarn", ...} (not "rope_type") and none of the keys
# transformers derives (head_dim, qk_head_dim).
# Seeds: picked from a small scan so greedy continuations vary, every greedy step
# has a top-1/top-2 gap >= 1e-3 and every expert choice a gap >= MIN_ROUTING_MARGIN.
SPECS = [
    tiny_models.Spec("mixtral-moe", _mixtral, seed=401, config_form="classic"),
    tiny_models.Spec("qwen2-moe", lambda: _qwen2_moe([0]), seed=442, config_form="classic"),
    tiny_models.Spec("qwen3-moe", _qwen3_moe, seed=433, config_form="rope_parameters"),
    tiny_models.Spec("deepseek-v2", _deepseek_v2, seed=434, config_form="deepseek"),
    tiny_models.Spec("deepseek-v3", _deepseek_v3, seed=455, config_form="deepseek"),
    tiny_models.Spec("deepseek-v3-qnull", _deepseek_v3_qnull, seed=436, config_form="rope_parameters"),
]

# llama.cpp's qwen2moe graph has no dense layers (every layer routes), so the
# qwen2moe GGUF is made from this sibling of `qwen2-moe`: same seed and sizes,
# every layer MoE. Its HF checkpoint is only a temporary input to the converter.
QWEN2_MOE_SPARSE = tiny_models.Spec("qwen2-moe-sparse", lambda: _qwen2_moe([]), seed=442, config_form="classic")

# The MTP module of deepseek-v3 is checkpoint layer `num_hidden_layers`; its own
# tensors (besides a decoder layer) are drawn from this seed offset.
MTP_SEED_OFFSET = 1000


def build(spec: tiny_models.Spec) -> torch.nn.Module:
    """tiny_models.build, plus a random `e_score_correction_bias` where the router has one."""
    model = tiny_models.build(spec)

    def draw(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor | None:
        if name.endswith("e_score_correction_bias"):
            return BIAS_SCORE_SPREAD * torch.randn(shape, generator=gen)
        return None

    tiny_models.redraw(model.named_buffers(), spec.seed + 1, draw)
    return model


def deepseek_classic_config(cfg: dict) -> dict:
    """A transformers-5 DeepSeek config.json dict in the published spelling."""
    out = tiny_models._classic_config(cfg)
    scaling = out.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling)
        scaling["type"] = scaling.pop("rope_type")
        out["rope_scaling"] = dict(sorted(scaling.items()))
    for derived in ("head_dim", "qk_head_dim"):
        out.pop(derived, None)
    return out


def save(model: torch.nn.Module, out_dir: Path, config_form: str, tok) -> None:
    """tiny_models.save in float32, with the DeepSeek spelling as a third form."""
    if config_form != "deepseek":
        tiny_models.save(model, out_dir, torch.float32, config_form, tok)
        return
    tiny_models.save(model, out_dir, torch.float32, "rope_parameters", tok)
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(deepseek_classic_config(cfg), indent=2) + "\n", encoding="utf-8")


def with_layers(config: PretrainedConfig, n_layers: int) -> PretrainedConfig:
    """A copy of `config` with another layer count (the MTP module is layer n)."""
    out = copy.deepcopy(config)
    out.num_hidden_layers = n_layers
    return out
