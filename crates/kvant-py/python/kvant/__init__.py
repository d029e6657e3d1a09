"""kvant: fused training kernels for PyTorch on the CPU, and LLM inference.

- ``kvant.ops``: the kernels as functions (torch custom ops with autograd):
  ``rms_norm``, ``add_rms_norm``, ``layer_norm``, ``rope``, ``swiglu``,
  ``geglu``, ``cross_entropy``, ``linear_cross_entropy``, ``kl_div``,
  ``jsd``, ``linear_jsd``, ``flash_attn``.
- ``kvant.nn``: the same as ``torch.nn.Module``s.
- ``kvant.patch``: ``apply_kvant_kernel_to_llama()`` and friends swap them
  into Hugging Face models, as Liger's ``apply_liger_kernel_to_llama()``.
- ``kvant.LLM``: load a GGUF or Hugging Face checkpoint and generate or
  stream text.
"""

import os as _os
import warnings as _warnings

import torch as _torch

from . import _kvant
from ._kvant import LLM, TextStream, simd_tier

# kvant's ops run on torch's own OpenMP threads, as many as torch uses:
# torch's team spins for milliseconds after each torch op, and a second
# pool would share the cores with it. Without an OpenMP runtime in the
# process (or with KVANT_OWN_POOL=1), on a pool of kvant's own, sized the
# same.
try:
    _n = max(1, _torch.get_num_threads())
    if _os.environ.get("KVANT_OWN_POOL") == "1" or not _kvant.use_torch_threads(_n):
        _kvant.set_threads(_n)
except RuntimeError as e:  # the pool was started already, with another size
    _warnings.warn(f"kvant: {e}", RuntimeWarning, stacklevel=2)

from . import nn, ops, patch  # noqa: E402
from .patch import (  # noqa: E402
    apply_kvant_kernel_to_gemma3,
    apply_kvant_kernel_to_llama,
    apply_kvant_kernel_to_qwen2,
    apply_kvant_kernel_to_qwen3,
)

__all__ = [
    "LLM",
    "TextStream",
    "simd_tier",
    "ops",
    "nn",
    "patch",
    "apply_kvant_kernel_to_llama",
    "apply_kvant_kernel_to_qwen2",
    "apply_kvant_kernel_to_qwen3",
    "apply_kvant_kernel_to_gemma3",
]
