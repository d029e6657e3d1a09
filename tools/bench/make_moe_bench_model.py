#!/usr/bin/env python3
"""A DeepSeek-V3-shaped MoE + MLA model with random weights, for benchmarks.

kvant is measured against llama.cpp on a model with DeepSeek-V3's structure
(multi-head latent attention with q and kv low-rank projections, one leading
dense layer, then sigmoid-routed MoE layers with group-limited top-k, a
selection bias and one shared expert, YaRN rope) at a size a laptop-class CPU
runs: about 0.5 B parameters, of which about a quarter are active per token.
The weights are random, so the text it writes is gibberish; what matters is
that every tensor has the shape, layout and dtype of the real model, so the
speed of a forward pass is representative.

The tokenizer is a real one, SmolLM2's (49152 tokens, GPT-2 byte-level BPE
with digits split one by one), rebuilt from the vocabulary and merges of a
SmolLM2 GGUF, so prompts tokenize as in a real deployment and llama.cpp's
converter recognises the pre-tokenizer.

Random weights: every matrix is N(0, STD) and every norm weight is 1, so the
residual stream keeps a sane scale through the layers; the routing bias gets
small random values so the selection bias actually shifts expert choice.

  /work/refvenv/bin/python tools/bench/make_moe_bench_model.py \
      --tokenizer-gguf SmolLM2-135M-Instruct.Q4_1.gguf --out dsv3-bench-hf

writes config.json, generation_config.json, model.safetensors (bf16; the
routing bias f32 as in DeepSeek-V3's own checkpoint), tokenizer.json and
tokenizer_config.json into --out, and prints the parameter counts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

# Standard deviation of every random matrix: with hidden size 1024 a linear
# layer scales its input by about 0.02 * sqrt(1024) = 0.64, so activations
# neither explode nor vanish over 8 layers.
STD = 0.02
# Standard deviation of the routing selection bias; the sigmoid scores it is
# added to sit near 0.5 and differ by a few hundredths between experts.
ROUTING_BIAS_STD = 0.01
DEFAULT_SEED = 0x6B76616E74

# The SmolLM2 vocabulary the shape is built around.
VOCAB_SIZE = 49152

# DeepSeek-V3's published rope scaling (its config.json), kept as is.
ROPE_PARAMETERS = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def bench_config(bos_id: int, eos_id: int) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=1024,
        num_hidden_layers=8,
        first_k_dense_replace=1,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_group=8,
        topk_group=4,
        n_shared_experts=1,
        moe_intermediate_size=256,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters=dict(ROPE_PARAMETERS),
        max_position_embeddings=16384,
        num_nextn_predict_layers=0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        # As in DeepSeek-V3's config.json; transformers' DeepseekV3 always
        # routes this way, llama.cpp's converter reads scoring_func to choose
        # sigmoid gating (its default for deepseek2 is softmax).
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        initializer_range=STD,
    )


def randomize(model: DeepseekV3ForCausalLM, seed: int) -> None:
    """Seeded weights: norms 1, routing bias N(0, ROUTING_BIAS_STD), the rest N(0, STD).

    Parameters are visited in name order so the weights do not depend on
    module construction order.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = model.state_dict(keep_vars=True)  # persistent tensors only: not rope's inv_freq
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * ROUTING_BIAS_STD)
            elif "norm" in name.rsplit(".", 2)[-2]:
                t.fill_(1.0)
            elif t.is_floating_point() and t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=gen) * STD)
            else:
                raise ValueError(f"no initialisation rule for {name} {tuple(t.shape)}")


def field(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    if f is None:
        raise SystemExit(f"the tokenizer GGUF has no {key}")
    return f.contents()


def smollm2_tokenizer(gguf_path: Path) -> PreTrainedTokenizerFast:
    """SmolLM2's tokenizer from a SmolLM2 GGUF (llama.cpp's `gpt2` model, pre `smollm`)."""
    r = gguf.GGUFReader(gguf_path)
    if field(r, "tokenizer.ggml.model") != "gpt2" or field(r, "tokenizer.ggml.pre") != "smollm":
        raise SystemExit(f"{gguf_path} does not hold a SmolLM-style tokenizer (gpt2 / smollm)")
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    if len(tokens) != VOCAB_SIZE:
        raise SystemExit(f"expected {VOCAB_SIZE} tokens, the GGUF has {len(tokens)}")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # llama.cpp's `smollm` pre-tokenizer: digits one by one, then the GPT-2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = int(gguf.TokenType.CONTROL)
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if int(ty) == control
    ])
    special = lambda key: tokens[int(field(r, key))]  # noqa: E731
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special("tokenizer.ggml.bos_token_id"),
        eos_token=special("tokenizer.ggml.eos_token_id"),
        unk_token=special("tokenizer.ggml.unknown_token_id"),
        pad_token=special("tokenizer.ggml.padding_token_id"),
        add_bos_token=bool(field(r, "tokenizer.ggml.add_bos_token")),
        clean_up_tokenization_spaces=False,
        model_max_length=16384,
    )
    if r.get_field("tokenizer.chat_template") is not None:
        fast.chat_template = field(r, "tokenizer.chat_template")
    return fast


def count_parameters(model: DeepseekV3ForCausalLM, cfg: DeepseekV3Config) -> tuple[int, int]:
    """(total, active per token); active excludes the embedding table (one row is read)."""
    total = active = 0
    share = cfg.num_experts_per_tok / cfg.n_routed_experts
    for name, t in model.state_dict().items():
        n = t.numel()
        total += n
        if name.startswith("model.embed_tokens"):
            continue
        active += round(n * share) if ".mlp.experts." in name else n
    return total, active


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer-gguf", type=Path, required=True, help="a SmolLM2 GGUF (its tokenizer is reused)")
    p.add_argument("--out", type=Path, required=True, help="output directory (created)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    a = p.parse_args()

    tokenizer = smollm2_tokenizer(a.tokenizer_gguf)
    cfg = bench_config(tokenizer.bos_token_id, tokenizer.eos_token_id)
    cfg.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(a.seed)
    model = DeepseekV3ForCausalLM(cfg)
    randomize(model, a.seed)
    total, active = count_parameters(model, cfg)

    model = model.to(torch.bfloat16)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()
    model.generation_config.bos_token_id = cfg.bos_token_id
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out)
    tokenizer.save_pretrained(a.out)
    # transformers does not write add_bos_token for this tokenizer class; llama.cpp's
    # converter copies it from tokenizer_config.json into the GGUF, as SmolLM2's has it.
    tc_path = a.out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["add_bos_token"] = tokenizer.add_bos_token
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")

    emb = cfg.vocab_size * cfg.hidden_size
    print(f"parameters: total {total:,} ({total / 1e6:.1f} M), "
          f"active per token {active:,} ({active / 1e6:.1f} M, embedding table excluded), "
          f"embedding table {emb:,}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
