"""Reference outputs of the real default model, SmolLM2-135M-Instruct (Q4_1 GGUF).

transformers loads the GGUF and dequantizes every tensor to float32, so these are
the outputs of the *dequantized* weights in float32; an engine that computes with
the Q4_1/Q8_0 blocks directly differs by its own arithmetic, not by a different model.

Tokenization. The GGUF says `tokenizer.ggml.pre = smollm`: llama.cpp first splits
every digit into its own piece, then applies the GPT-2 regex. transformers 5.24
does not know `smollm` and builds a plain GPT-2 byte-level pre-tokenizer from the
file, which differs whenever two or more whitespace characters precede a digit
("In  2024", "\\n\\n1."): llama.cpp merges the whitespace run, transformers does not.
The prompt ids below are the llama.cpp (smollm) ones, built from the GGUF's own
vocabulary and merges with the pre-tokenizer of SmolLM2's tokenizer.json; for each
text we also record whether transformers' GGUF tokenizer agrees.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import fixture_json
import reference_outputs

GREEDY_NEW = 32
TOP_K = 20
PPL_WINDOW = 512

PROMPTS = [
    ("plain", "The old lighthouse keeper climbed the stairs every evening to light the lamp, and"),
    ("chat", None),  # rendered from CHAT_MESSAGES with the GGUF's chat template
    ("cyrillic_cjk", "Москва — столица России. 東京は日本の首都です。北京是中国的首都。"),
    ("code", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
]
CHAT_MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]

# Texts where llama.cpp's smollm pre-tokenizer and transformers' GGUF tokenizer may part.
TOKENIZER_CASES = [
    "In  2024, 3.14 and 1000000 items",
    "a\n\n1. b",
    "abc123def",
    "x = 42;\n    y = 7",
    "   leading spaces and trailing   ",
    "<|im_start|>user\nHi<|im_end|>\n",
]


def _string_array(reader: gguf.GGUFReader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _int_array(reader: gguf.GGUFReader, key: str) -> list[int]:
    field = reader.fields[key]
    return [int(field.parts[i][0]) for i in field.data]


def _scalar(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def smollm_tokenizer(gguf_path: Path) -> tuple[Tokenizer, bool]:
    """The GGUF's vocabulary with llama.cpp's `smollm` pre-tokenization; and add_bos."""
    r = gguf.GGUFReader(str(gguf_path))
    if _scalar(r, "tokenizer.ggml.model") != "gpt2" or _scalar(r, "tokenizer.ggml.pre") != "smollm":
        raise ValueError("expected a gpt2 tokenizer with pre-tokenizer smollm")
    tokens = _string_array(r, "tokenizer.ggml.tokens")
    types = _int_array(r, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _string_array(r, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == 3]
    tok.add_special_tokens(control)
    add_bos = bool(_scalar(r, "tokenizer.ggml.add_bos_token"))
    return tok, add_bos


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _last_logits_summary(last: np.ndarray) -> dict:
    order = np.argsort(-last, kind="stable")[:TOP_K]
    x = last.astype(np.float64)
    m = x.max()
    return {
        "top": [[int(i), fixture_json.f32_list(last[i : i + 1])[0]] for i in order],
        "l2_norm": float(np.sqrt((x * x).sum())),
        "logsumexp": float(m + np.log(np.exp(x - m).sum())),
    }


def build(gguf_path: Path, ppl_text_path: Path, ppl_text_rel: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, add_bos = smollm_tokenizer(gguf_path)
    if add_bos:
        raise ValueError("this script assumes the SmolLM2 GGUF's add_bos_token = false")
    hf_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()

    def encode(text: str) -> tuple[list[int], list[int]]:
        ours = tok.encode(text, add_special_tokens=False).ids
        theirs = hf_tok(text, add_special_tokens=False).input_ids
        return ours, theirs

    prompts = []
    for name, text in PROMPTS:
        if text is None:
            text = hf_tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
        ids, hf_ids = encode(text)
        logits = reference_outputs.prompt_logits(model, ids)
        cached = reference_outputs.greedy_generate(model, ids, GREEDY_NEW)
        uncached, margins = reference_outputs.greedy_uncached(model, ids, GREEDY_NEW)
        margin = min(margins)
        if cached != uncached:
            raise AssertionError(f"{name}: generate {cached} != uncached greedy {uncached}")
        prompts.append(
            {
                "name": name,
                "text": text,
                "prompt_ids": ids,
                "transformers_gguf_ids_agree": ids == hf_ids,
                "greedy_ids": cached,
                "greedy_text": tok.decode(cached, skip_special_tokens=False),
                "greedy_min_margin": round(margin, 6),
                # Per step: an engine whose logits are off by more than a step's margin may
                # legitimately pick another token there; compare greedy ids up to that step.
                "greedy_margins": [round(m, 6) for m in margins],
                "last_logits": _last_logits_summary(logits[-1]),
            }
        )
        said = prompts[-1]["greedy_text"]
        print(f"smollm2 {name}: {len(ids)} ids, agree {ids == hf_ids}, margin {margin:.4f}: {said!r}")

    cases = []
    for text in TOKENIZER_CASES:
        ids, hf_ids = encode(text)
        cases.append({"text": text, "ids": ids, "transformers_gguf_ids": hf_ids, "agree": ids == hf_ids})

    text = ppl_text_path.read_text(encoding="utf-8")
    ids, hf_ids = encode(text)
    ppl = {
        "file": ppl_text_rel,
        "convention": (
            f"tokenize the whole file once (no BOS: add_bos_token is false), cut into consecutive "
            f"non-overlapping windows of {PPL_WINDOW} tokens (a last window under 2 tokens is dropped), "
            "predict every token of a window after its first from its prefix within the window, "
            "PPL = exp(mean NLL over all predicted tokens)"
        ),
        "window": PPL_WINDOW,
        "bos": False,
        "tokens_total": len(ids),
        "transformers_gguf_ids_agree": ids == hf_ids,
        **reference_outputs.window_ppl(model, ids, PPL_WINDOW),
    }
    print(f"smollm2 ppl: {ppl['ppl']:.4f} over {ppl['tokens_scored']} tokens in {ppl['windows']} windows")

    return {
        "model": gguf_path.name,
        "gguf_sha256": _sha256(gguf_path),
        "source": "transformers GGUF loader, every tensor dequantized to float32, eager attention, CPU",
        "add_bos": False,
        "greedy_new_tokens": GREEDY_NEW,
        "tokenization": "llama.cpp smollm pre-tokenizer (individual digits, then GPT-2 regex) over the GGUF vocabulary",
        "prompts": prompts,
        "tokenizer_cases": cases,
        "perplexity": ppl,
    }
