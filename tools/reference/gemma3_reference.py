"""Reference outputs of Gemma 3 270M (Q4_K_M GGUF: Q8_0 embeddings, Q5_0/Q4_K/Q6_K/Q8_0 layers).

transformers loads the GGUF and dequantizes every tensor to float32 (its gemma3
processor also turns the converter's `1 + w` norm weights back into `w`), so these
are the outputs of the *dequantized* weights in float32.

What the GGUF leaves out. It has no local rope base, no layer pattern and no
query_pre_attn_scalar; transformers fills them with Gemma3TextConfig's defaults,
which are also what llama.cpp hard-codes for `gemma3` and what the published
270M config says: local layers rope θ 1e4, every 6th layer global (θ from
`rope.freq_base`, 1e6), attention scale 1/√256. `build` checks those values and
records them in the file, so a change in transformers' defaults cannot slip by.

Tokenization. The GGUF holds a SentencePiece ("llama") vocabulary: scores, byte
fallback, 6249 control tokens (`<bos>`, `<start_of_turn>`, …) and 165 user-defined
ones (runs of `\\n`, of spaces and of tabs, a few tags). Prompt ids are what
transformers' GGUF tokenizer gives, BOS included (add_bos_token is true); control
tokens written in the text are parsed as such, user-defined ones always are.
llama.cpp gives the same ids for every prompt, every tokenizer case and ppl.txt
(`check_with_llama_cpp.py --gemma3-gguf`).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import reference_outputs
import torch
from smollm2_reference import _last_logits_summary, _scalar, _sha256

GREEDY_NEW = 32
PPL_WINDOW = 512
# Also scored with windows longer than the sliding window (512), the only place
# where the local layers' window masks anything.
PPL_WINDOW_LONG = 1024

PROMPTS = [
    ("plain", "The old lighthouse keeper climbed the stairs every evening to light the lamp, and"),
    ("cyrillic_cjk", "Москва — столица России. 東京は日本の首都です。北京是中国的首都。"),
    ("code", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
    # Gemma's turn markup typed as text: control tokens must be parsed from the prompt.
    ("turns", "<start_of_turn>user\nWrite one sentence about the sea.<end_of_turn>\n<start_of_turn>model\n"),
]

# Texts where SentencePiece implementations may part: whitespace runs (user-defined
# tokens), leading spaces (no dummy prefix here), byte fallback, control tokens.
TOKENIZER_CASES = [
    "In  2024, 3.14 and 1000000 items",
    "a\n\n1. b",
    "   leading spaces and trailing   ",
    "x\t\ty\r\nz",
    " Hello",
    "🙂 emoji, ünïcödé and 𠜎",
    "<start_of_turn>user\nHi<end_of_turn>\n",
]

# What the GGUF does not say and the reference relies on (see the module docstring).
EXPECTED_CONFIG = {
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "global_layers": [5, 11, 17],
    "rope_theta_global": 1e6,
    "rope_theta_local": 1e4,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh",
}


def _model_facts(model: torch.nn.Module) -> dict:
    c = model.config
    rope = c.rope_parameters
    return {
        "sliding_window": c.sliding_window,
        "query_pre_attn_scalar": c.query_pre_attn_scalar,
        "global_layers": [i for i, t in enumerate(c.layer_types) if t == "full_attention"],
        "rope_theta_global": rope["full_attention"]["rope_theta"],
        "rope_theta_local": rope["sliding_attention"]["rope_theta"],
        "final_logit_softcapping": c.final_logit_softcapping,
        "attn_logit_softcapping": c.attn_logit_softcapping,
        "hidden_activation": c.hidden_activation,
    }


def _check_norms_unshifted(gguf_path: Path, model: torch.nn.Module) -> None:
    """The GGUF stores Gemma norms as `1 + w`; transformers must hold `w`."""
    r = gguf.GGUFReader(str(gguf_path))
    stored = {t.name: np.asarray(t.data, dtype=np.float32) for t in r.tensors if t.name.endswith("norm.weight")}
    loaded = {
        "blk.0.attn_norm.weight": model.model.layers[0].input_layernorm.weight,
        "blk.0.attn_q_norm.weight": model.model.layers[0].self_attn.q_norm.weight,
        "blk.17.post_ffw_norm.weight": model.model.layers[17].post_feedforward_layernorm.weight,
        "output_norm.weight": model.model.norm.weight,
    }
    for name, w in loaded.items():
        if not np.array_equal(w.detach().numpy() + np.float32(1), stored[name]):
            raise AssertionError(f"{name}: transformers' weight + 1 != the GGUF's")


def build(gguf_path: Path, ppl_text_path: Path, ppl_text_rel: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = gguf.GGUFReader(str(gguf_path))
    if _scalar(r, "general.architecture") != "gemma3" or _scalar(r, "tokenizer.ggml.model") != "llama":
        raise ValueError("expected a gemma3 GGUF with a SentencePiece (llama) tokenizer")
    add_bos = bool(_scalar(r, "tokenizer.ggml.add_bos_token"))
    bos = int(_scalar(r, "tokenizer.ggml.bos_token_id"))
    if not add_bos:
        raise ValueError("this script assumes the Gemma 3 GGUF's add_bos_token = true")
    del r

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    facts = _model_facts(model)
    if facts != EXPECTED_CONFIG:
        raise AssertionError(f"transformers' Gemma 3 defaults changed: {facts} != {EXPECTED_CONFIG}")
    _check_norms_unshifted(gguf_path, model)

    def encode(text: str) -> list[int]:
        ids = tok(text).input_ids
        if ids[:1] != [bos]:
            raise AssertionError(f"{text!r}: transformers did not add BOS: {ids[:4]}")
        return ids

    prompts = []
    for name, text in PROMPTS:
        ids = encode(text)
        logits = reference_outputs.prompt_logits(model, ids)
        cached = reference_outputs.greedy_generate(model, ids, GREEDY_NEW)
        uncached, margins = reference_outputs.greedy_uncached(model, ids, GREEDY_NEW)
        if cached != uncached:
            raise AssertionError(f"{name}: generate {cached} != uncached greedy {uncached}")
        margin = min(margins)
        prompts.append(
            {
                "name": name,
                "text": text,
                "prompt_ids": ids,
                "greedy_ids": cached,
                "greedy_text": tok.decode(cached, skip_special_tokens=False),
                "greedy_min_margin": round(margin, 6),
                # Per step: an engine whose logits are off by more than a step's margin may
                # legitimately pick another token there; compare greedy ids up to that step.
                "greedy_margins": [round(m, 6) for m in margins],
                "last_logits": _last_logits_summary(logits[-1]),
            }
        )
        print(f"gemma3 {name}: {len(ids)} ids, margin {margin:.4f}: {prompts[-1]['greedy_text']!r}")

    cases = [{"text": text, "ids": encode(text)} for text in TOKENIZER_CASES]

    ids = encode(ppl_text_path.read_text(encoding="utf-8"))
    convention = (
        "tokenize the whole file once (BOS first: add_bos_token is true), cut into consecutive "
        "non-overlapping windows of `window` tokens (a last window under 2 tokens is dropped), "
        "predict every token of a window after its first from its prefix within the window, "
        "PPL = exp(mean NLL over all predicted tokens)"
    )
    ppl = {"file": ppl_text_rel, "convention": convention, "bos": True, "tokens_total": len(ids)}
    perplexity = {**ppl, "window": PPL_WINDOW, **reference_outputs.window_ppl(model, ids, PPL_WINDOW)}
    perplexity_long = {**ppl, "window": PPL_WINDOW_LONG, **reference_outputs.window_ppl(model, ids, PPL_WINDOW_LONG)}
    for p in (perplexity, perplexity_long):
        print(f"gemma3 ppl (window {p['window']}): {p['ppl']:.4f} over {p['tokens_scored']} tokens")

    return {
        "model": gguf_path.name,
        "gguf_sha256": _sha256(gguf_path),
        "source": "transformers GGUF loader, every tensor dequantized to float32, eager attention, CPU",
        "config_not_in_gguf": facts,
        "add_bos": True,
        "greedy_new_tokens": GREEDY_NEW,
        "tokenization": "transformers' GGUF SentencePiece tokenizer, BOS added, control and user-defined "
        "tokens in the text parsed; equal to llama.cpp's ids",
        "prompts": prompts,
        "tokenizer_cases": cases,
        "perplexity": perplexity,
        "perplexity_long": perplexity_long,
    }
