#!/usr/bin/env python3
"""A Qwen3.5-shaped hybrid linear-attention model with random weights, for benchmarks.

kvant is measured against llama.cpp (GGUF arch `qwen35`) on a model with
Qwen3.5-0.8B's layer shapes: hidden 1024; Gated DeltaNet layers with 16 key
and 16 value heads of 128 and a 4-tap causal conv; every fourth layer gated
full attention with 8 query and 2 KV heads of 256, a quarter of each head
rotated; a SwiGLU FFN of 3584; tied embeddings. It has --layers layers (12 by
default, 9 linear and 3 full; the published 0.8B has 24) so that the Q8_0 file
stays a few hundred MB. The weights are random (transformers' own
initialisation: N(0, 0.02) matrices, its A_log / dt_bias draws, zero-centred
norms at 0), so the text is gibberish; every tensor has the real model's
shape, layout and dtype, so a forward pass costs what the real one does.

The tokenizer files come from --tokenizer-from (the DeepSeek-shaped bench
model's: SmolLM2's real 49152-token vocabulary, which llama.cpp's converter
recognises; see make_moe_bench_model.py).

  $REFPY tools/bench/make_hybrid_bench_model.py --tokenizer-from $MODELS/dsv3-bench-hf \\
      --out $MODELS/qwen35-bench-hf

writes config.json, model.safetensors (bf16) and the tokenizer files into --out
and prints the parameter counts. `--full-attention-interval 0` makes every
layer linear: a twin whose decode cost cannot grow with the context (what
the full-attention layers add at depth shows against it). Convert with llama.cpp's converter (no MTP
layers here) and quantize there:

  python convert_hf_to_gguf.py $MODELS/qwen35-bench-hf --no-mtp --outtype q8_0 \\
      --outfile $MODELS/qwen35-bench.Q8_0.gguf
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5 import Qwen3_5TextConfig

STD = 0.02
SEED = 0x71776E35
VOCAB_SIZE = 49152
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]


def bench_config(layers: int, full_every: int) -> Qwen3_5TextConfig:
    types = [
        "full_attention" if full_every and (i + 1) % full_every == 0 else "linear_attention" for i in range(layers)
    ]
    return Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=layers,
        layer_types=types,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=True,
        initializer_range=STD,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer-from", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument(
        "--full-attention-interval",
        type=int,
        default=4,
        help="every N-th layer is full attention (0: none, a linear-only twin whose decode cost is flat in context)",
    )
    a = p.parse_args()
    torch.manual_seed(a.seed)
    cfg = bench_config(a.layers, a.full_attention_interval)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    model = Qwen3_5ForCausalLM(cfg).eval()
    a.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(a.out)
    for f in TOKENIZER_FILES:
        if (a.tokenizer_from / f).exists():
            shutil.copy(a.tokenizer_from / f, a.out / f)
    total = sum(t.numel() for t in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    linear = sum(t.numel() for n, t in model.named_parameters() if ".linear_attn." in n)
    print(f"parameters: {total / 1e6:.1f} M ({embed / 1e6:.1f} M embedding, tied; {linear / 1e6:.1f} M linear attention)")


if __name__ == "__main__":
    main()
