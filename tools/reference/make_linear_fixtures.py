#!/usr/bin/env python3
"""Write the hybrid linear-attention fixtures under tests/fixtures/models/.

  qwen3-next/      transformers' Qwen3NextConfig: Gated DeltaNet layers (the
                   interleaved in_proj_qkvz / in_proj_ba layout) beside gated
                   full attention (output gate, q/k norm, partial rope), MoE
                   with a gated shared expert in every layer, zero-centred norms
  qwen3-5/         Qwen3_5TextConfig: the same layers with Qwen3.5's separate
                   in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, dense FFN
  qwen3-5-moe/     Qwen3_5MoeTextConfig: Qwen3.5 with MoE
  kimi-linear/     KimiLinearConfig: Kimi Delta Attention layers (separate
                   q/k/v projections and convs, a low-rank forget gate per key
                   channel, a low-rank sigmoid output gate) beside latent
                   attention without positions (NoPE MLA, plain q projection),
                   a dense first layer, then DeepSeek-V3-style MoE (sigmoid
                   scores with a selection bias, a shared expert; one expert
                   group, as Kimi-Linear-48B and as llama.cpp's converter
                   assumes: it writes no group count)

Each holds a tiny random checkpoint (float32) and reference.json (prompt logits,
greedy ids, perplexity) from transformers in float32, plus a `linear` section:
the per-layer delta-rule state after the prompt, which an engine's recurrent
state must reproduce.

Every model has more value heads than key heads (GQA-style sharing), head sizes
that differ between keys and values, and a 4-token causal convolution; layer
types follow the 3:1 pattern of the published models, cut to 4 layers
(linear, linear, full, linear), so that the full-attention layer sits between
linear ones. The decay gates (A_log, dt_bias) are drawn so that decays cover
strong (e^-3) to weak (e^-0.05) forgetting.

With llama.cpp's converter (--converter PATH or $LLAMA_CPP_CONVERTER), each is
also converted to GGUF F32 (gguf/{name}.F32.gguf, architectures qwen3next,
qwen35, qwen35moe with --no-mtp, as these have no MTP layers, and kimi-linear). The
Kimi converter reads the published checkpoints' spelling, so it gets a copy in
that spelling (linear_attn_config, first_k_dense_replace, the dense FFN as
mlp.*; transformers' own save names it block_sparse_moe.*). The converter keeps
every weight's float32 bits but stores −exp(A_log), norm weights plus one (not
the gated norm's), a squeezed conv kernel, Qwen3-Next's in_proj_qkvz split into
attn_qkv and attn_gate, and Qwen3.5's value heads tiled; so transformers'
outputs from the safetensors file are the GGUF file's reference too
(gguf/{name}.F32.reference.json, the same values). The script checks the
transformations it relies on against the written file.

Same determinism, prompt and self-checks as make_moe_fixtures.py (routing
margins for the MoE ones). Run with the reference venv from the repository root:
  .venv/bin/python tools/reference/make_linear_fixtures.py [--converter PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import KimiLinearConfig, Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_5 import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixture_json  # noqa: E402
import make_model_fixtures as base  # noqa: E402
import make_moe_fixtures as moe  # noqa: E402
import moe_models  # noqa: E402
import tiny_models  # noqa: E402

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]

# The linear layers: 2 key heads of 16, 4 value heads of 8 (two per key head).
LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)

# The full-attention layers: 4 heads of 16 over 2 KV heads, a quarter... here half
# of each head rotated (8 of 16 dimensions), as partial_rotary_factor says.
ATTENTION = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)

MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)


def _qwen3_next() -> Qwen3NextConfig:
    return Qwen3NextConfig(
        **moe_models.BASE,
        **LINEAR,
        **ATTENTION,
        **MOE,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _qwen3_5() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        **moe_models.BASE,
        **LINEAR,
        **ATTENTION,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
    )


def _qwen3_5_moe() -> Qwen3_5MoeTextConfig:
    return Qwen3_5MoeTextConfig(
        **moe_models.BASE,
        **LINEAR,
        **ATTENTION,
        **MOE,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
    )


def _kimi_linear() -> KimiLinearConfig:
    # One value head per key head, dk = dv (KDA's shape); NoPE MLA with a
    # rope-sized part of the key that is shared but never rotated.
    return KimiLinearConfig(
        **moe_models.BASE,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        linear_num_heads=4,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
    )


# Zero-centred RMSNorms (weight 0 is the identity: the model scales by 1 + w);
# the gated norm inside the linear layers is a plain weight (centre 1).
SPECS = [
    tiny_models.Spec("qwen3-next", _qwen3_next, seed=602, config_form="rope_parameters", norm_center=0.0),
    tiny_models.Spec("qwen3-5", _qwen3_5, seed=602, config_form="rope_parameters", norm_center=0.0),
    tiny_models.Spec("qwen3-5-moe", _qwen3_5_moe, seed=603, config_form="rope_parameters", norm_center=0.0),
    tiny_models.Spec("kimi-linear", _kimi_linear, seed=604, config_form="rope_parameters"),
]

# Decays exp(g), g = -exp(A_log) * softplus(a + dt_bias): A_log uniform so that
# exp(A_log) spans 0.05..3 (a ~ N(0, small) at these weight scales).
A_LOG_RANGE = (-3.0, 1.1)


def build(spec: tiny_models.Spec) -> torch.nn.Module:
    """moe_models.build, then the gated norms re-centred at 1 and A_log spread out."""
    model = moe_models.build(spec)

    def draw(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor | None:
        if name.endswith("linear_attn.norm.weight"):
            return 1.0 + tiny_models.NORM_SPREAD * torch.randn(shape, generator=gen)
        if name.endswith(("linear_attn.A_log", "self_attn.A_log")):
            lo, hi = A_LOG_RANGE
            return lo + (hi - lo) * torch.rand(shape, generator=gen)
        return None

    tiny_models.redraw(model.named_parameters(), spec.seed + 2, draw)
    return model


def linear_states(model: torch.nn.Module, ids: list[int]) -> list[dict]:
    """Per linear layer, the recurrent state after `ids`: the delta-rule matrices
    [value heads, dk, dv] and the convolution's last inputs [kernel - 1, channels]."""
    from transformers import DynamicCache  # noqa: F401  (the model builds its own cache)

    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    layers = []
    for i, t in enumerate(model.config.layer_types):
        if t != "linear_attention":
            continue
        state = cache.get_recurrent_state(i, state_idx=0)[0]
        conv = cache.get_conv_state(i, state_idx=0)[0]
        kernel = model.config.linear_conv_kernel_dim
        layers.append(
            {
                "layer": i,
                "delta_state": fixture_json.f32_rows(state.reshape(state.shape[0] * state.shape[1], -1).numpy()),
                "conv_tail": fixture_json.f32_rows(conv[:, -(kernel - 1) :].transpose(0, 1).contiguous().numpy()),
            }
        )
    return layers


def make_one(spec: tiny_models.Spec, tok, text: str, ids: list[int]) -> dict:
    out = base.MODELS / spec.name
    model = build(spec)
    moe_models.save(model, out, spec.config_form, tok)
    reloaded, ref = moe.reload_and_reference(model, spec, out, text, ids)
    notes = [f"layer_types {LAYER_TYPES}"]
    if getattr(reloaded.config, "num_experts", 0):
        ref = moe._finish(reloaded, ref, notes)
    else:
        ref = {"notes": notes, **ref}
    ref["linear"] = linear_states(reloaded, ids)
    fixture_json.write_json(out / "reference.json", ref)
    print(f"{spec.name}: ppl {ref['ppl']:.3f} greedy {ref['greedy_ids']} margin {ref['greedy_min_margin']}")
    return ref


GGUF_ARCH = {"qwen3-next": "qwen3next", "qwen3-5": "qwen35", "qwen3-5-moe": "qwen35moe", "kimi-linear": "kimi-linear"}


def published_kimi_copy(src: Path, dst: Path) -> Path:
    """The Kimi fixture in Moonshot's spelling, which llama.cpp's converter reads."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    types = cfg.pop("layer_types")
    cfg.pop("mlp_layer_types")
    cfg["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "num_heads": cfg.pop("linear_num_heads"),
        "head_dim": cfg.pop("linear_head_dim"),
        "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim"),
    }
    cfg["first_k_dense_replace"] = 1
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = load_file(dst / "model.safetensors")
    dense = tuple(f"block_sparse_moe.{p}_proj.weight" for p in ("gate", "up", "down"))
    renamed = {(k.replace("block_sparse_moe.", "mlp.") if k.endswith(dense) else k): v for k, v in tensors.items()}
    save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _tiled(x: np.ndarray, nk: int, r: int, d: int) -> np.ndarray:
    """Rows of value heads grouped by key head (g·r + v) in llama.cpp's tiled order (v·nk + g)."""
    return x.reshape(nk, r, d, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


def check_gguf(path: Path, name: str, model: torch.nn.Module) -> None:
    """The converter's transformations that kvant's loader undoes, on layer 0 (linear) and 2 (full)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    if arch != GGUF_ARCH[name]:
        raise AssertionError(f"{path.name}: architecture {arch}")
    t = {x.name: np.asarray(x.data).reshape([int(n) for n in reversed(x.shape)]) for x in reader.tensors}
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    c = model.config
    # The converter's own arithmetic (torch's float32 exp, which can differ from numpy's by an ulp).
    neg_exp = lambda x: (-torch.exp(torch.from_numpy(x))).numpy()  # noqa: E731
    if name == "kimi-linear":
        # transformers renames these modules when it loads them; the saved names are what kvant reads.
        from safetensors.torch import load_file

        sd = {k: v.numpy() for k, v in load_file(base.MODELS / name / "model.safetensors").items()}
        sa = "model.layers.0.self_attn."
        checks = [
            ("blk.0.ssm_a", neg_exp(sd[sa + "A_log"])),
            ("blk.0.ssm_norm.weight", sd[sa + "o_norm.weight"]),
            ("blk.0.ssm_f_b.weight", sd[sa + "f_b_proj.weight"]),
            ("blk.0.ssm_conv1d_k.weight", sd[sa + "k_conv1d.weight"]),
            ("blk.0.ffn_norm.weight", sd["model.layers.0.post_attention_layernorm.weight"]),
        ]
    else:
        nk, nv, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim
        tiled = name != "qwen3-next"
        la = "model.layers.0.linear_attn."
        want_a = neg_exp(sd[la + "A_log"])
        if tiled:
            want_a = _tiled(want_a, nk, nv // nk, 1)
        checks = [
            ("blk.0.ssm_a", want_a),
            ("blk.2.attn_q_norm.weight", sd["model.layers.2.self_attn.q_norm.weight"] + 1),
            ("blk.0.ssm_norm.weight", sd[la + "norm.weight"]),
            ("blk.0.post_attention_norm.weight", sd["model.layers.0.post_attention_layernorm.weight"] + 1),
        ]
        if tiled:
            checks.append(("blk.0.ssm_beta.weight", _tiled(sd[la + "in_proj_b.weight"], nk, nv // nk, 1)))
            checks.append(("blk.0.attn_gate.weight", _tiled(sd[la + "in_proj_z.weight"], nk, nv // nk, dv)))
        else:
            checks.append(("blk.0.ssm_ba.weight", sd[la + "in_proj_ba.weight"]))
    for key, want in checks:
        got = t[key].astype(np.float32).reshape(want.shape)
        if not np.array_equal(got, want.astype(np.float32)):
            diff = np.abs(got - want).max() if got.shape == want.shape else "shape"
            raise AssertionError(f"{path.name}: {key} is not what kvant's loader expects ({diff})")


def make_gguf(spec: tiny_models.Spec, ref: dict, converter: Path) -> None:
    import tempfile

    src = base.MODELS / spec.name
    moe.GGUF_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        conv_src = published_kimi_copy(src, Path(tmp) / spec.name) if spec.name == "kimi-linear" else src
        # The Qwen converters would add MTP blocks the fixtures do not have.
        extra = () if spec.name == "kimi-linear" else ("--no-mtp",)
        path = moe.convert(converter, conv_src, spec.name, "F32", extra=extra)
    check_gguf(path, spec.name, tiny_models.load(src))
    gref = {k: v for k, v in ref.items() if k != "linear"}
    gref["model"] = f"{spec.name}.F32"
    gref["source"] = (
        f"{spec.name} converted by llama.cpp's convert_hf_to_gguf.py --outtype f32 --no-mtp "
        f"(architecture {GGUF_ARCH[spec.name]}): the same float32 weights, so transformers' outputs "
        "of the safetensors checkpoint"
    )
    gref["gguf_file"] = path.name
    fixture_json.write_json(moe.GGUF_DIR / f"{spec.name}.F32.reference.json", gref)
    print(f"{path.name}: {path.stat().st_size} bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--converter", type=Path, default=os.environ.get("LLAMA_CPP_CONVERTER"))
    args = ap.parse_args()
    base.setup_determinism()
    hf_logging.set_verbosity_error()
    tok = moe.tokenizer()
    text, ids = base.tiny_prompt(tok)
    for spec in SPECS:
        ref = make_one(spec, tok, text, ids)
        if args.converter and spec.name in GGUF_ARCH:
            make_gguf(spec, ref, args.converter.resolve())


if __name__ == "__main__":
    sys.exit(main())
