#!/usr/bin/env python3
"""Optional cross-check of the GGUF fixtures against llama.cpp itself.

The references are computed by transformers; this script shows that llama.cpp
reads the GGUF files the same way (metadata, q/k permutation, rope_freqs,
tokenizer) and tokenizes like the recorded prompt ids. It needs a Python with
`llama-cpp-python` (and numpy) installed, which the reference venv does not have:
  python -m venv /tmp/lcpp && /tmp/lcpp/bin/pip install numpy llama-cpp-python
  /tmp/lcpp/bin/python tools/reference/check_with_llama_cpp.py [--smollm2-gguf PATH] [--gemma3-gguf PATH]
It writes nothing; it prints one line per check and exits non-zero on a mismatch.

llama.cpp computes quantized matmuls on quantized activations (Q8_0/Q8_1), so for
Q8_0/Q4_0 files its logits differ from the dequantized-f32 reference by its own
rounding; the script prints that difference rather than failing on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "fixtures" / "models"
# llama.cpp vs transformers on the same f32 weights: summation order only.
F32_LOGIT_TOL = 1e-3
GGML_TYPE_F32 = 0


def _open(path: Path, vocab_only: bool = False) -> Llama:
    return Llama(
        model_path=str(path),
        n_ctx=512,
        n_batch=512,
        n_threads=1,
        logits_all=True,
        vocab_only=vocab_only,
        # F32 KV cache: llama.cpp's default F16 cache alone moves tiny-model logits by ~5e-3.
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        verbose=False,
    )


def _prompt_logits(llm: Llama, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids)], dtype=np.float32)


def _greedy(llm: Llama, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(int(_prompt_logits(llm, seq)[-1].argmax()))
    return seq[len(ids) :]


def check_tiny_gguf() -> bool:
    ok = True
    for ref_path in sorted((MODELS / "gguf").glob("*.reference.json")):
        ref = json.loads(ref_path.read_text(encoding="utf-8"))
        if ref.get("llama_cpp_skip"):
            print(f"skip {ref['gguf_file']}: {ref['llama_cpp_skip']}")
            continue
        llm = _open(ref_path.parent / ref["gguf_file"])
        ids = llm.tokenize(ref["prompt_text"].encode("utf-8"), add_bos=False, special=True)
        tok_ok = ids == ref["prompt_ids"]
        logits = _prompt_logits(llm, ref["prompt_ids"])
        diff = float(np.abs(logits - np.asarray(ref["logits"], dtype=np.float32)).max())
        greedy = _greedy(llm, ref["prompt_ids"], ref["greedy_new_tokens"])
        greedy_ok = greedy == ref["greedy_ids"]
        is_f32 = ".F32." in ref["gguf_file"]
        good = tok_ok and (not is_f32 or (diff <= F32_LOGIT_TOL and greedy_ok))
        ok &= good
        print(
            f"{'ok ' if good else 'BAD'} {ref['gguf_file']}: tokenize {tok_ok}, max|logit diff| {diff:.3g}, "
            f"greedy same {greedy_ok}"
        )
        llm.close()
    return ok


def _check_ids(vocab: Llama, what: str, text: str, want: list[int], add_bos: bool) -> bool:
    """llama.cpp's ids for `text` (special tokens parsed) against `want`, printed as `what`."""
    got = vocab.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
    print(f"{'ok ' if got == want else 'BAD'} {what}" + ("" if got == want else f": {got} != {want}"))
    return got == want


def check_tiny_tokenizer() -> bool:
    """The tiny tokenizer's recorded cases, tokenized from a tiny GGUF's vocabulary."""
    cases = json.loads((MODELS / "tokenizer" / "cases.json").read_text(encoding="utf-8"))
    vocab = _open(next((MODELS / "gguf").glob("*.F32.gguf")), vocab_only=True)
    ok = True
    items = [(c["text"], c["ids"]) for c in cases["cases"]] + [(cases["chat"]["rendered"], cases["chat"]["ids"])]
    for text, want in items:
        ok &= _check_ids(vocab, f"tiny tokenize {text!r}", text, want, add_bos=False)
    vocab.close()
    return ok


def _check_real_tokenizer(gguf_path: Path, ref: dict, label: str, add_bos: bool) -> bool:
    """A real model's recorded prompt ids and tokenizer cases, and ppl.txt's length
    in tokens, against llama.cpp's tokenizer from the GGUF's vocabulary."""
    vocab = _open(gguf_path, vocab_only=True)
    ok = True
    texts = [(p["name"], p["text"], p["prompt_ids"]) for p in ref["prompts"]]
    texts += [(repr(c["text"]), c["text"], c["ids"]) for c in ref["tokenizer_cases"]]
    for name, text, want in texts:
        ok &= _check_ids(vocab, f"{label} tokenize {name}", text, want, add_bos)
    ppl_text = (REPO / ref["perplexity"]["file"]).read_text(encoding="utf-8")
    got = vocab.tokenize(ppl_text.encode("utf-8"), add_bos=add_bos, special=True)
    same = len(got) == ref["perplexity"]["tokens_total"]
    ok &= same
    print(f"{'ok ' if same else 'BAD'} {label} tokenize ppl.txt: {len(got)} tokens")
    vocab.close()
    return ok


def _top_check(llm: Llama, prompt: dict) -> tuple[bool, float]:
    """Whether llama.cpp's last-position argmax for a recorded prompt is the reference's
    top-1, and its logits' max |diff| over the reference's top-20."""
    last = _prompt_logits(llm, prompt["prompt_ids"])[-1]
    top = prompt["last_logits"]["top"]
    return int(last.argmax()) == top[0][0], max(abs(float(last[i]) - v) for i, v in top)


def check_smollm2(gguf_path: Path) -> bool:
    ref = json.loads((MODELS / "smollm2-135m-q4_1.reference.json").read_text(encoding="utf-8"))
    ok = _check_real_tokenizer(gguf_path, ref, "smollm2", add_bos=False)
    llm = _open(gguf_path)
    for p in ref["prompts"]:
        top1, diff = _top_check(llm, p)
        print(f"info smollm2 {p['name']}: llama.cpp top-1 same {top1}, max|diff| over reference top-20 {diff:.3g}")
    llm.close()
    return ok


def check_gemma3(gguf_path: Path) -> bool:
    """Gemma 3 270M: llama.cpp's SentencePiece ids (BOS added, control tokens parsed)
    must be the recorded ones; its logits and greedy ids are reported."""
    ref = json.loads((MODELS / "gemma3-270m-q4_k_m.reference.json").read_text(encoding="utf-8"))
    ok = _check_real_tokenizer(gguf_path, ref, "gemma3", add_bos=True)
    llm = _open(gguf_path)
    for p in ref["prompts"]:
        top1, diff = _top_check(llm, p)
        greedy = _greedy(llm, p["prompt_ids"], ref["greedy_new_tokens"])
        same = next((i for i, (a, b) in enumerate(zip(greedy, p["greedy_ids"])) if a != b), len(greedy))
        print(
            f"info gemma3 {p['name']}: llama.cpp top-1 same {top1}, "
            f"max|diff| over reference top-20 {diff:.3g}, greedy ids agree for {same} steps"
        )
    llm.close()
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2-gguf", type=Path, default=Path(os.environ.get("KVANT_MODEL", "")))
    ap.add_argument("--gemma3-gguf", type=Path, default=Path(os.environ.get("KVANT_GEMMA3_MODEL", "")))
    args = ap.parse_args()
    ok = check_tiny_gguf()
    ok &= check_tiny_tokenizer()
    if args.smollm2_gguf.is_file():
        ok &= check_smollm2(args.smollm2_gguf)
    else:
        print("skip smollm2: pass --smollm2-gguf PATH or set KVANT_MODEL")
    if args.gemma3_gguf.is_file():
        ok &= check_gemma3(args.gemma3_gguf)
    else:
        print("skip gemma3: pass --gemma3-gguf PATH or set KVANT_GEMMA3_MODEL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
