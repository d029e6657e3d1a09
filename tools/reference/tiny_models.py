"""Tiny random-weight checkpoints, one per architecture switch kvant supports.

Every model is hidden 64, head_dim 16, intermediate 128, vocab 320, 256 positions,
2 layers (3 for Gemma 3 so a global layer sits between two local ones). Weights
are drawn from a seeded torch.Generator, with a spread large enough that logits
are far from zero and greedy continuations vary. Norm weights and biases are
random too (not the library's ones/zeros), so a loader that drops or misplaces
one of them changes the output.

config.json comes in two spellings, and the fixtures cover both:
  * "rope_parameters": what transformers 5 writes (`rope_parameters` holds
    rope_theta and the scaling fields; Gemma 3 nests one dict per layer type);
  * "classic": what most checkpoints in the wild carry (`rope_theta` plus
    `rope_scaling`, `torch_dtype`, and for Gemma 3 `rope_local_base_freq` and
    `sliding_window_pattern` with no `layer_types`).
The classic files are rewritten after saving; `reload_matches` proves that
transformers reads both spellings into the same model.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

import tiny_tokenizer

# What every tiny fixture shares, dense or MoE (moe_models.BASE starts from it too).
SHARED = dict(
    hidden_size=64,
    vocab_size=tiny_tokenizer.VOCAB_SIZE,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=tiny_tokenizer.BOS_ID,
    eos_token_id=tiny_tokenizer.EOS_ID,
    pad_token_id=tiny_tokenizer.PAD_ID,
    initializer_range=0.15,
)
COMMON = dict(SHARED, head_dim=16, intermediate_size=128, num_hidden_layers=2)
# The attention every dense fixture has unless its config says otherwise: 4 heads
# over 2 KV heads, untied embeddings.
GQA = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)

# Spread of the random norm weights around their neutral value (1, or 0 for Gemma's 1+w).
NORM_SPREAD = 0.1
# Spread of the random q/k/v biases (Qwen2): big enough to move attention visibly.
BIAS_SPREAD = 0.2


@dataclass(frozen=True)
class Spec:
    """One fixture model: how to build its config and how to store it."""

    name: str
    make_config: Callable[[], PretrainedConfig]
    seed: int
    config_form: str  # "classic" or "rope_parameters"
    # Gemma's RMSNorm scales by (1 + w), so its neutral weight is 0, not 1.
    norm_center: float = 1.0
    # Spread of the embedding table when it differs from initializer_range (see Gemma 3).
    embed_std: float | None = None
    notes: list[str] = field(default_factory=list)


def config(cls: type[PretrainedConfig], **switches) -> PretrainedConfig:
    """`cls` with COMMON sizes and GQA attention; `switches` add to or override them."""
    return cls(**{**COMMON, **GQA, **switches})


def plain_rope(theta: float) -> dict:
    """Unscaled rope at base `theta`."""
    return {"rope_type": "default", "rope_theta": theta}


def llama3_rope(factor: float, original: int) -> dict:
    """llama3 rope scaling (theta 10000, low/high frequency factors 1 and 4)."""
    return {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }


def yarn_rope(factor: float, original: int, **fields) -> dict:
    """YaRN rope scaling (theta 10000); `fields` adds its optional parameters."""
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": factor,
        "original_max_position_embeddings": original,
        **fields,
    }


def _llama_gqa() -> PretrainedConfig:
    # original_max_position_embeddings 64 puts the 8 rope frequencies of a
    # 16-wide head into all three llama3 bands (kept, smoothed, divided).
    return config(LlamaConfig, attention_bias=False, rope_parameters=llama3_rope(8.0, 64))


def _llama_mqa_tied() -> PretrainedConfig:
    return config(
        LlamaConfig,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        attention_bias=False,
        rope_parameters=plain_rope(100000.0),
    )


def _mistral_swa() -> PretrainedConfig:
    return config(MistralConfig, sliding_window=8, rope_parameters=plain_rope(10000.0))


def _qwen2_bias() -> PretrainedConfig:
    return config(Qwen2Config, use_sliding_window=False, rope_parameters=plain_rope(1000000.0))


def _qwen3_qknorm() -> PretrainedConfig:
    # 8 heads x 16 = 128 != hidden 64: q_proj is [128, 64] and o_proj [64, 128].
    return config(Qwen3Config, num_attention_heads=8, attention_bias=False, rope_parameters=plain_rope(1000000.0))


def _gemma3_text() -> PretrainedConfig:
    return config(
        Gemma3TextConfig,
        num_hidden_layers=3,
        tie_word_embeddings=True,
        sliding_window=8,
        # Same as sliding_window_pattern 2: local, global, local.
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        # Not head_dim, so a loader that scales by 1/sqrt(head_dim) is caught.
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"full_attention": plain_rope(1000000.0), "sliding_attention": plain_rope(10000.0)},
    )


# Seeds were picked (from a small scan) so each greedy continuation is varied:
# tied embeddings make a random model echo its last token. Gemma scales its
# embeddings by sqrt(hidden) = 8, so its table is drawn 5x narrower to keep the
# token identity from swamping the layers' contribution.
SPECS = [
    Spec("llama-gqa", _llama_gqa, seed=101, config_form="classic"),
    Spec("llama-mqa-tied", _llama_mqa_tied, seed=207, config_form="rope_parameters"),
    Spec("mistral-swa", _mistral_swa, seed=103, config_form="classic"),
    Spec("qwen2-bias", _qwen2_bias, seed=104, config_form="classic"),
    Spec("qwen3-qknorm", _qwen3_qknorm, seed=105, config_form="classic"),
    Spec("gemma3-text", _gemma3_text, seed=305, config_form="classic", norm_center=0.0, embed_std=0.03),
]

# Low-precision copies: (name, base spec, dtype, config form). Their weights are the
# base model's rounded to the dtype; references upcast those stored weights to f32.
LOW_PRECISION = [
    ("llama-gqa-bf16", "llama-gqa", torch.bfloat16, "rope_parameters"),
    ("llama-mqa-tied-f16", "llama-mqa-tied", torch.float16, "rope_parameters"),
]


def redraw(
    named: Iterable[tuple[str, torch.Tensor]],
    seed: int,
    draw: Callable[[str, torch.Size, torch.Generator], torch.Tensor | None],
) -> None:
    """Overwrite each of `named`, in name order, with draw(name, shape, gen) from a
    generator seeded with `seed`; a None draw leaves that tensor as it is (and
    must not touch `gen`, so that the others' draws do not move)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() lists a tied weight once; sorting fixes the draw order.
        for name, t in sorted(named, key=lambda kv: kv[0]):
            val = draw(name, t.shape, gen)
            if val is not None:
                t.copy_(val)


def build(spec: Spec) -> torch.nn.Module:
    """The f32 model for `spec` with seeded random weights, in eval mode, eager attention."""
    config = spec.make_config()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    std = config.initializer_range

    def draw(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return spec.norm_center + NORM_SPREAD * torch.randn(shape, generator=gen)
        if name.endswith("embed_tokens.weight") and spec.embed_std is not None:
            return spec.embed_std * torch.randn(shape, generator=gen)
        if name.endswith(".bias"):
            return BIAS_SPREAD * torch.randn(shape, generator=gen)
        return std * torch.randn(shape, generator=gen)

    redraw(model.named_parameters(), spec.seed, draw)
    return model.eval()


def _classic_config(cfg: dict) -> dict:
    """Rewrite a transformers-5 config.json dict into the classic key spelling."""
    out = copy.deepcopy(cfg)
    rope = out.pop("rope_parameters")
    if "full_attention" in rope:  # Gemma 3: one dict per layer type
        full, local = rope["full_attention"], rope["sliding_attention"]
        if full.get("rope_type", "default") != "default" or local.get("rope_type", "default") != "default":
            raise ValueError("classic Gemma 3 form only carries plain rope")
        out["rope_theta"] = full["rope_theta"]
        out["rope_local_base_freq"] = local["rope_theta"]
        out["rope_scaling"] = None
        layer_types = out.pop("layer_types")
        out.pop("_sliding_window_pattern", None)
        pattern = layer_types.index("full_attention") + 1
        derived = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(len(layer_types))]
        if derived != layer_types:
            raise ValueError("layer_types cannot be expressed as sliding_window_pattern")
        out["sliding_window_pattern"] = pattern
    else:
        out["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        # Classic layer_types is absent for uniform full attention.
        if "layer_types" in out and all(t == "full_attention" for t in out["layer_types"]):
            out.pop("layer_types")
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    return dict(sorted(out.items()))


def save(model: torch.nn.Module, out_dir: Path, dtype: torch.dtype, config_form: str, tok) -> None:
    """save_pretrained (safetensors) in `dtype`, the tokenizer, and the config spelling."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stored = copy.deepcopy(model).to(dtype)
    stored.generation_config.do_sample = False
    stored.save_pretrained(out_dir, safe_serialization=True)
    tiny_tokenizer.save(tok, out_dir)
    if config_form == "classic":
        path = out_dir / "config.json"
        cfg = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps(_classic_config(cfg), indent=2) + "\n", encoding="utf-8")
    elif config_form != "rope_parameters":
        raise ValueError(f"unknown config form {config_form}")


def load(out_dir: Path) -> torch.nn.Module:
    """Load a fixture dir the way a user would, upcast to f32, eager attention."""
    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()


def reload_matches(original: torch.nn.Module, reloaded: torch.nn.Module, ids: torch.Tensor, exact: bool) -> float:
    """Max |logit difference| between two models on `ids`; raises if it is not ~0.

    `exact`: the reloaded weights are bit-identical (f32 save), so any difference
    means transformers read the config differently.
    """
    with torch.no_grad():
        a = original(ids).logits
        b = reloaded(ids).logits
    diff = float((a - b).abs().max())
    if exact and diff != 0.0:
        raise AssertionError(f"reloaded model differs by {diff}: config spelling not equivalent")
    return diff
