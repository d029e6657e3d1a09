#!/usr/bin/env python3
"""The DeepSeek-V3-shaped benchmark model with an MTP layer, for measuring
self-speculative decoding's speed-up at known acceptance rates.

Random weights cannot show what a trained MTP module gains, because its
drafts are almost never right. Two variants bound the real figure instead,
both with exactly the shapes (hence the cost per forward pass) of
make_moe_bench_model.py's model plus DeepSeek-V3's MTP layer (layer 8: the
MLA + MoE decoder layer, enorm, hnorm, eh_proj, shared_head):

* ``echo``: every draft is accepted. Each layer's output projections
  (``o_proj``, every ``down_proj``) are zero, so the main model's next token
  is a fixed function of the current one, ``argmax lm_head(rmsnorm(embed(t)))``;
  the MTP layer's outputs are zero too, ``eh_proj = [I 0]`` keeps the token
  half and ``shared_head.head = lm_head``, so it drafts that same function of
  the token it is given (tools/reference/make_mtp_echo_fixture.py, at
  benchmark size). The matrices still hold their random values, so routing
  and every product cost what they cost in the trained model.
* ``random``: the main model unchanged and a random MTP layer (a copy of the
  last layer's weights, eh_proj N(0, 0.02)): acceptance near 0, the
  mechanism's pure overhead.

  /work/refvenv/bin/python tools/bench/make_mtp_bench_model.py \\
      --src dsv3-bench-hf --variant echo --out dsv3-bench-mtp-echo
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, required=True, help="make_moe_bench_model.py's output dir")
    ap.add_argument("--variant", choices=["echo", "random"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.manual_seed(20261130)
    cfg = json.loads((args.src / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    state = load_file(args.src / "model.safetensors")
    dtype = state["lm_head.weight"].dtype
    if args.variant == "echo":
        for k, v in state.items():
            if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
                state[k] = torch.zeros_like(v)
    last = f"model.layers.{n - 1}."
    mtp = {k.replace(last, f"model.layers.{n}."): v.clone() for k, v in state.items() if k.startswith(last)}
    if args.variant == "echo":
        eh = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    else:
        eh = torch.randn(h, 2 * h) * 0.02
    p = f"model.layers.{n}."
    mtp.update({
        p + "enorm.weight": torch.ones(h, dtype=dtype),
        p + "hnorm.weight": torch.ones(h, dtype=dtype),
        p + "eh_proj.weight": eh.to(dtype),
        p + "shared_head.norm.weight": torch.ones(h, dtype=dtype),
        p + "shared_head.head.weight": state["lm_head.weight"].clone(),
        p + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
    })
    state.update(mtp)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, args.out / "model.safetensors", metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in args.src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, args.out / f.name)


if __name__ == "__main__":
    main()
