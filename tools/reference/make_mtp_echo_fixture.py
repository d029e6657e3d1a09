"""A DeepSeek-V3 checkpoint whose MTP module predicts its main model exactly.

Self-speculative decoding is lossless by construction (kvant's tests check
that on random weights), but random weights never show the other half of
its contract: accepted drafts, two tokens per forward pass. This model
makes acceptance certain, so a test can see it happen:

* the main model's one layer adds nothing to the residual stream
  (`o_proj` and `down_proj` are zero, every norm weight is 1), so its
  logits at position p are `lm_head(rmsnorm(embed(t_p)))`: the next token
  is a fixed function f of the current one;
* the MTP module maps `[enorm(embed(t_{p+1})); hnorm(h_p)]` through
  `eh_proj = [I 0]` (it keeps the token half), its decoder layer adds
  nothing either, and `shared_head` is the main head, so it drafts
  `f(t_{p+1})`, which is exactly what the main model will produce.

Weights are random elsewhere (seeded), float32, from DeepseekV3Config; no
reference logits are written (the tests compare kvant with itself, with
and without the module). Output: tests/fixtures/models/deepseek-v3-mtp-echo/.

    .venv/bin/python tools/reference/make_mtp_echo_fixture.py
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "tests/fixtures/models/deepseek-v3"
OUT = ROOT / "tests/fixtures/models/deepseek-v3-mtp-echo"


def main() -> None:
    torch.manual_seed(20261130)
    cfg = json.loads((SRC / "config.json").read_text())
    cfg.update(num_hidden_layers=1, first_k_dense_replace=1, num_nextn_predict_layers=1)
    config = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT)
    state = load_file(OUT / "model.safetensors")
    h = config.hidden_size
    mtp = {k.replace("model.layers.0.", "model.layers.1."): v.clone() for k, v in state.items() if k.startswith("model.layers.0.")}
    mtp.update({
        "model.layers.1.enorm.weight": torch.ones(h),
        "model.layers.1.hnorm.weight": torch.ones(h),
        "model.layers.1.eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
        "model.layers.1.shared_head.norm.weight": torch.ones(h),
        "model.layers.1.shared_head.head.weight": state["lm_head.weight"].clone(),
        "model.layers.1.embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
    })
    state.update(mtp)
    save_file({k: v.contiguous() for k, v in state.items()}, OUT / "model.safetensors", metadata={"format": "pt"})
    # The published spelling, as the source fixture has it.
    (OUT / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(SRC / f, OUT / f)


if __name__ == "__main__":
    main()
