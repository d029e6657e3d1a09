"""Read a GGUF written by llama.cpp's converter back into transformers' weight names.

The inverse of what convert_hf_to_gguf.py does for the MoE/MLA fixtures, so a
GGUF's reference can be computed by transformers from exactly the weights in the
file (dequantized with gguf-py's `quants.dequantize`):
  * names: blk.N.* -> model.layers.N.* (tables below), per architecture;
  * llama (Mixtral): attn_q / attn_k rows were permuted to llama.cpp's rope pair
    order (LlamaModel.permute); `unpermute` undoes it;
  * experts: ffn_{gate,up,down}_exps [E, ...] are stacked per-expert matrices;
    transformers 5 holds them fused: gate_up_proj = cat(gate, up) per expert;
  * deepseek2: kv_b_proj was split per head into attn_k_b (transposed,
    [n_head, kv_lora, qk_nope]) and attn_v_b ([n_head, v_head, kv_lora]);
    they are re-assembled into kv_b_proj [n_head * (qk_nope + v_head), kv_lora];
  * qwen2moe: ffn_gate_inp_shexp is stored 1-D; transformers' shared_expert_gate is [1, hidden];
  * deepseek32: deepseek2's names plus the DSA indexer's (blk.N.indexer.*).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

_COMMON = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = {
    "llama": {
        **_COMMON,
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
    },
    "qwen2moe": {
        **_COMMON,
        **{f"attn_{x}.{p}": f"self_attn.{x}_proj.{p}" for x in "qkv" for p in ("weight", "bias")},
        "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    },
    "qwen3moe": {
        **_COMMON,
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
    "deepseek2": {
        **_COMMON,
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    },
}
_LAYER["deepseek32"] = {
    **_LAYER["deepseek2"],
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Handled by `read_state` itself (pairs or reshapes).
_SPECIAL = {"ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "attn_k_b.weight", "attn_v_b.weight"}


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute (llama_gguf.permute)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of the file: name -> (ggml type name, float32 values in PyTorch shape)."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        qtype = t.tensor_type
        if qtype == gguf.GGMLQuantizationType.F32:
            data = np.array(t.data, dtype=np.float32)
        elif qtype == gguf.GGMLQuantizationType.F16:
            data = np.array(t.data).astype(np.float32)
        else:
            data = np.asarray(gguf.quants.dequantize(np.array(t.data), qtype), dtype=np.float32)
        out[t.name] = (qtype.name, data)
    return out


def architecture(path: Path) -> str:
    field = gguf.GGUFReader(str(path)).fields["general.architecture"]
    return field.contents()


def read_state(path: Path, config) -> dict[str, np.ndarray]:
    """The GGUF's weights under transformers' state_dict names (float32)."""
    arch = architecture(path)
    if arch not in _LAYER:
        raise ValueError(f"{path.name}: architecture {arch} is not mapped back")
    table = _LAYER[arch]
    got = {name: data for name, (_, data) in tensors(path).items()}
    out: dict[str, np.ndarray] = {}
    layers: dict[int, dict[str, np.ndarray]] = {}
    for name, data in got.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = data
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m is None:
            raise ValueError(f"{path.name}: unexpected tensor {name}")
        bid, rest = int(m.group(1)), m.group(2)
        if rest in _SPECIAL:
            layers.setdefault(bid, {})[rest] = data
            continue
        if rest not in table:
            raise ValueError(f"{path.name}: tensor {name} has no transformers name here")
        hf = f"model.layers.{bid}.{table[rest]}"
        if arch == "llama" and rest == "attn_q.weight":
            data = unpermute(data, config.num_attention_heads)
        elif arch == "llama" and rest == "attn_k.weight":
            data = unpermute(data, config.num_key_value_heads)
        elif rest == "ffn_gate_inp_shexp.weight":
            data = data.reshape(1, -1)
        out[hf] = data
    for bid, parts in layers.items():
        pre = f"model.layers.{bid}."
        if "ffn_gate_exps.weight" in parts:
            out[pre + "mlp.experts.gate_up_proj"] = np.concatenate(
                [parts.pop("ffn_gate_exps.weight"), parts.pop("ffn_up_exps.weight")], axis=1
            )
            out[pre + "mlp.experts.down_proj"] = parts.pop("ffn_down_exps.weight")
        if "attn_k_b.weight" in parts:
            k_b = parts.pop("attn_k_b.weight").transpose(0, 2, 1)  # [n_head, qk_nope, kv_lora]
            v_b = parts.pop("attn_v_b.weight")  # [n_head, v_head, kv_lora]
            kv_b = np.concatenate([k_b, v_b], axis=1)
            out[pre + "self_attn.kv_b_proj.weight"] = np.ascontiguousarray(kv_b.reshape(-1, kv_b.shape[-1]))
        if parts:
            raise ValueError(f"{path.name}: unpaired tensors in block {bid}: {sorted(parts)}")
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}
