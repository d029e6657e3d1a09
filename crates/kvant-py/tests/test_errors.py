"""Bad input is a clear Python exception, never a crash or a wrong answer."""

import os
import subprocess
import sys

import pytest
import torch

import kvant
from kvant import _kvant, ops


def test_dtype_device_shape_errors():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="float32 and torch.bfloat16"):
        ops.rms_norm(x.double(), torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="CPU"):
        ops.rms_norm(x.to("meta"), torch.ones(8, device="meta"))
    with pytest.raises(ValueError, match="weight has shape"):
        ops.rms_norm(x, torch.ones(7))
    with pytest.raises(TypeError, match="one dtype"):
        ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="int64"):
        ops.cross_entropy(x, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="reduction"):
        ops.cross_entropy(x, torch.zeros(4, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="multiple"):
        ops.flash_attn(torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))


def test_native_checks_hold_without_the_wrappers():
    x = torch.randn(4, 8)
    w = torch.ones(8)
    rstd = torch.empty(4)
    # Output aliasing an input: refused.
    with pytest.raises(ValueError, match="share memory"):
        _kvant.rms_norm_fwd(x, w, x, rstd, 1e-6, 0.0, "llama")
    # Non-contiguous input: refused.
    with pytest.raises(ValueError, match="contiguous"):
        _kvant.rms_norm_fwd(torch.randn(8, 4).t(), w, torch.empty(4, 8), rstd, 1e-6, 0.0, "llama")
    # Wrong sizes: the kernel's own check.
    with pytest.raises(ValueError):
        _kvant.rms_norm_fwd(x, torch.ones(5), torch.empty(4, 8), rstd, 1e-6, 0.0, "llama")
    with pytest.raises(ValueError):
        _kvant.rms_norm_fwd(x, w, torch.empty(4, 8), torch.empty(3), 1e-6, 0.0, "llama")
    with pytest.raises(ValueError, match="casting"):
        _kvant.rms_norm_fwd(x, w, torch.empty(4, 8), rstd, 1e-6, 0.0, "t5")
    with pytest.raises(TypeError):
        _kvant.rms_norm_fwd(x, "w", torch.empty(4, 8), rstd, 1e-6, 0.0, "llama")


def test_native_size_errors_name_the_shapes():
    """A size mismatch the kernel finds states the shapes passed, not
    only the flattened lengths it compared."""
    logits = torch.randn(5, 1001)
    with pytest.raises(ValueError, match=r"shapes: logits \[5, 1001\], target \[5\], losses \[5\], grad \[7, 1001\]"):
        _kvant.cross_entropy_fwd(
            logits, torch.zeros(5, dtype=torch.long), torch.empty(5), torch.empty(7, 1001), -100, 0.0, 0.0, None, "mean"
        )


def test_overlapping_rope_rows_are_refused():
    base = torch.randn(64)
    x = base.as_strided((1, 2, 4, 8), (0, 4, 8, 1))  # heads overlap
    c = torch.ones(1, 4, 4)
    with pytest.raises(ValueError):
        _kvant.rope_apply(x, None, c, c, 8, False, False)
    # Out of place: the output must have x's layout.
    y = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="strides"):
        _kvant.rope_apply(y, torch.empty(1, 4, 2, 8).transpose(1, 2), c, c, 8, False, False)
    with pytest.raises(ValueError):
        _kvant.rope_apply(y, y, c, c, 8, False, False)


def test_threads_follow_torch():
    assert kvant._kvant.threads() == max(1, torch.get_num_threads())
    assert kvant.simd_tier() in ("scalar", "avx2", "avx512")


def test_ops_run_on_torchs_openmp_threads():
    """With torch's OpenMP runtime in the process, kvant starts no threads
    of its own: its jobs run on torch's team (kvant/__init__.py)."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs Linux's /proc")
    x = torch.randn(256, 1024, requires_grad=True)
    y = ops.layer_norm(x, torch.ones(1024), torch.zeros(1024))
    y.sum().backward()
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    assert not [n for n in names if n.startswith("kvant-worker")], names
    # The same values as on a pool of kvant's own, in a fresh process.
    code = (
        "import os, torch, kvant; torch.manual_seed(0); x = torch.randn(256, 1024);"
        "print(kvant.ops.layer_norm(x, torch.ones(1024), torch.zeros(1024)).sum().item());"
        "print(sum(open(f'/proc/self/task/{t}/comm').read().startswith('kvant-worker')"
        " for t in os.listdir('/proc/self/task')) > 0)"
    )
    env = dict(os.environ, KVANT_OWN_POOL="1")
    own = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    team = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    (own_sum, own_workers), (team_sum, team_workers) = own.stdout.split(), team.stdout.split()
    assert own_sum == team_sum
    if torch.get_num_threads() > 1:
        assert (own_workers, team_workers) == ("True", "False")
