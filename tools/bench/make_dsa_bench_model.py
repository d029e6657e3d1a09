#!/usr/bin/env python3
"""DeepSeek-V3.2-shaped benchmark models: the DeepSeek-V3-shaped bench model
(make_moe_bench_model.py) with a DSA indexer in every layer, and its dense twin.

Sparse attention changes what decoding a token costs at long context: dense
latent attention reads every cached latent row of every layer, DSA's indexer
reads one small key per position and attention then reads only the top-k rows.
To measure that, this writes two models with identical weights:

  --out-sparse  DeepseekV32 config: every layer gets an indexer (16 heads of 64,
                rope 32 first, top-k 2048 as DeepSeek-V3.2), seeded random
                `wq_b` [1024, 384], `wk` [64, 1024], `weights_proj` [16, 1024]
                (N(0, 0.02) as every other matrix), `k_norm` weight 1, bias 0
  --out-dense   the source model as is (DeepseekV3 config)

both with `max_position_embeddings` raised to --context (the source stops at
16384; YaRN's factor 40 over 4096 covers 163840), bf16 weights, SmolLM2's
tokenizer. The dense twin links the source's weight file. The indexer has 16
heads for the model's 16 attention heads, in DeepSeek-V3.2's proportion (64
indexer heads for 128), and head size 64 for rope 32 (128 for 64).

  $REFPY tools/bench/make_dsa_bench_model.py --src $MODELS/dsv3-bench-hf \\
      --out-sparse $MODELS/dsv32-bench-hf --out-dense $MODELS/dsv3-bench-long-hf
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

STD = 0.02
SEED = 0x64736133
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, required=True, help="make_moe_bench_model.py's output")
    p.add_argument("--out-sparse", type=Path, required=True)
    p.add_argument("--out-dense", type=Path, required=True)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--index-heads", type=int, default=16)
    p.add_argument("--index-head-dim", type=int, default=64)
    p.add_argument("--context", type=int, default=40960)
    a = p.parse_args()

    cfg = json.loads((a.src / "config.json").read_text())
    cfg["max_position_embeddings"] = a.context
    for out in (a.out_sparse, a.out_dense):
        out.mkdir(parents=True, exist_ok=True)
        for f in TOKENIZER_FILES:
            if (a.src / f).exists():
                shutil.copy(a.src / f, out / f)
    (a.out_dense / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    dense_weights = a.out_dense / "model.safetensors"
    if dense_weights.exists() or dense_weights.is_symlink():
        dense_weights.unlink()
    os.symlink((a.src / "model.safetensors").resolve(), dense_weights)

    sparse = dict(cfg)
    sparse.update(
        model_type="deepseek_v32",
        architectures=["DeepseekV32ForCausalLM"],
        index_n_heads=a.index_heads,
        index_head_dim=a.index_head_dim,
        index_topk=a.topk,
    )
    (a.out_sparse / "config.json").write_text(json.dumps(sparse, indent=2) + "\n")
    tensors = load_file(a.src / "model.safetensors")
    gen = torch.Generator().manual_seed(SEED)
    h, q_lora, n, d = cfg["hidden_size"], cfg["q_lora_rank"], a.index_heads, a.index_head_dim
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.self_attn.indexer."
        for name, shape in [("wq_b", (n * d, q_lora)), ("wk", (d, h)), ("weights_proj", (n, h))]:
            tensors[pre + name + ".weight"] = (torch.randn(shape, generator=gen) * STD).to(torch.bfloat16)
        tensors[pre + "k_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        tensors[pre + "k_norm.bias"] = torch.zeros(d, dtype=torch.bfloat16)
    save_file(tensors, a.out_sparse / "model.safetensors", metadata={"format": "pt"})
    extra = cfg["num_hidden_layers"] * (n * d * q_lora + d * h + n * h + 2 * d)
    print(f"indexer parameters: {extra / 1e6:.2f} M in {cfg['num_hidden_layers']} layers")


if __name__ == "__main__":
    main()
