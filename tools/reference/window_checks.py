"""Proofs that the sliding-window fixtures really exercise a window, and which one.

A sliding-window fixture is only useful if transformers applied the window when
it computed the reference, so the script checks, on the CPU eager path it uses:
  * with the window removed, positions before the window edge are unchanged and
    later positions change (the window is active);
  * in a one-layer copy, the output at position p equals a full-attention run
    over ids[p - W + 1 ..= p] at the same rope positions, i.e. a query attends to
    itself and the W - 1 tokens before it (not W before it).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from transformers import AutoModelForCausalLM

# Same weights, same keys, different masks: anything above float32 noise is a
# real difference, anything below it is none.
SAME_TOL = 1e-5
DIFFERENT_TOL = 1e-3


def _with_config(model: torch.nn.Module, edit) -> torch.nn.Module:
    cfg = copy.deepcopy(model.config)
    edit(cfg)
    other = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    state = {k: v for k, v in model.state_dict().items() if k in other.state_dict()}
    other.load_state_dict(state, strict=True)
    return other


def _logits(model: torch.nn.Module, ids: list[int], positions: list[int] | None = None) -> np.ndarray:
    kwargs = {} if positions is None else {"position_ids": torch.tensor([positions])}
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False, **kwargs).logits[0].numpy()


def _no_window(cfg) -> None:
    # A window longer than any sequence, rather than None: Gemma 3 always builds
    # its local-layer mask, and its local layers must keep their own rope base.
    cfg.sliding_window = 1 << 20


def check_window_active(model: torch.nn.Module, ids: list[int]) -> None:
    window = model.config.sliding_window
    if window is None or window >= len(ids):
        raise AssertionError("the prompt must be longer than the sliding window")
    full = _logits(_with_config(model, _no_window), ids)
    windowed = _logits(model, ids)
    before = float(np.abs(full[:window] - windowed[:window]).max())
    after = float(np.abs(full[window:] - windowed[window:]).max(axis=1).min())
    if before > SAME_TOL:
        raise AssertionError(f"positions inside the window changed by {before}")
    if after < DIFFERENT_TOL:
        raise AssertionError(f"some position past the window did not change ({after}): window not applied")


def check_window_semantics(model: torch.nn.Module, ids: list[int]) -> None:
    """One-layer copy: windowed output at p == full attention over the last W tokens."""
    window = model.config.sliding_window

    def one_layer(cfg) -> None:
        cfg.num_hidden_layers = 1
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = cfg.layer_types[:1]

    single = _with_config(model, one_layer)
    unwindowed = _with_config(single, _no_window)
    windowed = _logits(single, ids)
    for p in range(window, len(ids)):
        lo = p - window + 1
        alone = _logits(unwindowed, ids[lo : p + 1], list(range(lo, p + 1)))[-1]
        diff = float(np.abs(alone - windowed[p]).max())
        if diff > SAME_TOL:
            raise AssertionError(f"position {p}: window is not 'self + {window - 1} previous' (diff {diff})")
