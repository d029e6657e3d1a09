"""What a reference.json holds for one model and one prompt, and how it is computed.

All numbers come from transformers in float32 on the CPU with one thread, so a
rerun reproduces them bit for bit.

  prompt_ids    the token ids fed to the model
  logits        float32 logits for every prompt position, [len(prompt_ids)][vocab]
  greedy_ids    argmax continuation of `greedy_new_tokens` tokens; EOS is an
                ordinary token here (no stopping, no suppression)
  greedy_min_margin  smallest top-1 minus top-2 logit gap over the greedy steps;
                an implementation whose logits are within this of the reference
                must produce the same greedy_ids
  ppl           exp(mean NLL of prompt_ids[1:] given their prefixes), NLL taken
                from log_softmax of the float32 logits evaluated in float64
"""

from __future__ import annotations

import math

import numpy as np
import torch

import fixture_json

# Greedy steps whose top-1/top-2 gap is below this are too fragile to pin in a
# fixture: float32 reorderings in another engine move logits by ~1e-5.
MIN_GREEDY_MARGIN = 1e-3


def prompt_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False).logits[0]
    return out.to(torch.float32).numpy()


def perplexity(logits: np.ndarray, ids: list[int]) -> tuple[float, float]:
    """(ppl, mean NLL) of ids[1:] given their prefixes, from float32 logits."""
    x = logits.astype(np.float64)[:-1]
    m = x.max(axis=1, keepdims=True)
    logz = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    targets = np.asarray(ids[1:])
    nll = logz - x[np.arange(len(targets)), targets]
    mean = float(nll.mean())
    return math.exp(mean), mean


def greedy_uncached(model: torch.nn.Module, ids: list[int], n_new: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by full forwards (no KV cache), and each step's top-1 minus top-2 logit."""
    seq = list(ids)
    margins = []
    for _ in range(n_new):
        last = prompt_logits(model, seq)[-1]
        top2 = np.sort(last)[-2:]
        margins.append(float(top2[1] - top2[0]))
        seq.append(int(last.argmax()))
    return seq[len(ids) :], margins


def greedy_generate(model: torch.nn.Module, ids: list[int], n_new: int) -> list[int]:
    """Greedy continuation with transformers' generate (KV cache), EOS not stopping."""
    gen_cfg = model.generation_config
    saved = (gen_cfg.eos_token_id, gen_cfg.do_sample)
    gen_cfg.eos_token_id = None
    gen_cfg.do_sample = False
    try:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                pad_token_id=0,
            )
    finally:
        gen_cfg.eos_token_id, gen_cfg.do_sample = saved
    new = out[0, len(ids) :].tolist()
    if len(new) != n_new:
        raise AssertionError(f"generate returned {len(new)} tokens, want {n_new}")
    return new


def greedy(model: torch.nn.Module, ids: list[int], n_new: int) -> tuple[list[int], float]:
    """Greedy ids, checked two ways (generate with cache, full forwards without)."""
    cached = greedy_generate(model, ids, n_new)
    uncached, margins = greedy_uncached(model, ids, n_new)
    margin = min(margins)
    if cached != uncached:
        raise AssertionError(f"generate {cached} != uncached greedy {uncached}")
    if margin < MIN_GREEDY_MARGIN:
        raise AssertionError(f"greedy margin {margin} below {MIN_GREEDY_MARGIN}; pick another seed or prompt")
    return cached, margin


def tiny_reference(model: torch.nn.Module, prompt_ids: list[int], n_new: int, meta: dict) -> dict:
    """The reference.json content for a tiny model."""
    logits = prompt_logits(model, prompt_ids)
    ppl, nll = perplexity(logits, prompt_ids)
    greedy_ids, margin = greedy(model, prompt_ids, n_new)
    if len(set(greedy_ids)) < n_new // 4:
        raise AssertionError(f"greedy continuation is nearly constant: {greedy_ids}")
    rows = fixture_json.f32_rows(logits)
    fixture_json.check_roundtrip(logits, rows)
    return {
        **meta,
        "prompt_ids": list(prompt_ids),
        "greedy_new_tokens": n_new,
        "greedy_ids": greedy_ids,
        "greedy_min_margin": round(margin, 6),
        "ppl": ppl,
        "mean_nll": nll,
        "logits_shape": [len(prompt_ids), int(logits.shape[1])],
        "logits": rows,
    }


def window_ppl(model: torch.nn.Module, ids: list[int], window: int) -> dict:
    """PPL under kvant's convention: non-overlapping windows of `window` tokens, each
    token after a window's first predicted from its prefix in that window (a last
    window under 2 tokens is dropped)."""
    total_nll, scored, windows = 0.0, 0, 0
    for start in range(0, len(ids), window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            continue
        logits = prompt_logits(model, chunk)
        _, mean = perplexity(logits, chunk)
        total_nll += mean * (len(chunk) - 1)
        scored += len(chunk) - 1
        windows += 1
    mean_nll = total_nll / scored
    return {"mean_nll": mean_nll, "ppl": math.exp(mean_nll), "tokens_scored": scored, "windows": windows}
