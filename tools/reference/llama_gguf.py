"""Write a tiny Llama checkpoint as a llama.cpp `llama`-arch GGUF file.

Mirrors what llama.cpp's convert_hf_to_gguf.py (LlamaModel) writes:
  * metadata `llama.*`: block_count, context_length, embedding_length,
    feed_forward_length, attention.head_count(_kv), rope.freq_base,
    attention.layer_norm_rms_epsilon, vocab_size, rope.dimension_count, and
    attention.key_length/value_length (written because config.json has head_dim);
  * tensors token_embd, output_norm, output (absent when embeddings are tied),
    blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,ffn_gate,ffn_up,ffn_down};
  * q and k rows permuted (`permute` below) so llama.cpp's interleaved-pair rope
    equals HF's rotate-half rope;
  * for rope_type llama3, the per-frequency divisors as the F32 tensor
    `rope_freqs.weight` (llama.cpp's scaling is the tensor, not metadata);
  * the tokenizer as tokenizer.ggml.* with model gpt2 and pre smollm.
One deliberate difference: convert_hf_to_gguf reads original_max_position_embeddings
for rope_freqs from the top level of config.json (default 8192) where HF keeps it
inside rope_scaling; real Llama 3 checkpoints use 8192 so it never shows there.
We take it from the rope parameters, which is what the model means.

Quantized files (Q8_0, Q4_0) quantize every 2-D weight with gguf.quants; 1-D
tensors (norms, rope_freqs) stay F32, as llama.cpp's quantizer leaves them.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Tokenizer

import tiny_tokenizer

FILE_TYPES = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}

_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: HF half-split rows -> interleaved pairs per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Per-frequency divisors for llama3 rope scaling (llama.cpp's rope_freqs tensor)."""
    base = rope["rope_theta"]
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_ctx = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def gguf_tensors(config, state: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 data in GGUF row order) for every tensor of the file."""
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    out: list[tuple[str, np.ndarray]] = []
    rope = config.rope_parameters
    if rope.get("rope_type", "default") == "llama3":
        out.append(("rope_freqs.weight", llama3_rope_factors(rope, config.head_dim)))
    elif rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']} is not written by this script")
    out.append(("token_embd.weight", state["model.embed_tokens.weight"]))
    for i in range(config.num_hidden_layers):
        for hf, gg in _LAYER_TENSORS.items():
            w = state[f"model.layers.{i}.{hf}"]
            if hf == "self_attn.q_proj.weight":
                w = permute(w, n_head)
            elif hf == "self_attn.k_proj.weight":
                w = permute(w, n_kv)
            out.append((f"blk.{i}.{gg}", w))
    out.append(("output_norm.weight", state["model.norm.weight"]))
    if not config.tie_word_embeddings:
        out.append(("output.weight", state["lm_head.weight"]))
    return [(name, np.ascontiguousarray(w, dtype=np.float32)) for name, w in out]


def write(path: Path, config, state: dict[str, np.ndarray], file_type: str, tok: Tokenizer, name: str) -> None:
    """Write `state` (HF names, float32) as a llama GGUF of `file_type` (F32, Q8_0, Q4_0)."""
    qtype, ftype = FILE_TYPES[file_type]
    if config.model_type != "llama":
        raise ValueError("only llama configs map onto the llama GGUF arch here")
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_type("model")
    w.add_name(name)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_file_type(ftype)
    w.add_vocab_size(config.vocab_size)
    w.add_rope_dimension_count(config.head_dim)

    tokens, types, merges = tiny_tokenizer.gguf_vocab(tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tiny_tokenizer.BOS_ID)
    w.add_eos_token_id(tiny_tokenizer.EOS_ID)
    w.add_unk_token_id(tiny_tokenizer.UNK_ID)
    w.add_pad_token_id(tiny_tokenizer.PAD_ID)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(tiny_tokenizer.CHAT_TEMPLATE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    for tname, data in gguf_tensors(config, state):
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(tname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(tname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dequantized_state(config, state: dict[str, np.ndarray], file_type: str) -> dict[str, np.ndarray]:
    """HF-named f32 weights after the quantize/dequantize round trip of `file_type`.

    Independent of transformers' GGUF loader, so the two can check each other.
    """
    qtype, _ = FILE_TYPES[file_type]
    out = {}
    for k, v in state.items():
        if v.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            out[k] = gguf.quants.dequantize(
                gguf.quants.quantize(np.ascontiguousarray(v, dtype=np.float32), qtype), qtype
            )
        else:
            out[k] = np.asarray(v, dtype=np.float32)
    return out
