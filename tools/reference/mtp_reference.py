"""The DeepSeek-V3 multi-token-prediction (MTP) module of the `deepseek-v3` fixture.

transformers' DeepseekV3ForCausalLM never loads checkpoint layer
`num_hidden_layers` (the MTP module); a published checkpoint still carries it, with
these names (N = num_hidden_layers):
  model.layers.N.{enorm,hnorm}.weight             [hidden]
  model.layers.N.eh_proj.weight                   [hidden, 2*hidden]
  model.layers.N.shared_head.norm.weight          [hidden]
  model.layers.N.shared_head.head.weight          [vocab, hidden]  (a copy of lm_head)
  model.layers.N.embed_tokens.weight              [vocab, hidden]  (a copy of embed_tokens)
  model.layers.N.{input_layernorm,post_attention_layernorm,self_attn.*,mlp.*}
                                                  one MoE decoder layer, main-layer names
The fixture writes them into model.safetensors the same way.

Convention of the reference (`mtp` in reference.json), for the L prompt ids:
  h_i    main model's final hidden state at position i AFTER the final norm
         (model.norm), i.e. what lm_head reads;
  m_i    = eh_proj(cat(enorm(embed(ids[i+1])), hnorm(h_i)))   for i in 0..L-2;
  out    = the MTP decoder layer run causally over m_0..m_{L-2}, m_i at rope
           position i+1 (the position of ids[i+1]);
  logits_i = shared_head.head(shared_head.norm(out_i)), predicting ids[i+2]
           (the last row predicts the token after the prompt).
This is what transformers 5.24's own MtpModel (generate(..., use_mtp=True)) and
llama.cpp's deepseek2 MTP graph compute (both feed the post-norm hidden state);
`check_with_transformers_mtp` proves the first equality on the fixture files.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import fixture_json
import moe_models
import moe_routing_checks
import tiny_models

# Manual computation vs transformers' MtpModel on the same weights: float32 noise only.
MTP_SELF_TOL = 1e-5


def build_with_mtp(spec: tiny_models.Spec) -> tuple[torch.nn.Module, dict]:
    """The main model and its MTP module: {"tensors": checkpoint tensors of layer N,
    "layer": that decoder layer as a module}.

    The decoder part of the MTP module is drawn as layer N of an (N+1)-layer model
    and saved by transformers, so it carries exactly the per-expert checkpoint names
    the main layers have; the MTP-only tensors come from their own seed.
    """
    config = spec.make_config()
    n = config.num_hidden_layers
    longer = moe_models.with_layers(config, n + 1)
    big = moe_models.build(dataclasses.replace(spec, make_config=lambda: longer))
    main = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    prefix = f"model.layers.{n}."
    main.load_state_dict({k: v for k, v in big.state_dict().items() if not k.startswith(prefix)}, strict=True)

    with tempfile.TemporaryDirectory() as tmp:
        big.save_pretrained(tmp, safe_serialization=True)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    tensors = {k: v.clone() for k, v in saved.items() if k.startswith(prefix)}

    gen = torch.Generator().manual_seed(spec.seed + moe_models.MTP_SEED_OFFSET)
    hidden = config.hidden_size
    shapes = {
        "eh_proj.weight": (hidden, 2 * hidden),
        "enorm.weight": (hidden,),
        "hnorm.weight": (hidden,),
        "shared_head.norm.weight": (hidden,),
    }
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            val = 1.0 + tiny_models.NORM_SPREAD * torch.randn(shape, generator=gen)
        else:
            val = config.initializer_range * torch.randn(shape, generator=gen)
        tensors[prefix + name] = val
    tensors[prefix + "embed_tokens.weight"] = main.model.embed_tokens.weight.detach().clone()
    tensors[prefix + "shared_head.head.weight"] = main.lm_head.weight.detach().clone()
    mtp_layer = big.model.layers[n].eval()
    return main, {"tensors": tensors, "layer": mtp_layer}


def append_to_checkpoint(out_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add the MTP tensors to the saved model.safetensors."""
    path = out_dir / "model.safetensors"
    state = load_file(str(path))
    clash = set(state) & set(tensors)
    if clash:
        raise AssertionError(f"MTP tensors already present: {sorted(clash)}")
    state.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(state, str(path), metadata={"format": "pt"})


def _norm(weight: torch.Tensor, eps: float):
    def apply(x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(var + eps))

    return apply


def _final_hidden(main: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(before, after) the final norm, [1, L, hidden]."""
    got = {}
    hook = main.model.norm.register_forward_hook(lambda m, args, out: got.update(pre=args[0], post=out))
    try:
        with torch.no_grad():
            main(torch.tensor([ids]), use_cache=False)
    finally:
        hook.remove()
    return got["pre"], got["post"]


def mtp_logits(
    main, mtp: dict, ids: list[int], hidden: torch.Tensor
) -> tuple[torch.Tensor, moe_routing_checks.RoutingStats]:
    """MTP logits [L-1, vocab] from the main hidden states `hidden` [1, L, H] (see module doc)."""
    tensors, layer = mtp["tensors"], mtp["layer"]
    n = main.config.num_hidden_layers
    t = {k.removeprefix(f"model.layers.{n}."): v for k, v in tensors.items()}
    eps = main.config.rms_norm_eps
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        emb = torch.nn.functional.embedding(ids_t[:, 1:], t["embed_tokens.weight"])
        cat = torch.cat([_norm(t["enorm.weight"], eps)(emb), _norm(t["hnorm.weight"], eps)(hidden[:, :-1])], dim=-1)
        x = torch.nn.functional.linear(cat, t["eh_proj.weight"])
        steps = x.shape[1]
        positions = torch.arange(1, steps + 1)[None]
        rope = main.model.rotary_emb(x, positions)
        mask = torch.full((steps, steps), torch.finfo(torch.float32).min).triu(1)[None, None]
        holder = {}

        def run():
            holder["out"] = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)

        stats = moe_routing_checks.collect(layer, run)
        out = holder["out"]
        logits = torch.nn.functional.linear(_norm(t["shared_head.norm.weight"], eps)(out), t["shared_head.head.weight"])
    return logits[0], stats


def _mean_nll(logits: np.ndarray, targets: list[int]) -> float:
    """Mean NLL of `targets` under the float32 `logits` rows, in float64 (as reference_outputs)."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    logz = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    return float((logz - x[np.arange(len(targets)), targets]).mean())


def check_with_transformers_mtp(fixture_dir: Path, ids: list[int], want: torch.Tensor) -> float:
    """transformers' MtpModel, loaded from the fixture dir, must give the same logits."""
    from transformers.modeling_layers import MtpModel

    main = tiny_models.load(fixture_dir)
    n = main.config.num_hidden_layers
    # MtpModel finds MTP weights through this list; DeepSeek-V3 names only layer 61 (the real model's).
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
    mtp = MtpModel.from_pretrained(main).eval()
    _, post = _final_hidden(main, ids)
    with torch.no_grad():
        hidden = mtp.forward_layer(
            0, post[:, :-1], torch.arange(1, len(ids))[None], None, input_ids=torch.tensor([ids[1:]])
        )
        got = mtp._project_to_logits(hidden)[0]
    diff = float((got - want).abs().max())
    if diff > MTP_SELF_TOL:
        raise AssertionError(f"transformers' MtpModel differs from the MTP reference by {diff}")
    return diff


def reference(main, mtp: dict, ids: list[int], fixture_dir: Path) -> dict:
    """The `mtp` entry of reference.json (see the module doc for the convention)."""
    pre, post = _final_hidden(main, ids)
    logits, stats = mtp_logits(main, mtp, ids, post)
    if stats.min_margin < moe_routing_checks.MIN_ROUTING_MARGIN:
        raise AssertionError(f"MTP routing margin {stats.min_margin} too small; pick another seed")
    pre_logits, _ = mtp_logits(main, mtp, ids, pre)
    tf_diff = check_with_transformers_mtp(fixture_dir, ids, logits)
    arr = logits.numpy().astype(np.float32)
    rows = fixture_json.f32_rows(arr)
    fixture_json.check_roundtrip(arr, rows)
    nll = _mean_nll(arr[: len(ids) - 2], ids[2:])
    return {
        "convention": "h_i = main final hidden state after model.norm (what lm_head reads); "
        "m_i = eh_proj(cat(enorm(embed(prompt_ids[i+1])), hnorm(h_i))) for i in 0..L-2; the MTP "
        "decoder layer runs causally over m_0..m_{L-2} with m_i at rope position i+1; "
        "logits_i = shared_head.head(shared_head.norm(out_i)) predicts prompt_ids[i+2] "
        "(the last row: the token after the prompt)",
        "layer": main.config.num_hidden_layers,
        "input_ids": list(ids[1:]),
        "positions": list(range(1, len(ids))),
        "argmax": [int(i) for i in arr.argmax(axis=1)],
        "mean_nll": nll,
        "routing_margins": [round(m, 6) for m in stats.per_position],
        "notes": [
            f"transformers 5.24 MtpModel on the saved checkpoint agrees to {tf_diff:.2g}",
            (
                "feeding h_i from BEFORE model.norm instead changes these logits by up to "
                f"{float((pre_logits - logits).abs().max()):.3g}"
            ),
            "MTP MoE routing: " + stats.note(),
        ],
        "logits_shape": [int(arr.shape[0]), int(arr.shape[1])],
        "logits": rows,
    }
