"""kvant's training kernels against torch eager and torch.compile on the CPU.

Same thread count for every engine (torch.set_num_threads; kvant's pool
follows it), warm-up, then the median (and min-max) of --reps timed runs in
Liger's three modes: forward, backward (the graph kept, backward repeated)
and full (forward + backward). Engines alternate within each repetition so
a drift of the machine hits all of them alike. Each kernel's bytes moved
(inputs read + outputs written, by the fused algorithm's count) over the
time give GB/s, reported against the copy bandwidth measured here.

    python tools/bench/train_kernels.py [--ops rms_norm,rope,...] [--threads 2]
        [--reps 10] [--no-compile] [--json-out FILE]
    python tools/bench/train_kernels.py --memory flce --n 8192 --h 4096 --v 128256

--memory runs one full step of the fused linear cross-entropy (or the
eager / chunked torch peers) in a fresh process per engine and reports the
peak RSS beyond the inputs, weights and gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# torch's CPU allocator maps every large output afresh, and on 4 KiB pages
# the first touch of a 64 MiB output costs more than a norm over it (measured
# here: 28 ms of faults against 5 ms of kernel). Huge pages (torch's own
# switch, read when torch loads) take that off both engines alike.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def copy_bandwidth(mb=1024, reps=5):
    """STREAM copy: bytes read + written per second, median of reps."""
    n = mb * (1 << 20) // 4
    a, b = torch.randn(n), torch.empty(n)
    b.copy_(a)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        ts.append(time.perf_counter() - t)
    return 2 * n * 4 / statistics.median(ts)


def timeit(fn, reps, warm=2):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return ts


def modes(make):
    """forward / backward / full callables of one engine on fresh inputs.
    `make()` returns (inputs requiring grad, f(*inputs) -> output).

    Gradients are taken with ``torch.autograd.grad``, as a layer's inputs
    receive them inside a model (they are activations, not leaves): a
    leaf's ``.grad`` would add a copy of any gradient that shares memory
    with a saved tensor (kvant's in-place GLU backward, Liger's trick)."""
    inputs, f = make()

    def fwd():
        with torch.enable_grad():
            f(*inputs)

    state = {}

    def prep():
        out = f(*inputs)
        state["out"], state["g"] = out, torch.ones_like(out) if out.dim() else None

    def bwd():
        torch.autograd.grad(state["out"], inputs, state["g"], retain_graph=True)

    def full():
        out = f(*inputs)
        torch.autograd.grad(out, inputs, torch.ones_like(out) if out.dim() else None)

    return fwd, prep, bwd, full


def ops_table(dtype):
    import kvant

    k = kvant.ops
    bs = 2 if dtype == torch.bfloat16 else 4

    def rms(x, w):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h.to(x.dtype)

    def rope_ref(q, kk, cos, sin):
        def rh(x):
            h = x.shape[-1] // 2
            return torch.cat([-x[..., h:], x[..., :h]], -1)

        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat([(q * c + rh(q) * s).flatten(), (kk * c + rh(kk) * s).flatten()])

    def tables(b, s, d):
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
        f = torch.arange(s).float()[:, None] * inv
        e = torch.cat([f, f], -1)[None].expand(b, s, d)
        return e.cos().to(dtype).contiguous(), e.sin().to(dtype).contiguous()

    N, H = 4096, 4096
    I = 11008
    B, HQ, HK, S, D = 4, 32, 8, 512, 128
    CE_N, V = 4096, 32000

    def rg(*shape, scale=1.0):
        return (torch.randn(*shape) * scale).to(dtype).requires_grad_()

    def glu_ref(a, b):
        return F.silu(a) * b

    table = {
        # name: (make(engine) -> (inputs, f), bytes (fwd, bwd))
        "rms_norm": (
            lambda eng: (
                [rg(N, H), rg(H)],
                (lambda x, w: k.rms_norm(x, w)) if eng == "kvant" else rms,
            ),
            (2 * N * H * bs, 3 * N * H * bs),
        ),
        "layer_norm": (
            lambda eng: (
                [rg(N, H), rg(H), rg(H)],
                (lambda x, w, b: k.layer_norm(x, w, b)) if eng == "kvant" else (lambda x, w, b: F.layer_norm(x, (H,), w, b)),
            ),
            (2 * N * H * bs, 3 * N * H * bs),
        ),
        "rope": (
            lambda eng: (
                [rg(B, HQ, S, D), rg(B, HK, S, D)],
                (lambda q, kk, t=tables(B, S, D): torch.cat([o.flatten() for o in k.rope(q, kk, *t)]))
                if eng == "kvant"
                else (lambda q, kk, t=tables(B, S, D): rope_ref(q, kk, *t)),
            ),
            (2 * B * (HQ + HK) * S * D * bs, 2 * B * (HQ + HK) * S * D * bs),
        ),
        "swiglu": (
            lambda eng: ([rg(N, I), rg(N, I)], k.swiglu if eng == "kvant" else glu_ref),
            (3 * N * I * bs, 5 * N * I * bs),
        ),
        "geglu": (
            lambda eng: (
                [rg(N, I), rg(N, I)],
                k.geglu if eng == "kvant" else (lambda a, b: F.gelu(a, approximate="tanh") * b),
            ),
            (3 * N * I * bs, 5 * N * I * bs),
        ),
        "cross_entropy": (
            lambda eng, t=torch.randint(0, V, (CE_N,)): (
                [rg(CE_N, V, scale=4)],
                (lambda x: k.cross_entropy(x, t)) if eng == "kvant" else (lambda x: F.cross_entropy(x, t)),
            ),
            # fused: read twice + write the gradient once, in the forward
            (3 * CE_N * V * bs, 2 * CE_N * V * bs),
        ),
        "flash_attn": (
            lambda eng: (
                [rg(1, 16, 2048, 64), rg(1, 4, 2048, 64), rg(1, 4, 2048, 64)],
                (lambda q, kk, v: k.flash_attn(q, kk, v, causal=True))
                if eng == "kvant"
                else (lambda q, kk, v: F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)),
            ),
            (0, 0),
        ),
        "linear_cross_entropy": (
            lambda eng, t=torch.randint(0, V, (2048,)): (
                [rg(2048, 1024), rg(V, 1024, scale=1 / 32)],
                (lambda x, w: k.linear_cross_entropy(x, w, t))
                if eng == "kvant"
                else (lambda x, w: F.cross_entropy(F.linear(x, w).float(), t)),
            ),
            (0, 0),
        ),
    }
    if hasattr(F, "linear_cross_entropy"):
        table["torch_chunked_lce"] = (
            lambda eng, t=torch.randint(0, V, (2048,)): (
                [rg(2048, 1024), rg(V, 1024, scale=1 / 32)],
                (lambda x, w: k.linear_cross_entropy(x, w, t))
                if eng == "kvant"
                else (lambda x, w: F.linear_cross_entropy(x, w, t)),
            ),
            (0, 0),
        )
    return table


def bench_ops(args):
    torch.set_num_threads(args.threads)
    import kvant  # noqa: F401  (sizes its pool from torch's thread count)

    bw = copy_bandwidth()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    table = ops_table(dtype)
    names = args.ops.split(",") if args.ops else list(table)
    engines = ["kvant", "eager"] + ([] if args.no_compile else ["compile"])
    results = {"threads": args.threads, "dtype": args.dtype, "copy_GBps": bw / 1e9, "ops": {}}
    print(f"# {args.threads} threads, {args.dtype}, copy bandwidth {bw / 1e9:.1f} GB/s", file=sys.stderr)
    for name in names:
        make, (bf, bb) = table[name]
        fns = {}
        for eng in engines:
            if eng == "compile":
                inputs, f = make("eager")
                f = torch.compile(f)
                fns[eng] = modes(lambda inputs=inputs, f=f: (inputs, f))
            else:
                fns[eng] = modes(lambda eng=eng: make(eng))
        times = {eng: {"forward": [], "backward": [], "full": []} for eng in engines}
        for eng in engines:  # warm-up (and compile)
            fwd, prep, bwd, full = fns[eng]
            fwd(), prep(), bwd(), full()
        for _ in range(args.reps):
            for eng in engines:
                fwd, prep, bwd, full = fns[eng]
                times[eng]["forward"] += timeit(fwd, 1, warm=0)
                prep()
                times[eng]["backward"] += timeit(bwd, 1, warm=0)
                times[eng]["full"] += timeit(full, 1, warm=0)
        row = {}
        for eng in engines:
            row[eng] = {m: {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t), "max_ms": 1e3 * max(t)} for m, t in times[eng].items()}
        kf = row["kvant"]
        gbps = {"forward": bf / (kf["forward"]["median_ms"] / 1e3) / 1e9, "backward": bb / (kf["backward"]["median_ms"] / 1e3) / 1e9}
        if bf:
            row["kvant_GBps"] = gbps
        results["ops"][name] = row
        line = f"{name:14s}"
        for m in ("forward", "backward", "full"):
            k = kf[m]["median_ms"]
            line += f" | {m} {k:8.2f} ms"
            for eng in engines[1:]:
                line += f" {eng} x{row[eng][m]['median_ms'] / k:5.2f}"
        if bf:
            line += f" | fwd {gbps['forward']:.1f} GB/s ({100 * gbps['forward'] * 1e9 / bw:.0f}%), bwd {gbps['backward']:.1f} GB/s ({100 * gbps['backward'] * 1e9 / bw:.0f}%)"
        print(line, flush=True)
    if args.json_out:
        json.dump(results, open(args.json_out, "w"), indent=1)


# ------------------------------------------------------------ memory (FLCE)


def current_rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss():
    """Linux: VmHWM restarts from the current RSS (clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise SystemExit("no VmHWM in /proc/self/status")


def memory_child(args):
    """One full FLCE step of one engine; prints JSON with the time and the
    peak RSS beyond inputs, weight and the gradients the step leaves.

    Gradients start as None (``optimizer.zero_grad()``'s default since torch
    2.0), so each engine's weight gradient becomes ``.grad`` and is counted
    as a gradient, not as a temporary. The peak is VmHWM reset after the
    set-up; the parent runs this with glibc's mmap threshold at 64 KiB so
    that freed buffers leave the RSS at once."""
    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.engine == "kvant":
        import kvant

    def step(x, w, t):
        if args.engine == "kvant":
            loss = kvant.ops.linear_cross_entropy(x, w, t)
        elif args.engine == "eager":
            loss = F.cross_entropy(F.linear(x, w).float(), t)
        elif args.engine == "chunked":
            loss = F.linear_cross_entropy(x, w, t)
        else:
            raise SystemExit(f"unknown engine {args.engine}")
        loss.backward()
        return loss

    torch.manual_seed(0)
    # A tiny step first: the code the engine runs is paged in (about 150 MB
    # of torch's libraries on the first custom op) before the baseline.
    step(torch.randn(8, 16, dtype=dtype, requires_grad=True), torch.randn(32, 16, dtype=dtype, requires_grad=True), torch.randint(0, 32, (8,)))
    x = (torch.randn(args.n, args.h) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(args.v, args.h) / args.h**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, args.v, (args.n,))
    base = current_rss_mb()
    reset_peak_rss()
    t0 = time.perf_counter()
    loss = step(x, w, t)
    dt = time.perf_counter() - t0
    grads_mb = sum(p.grad.numel() * p.grad.element_size() for p in (x, w)) / 2**20
    peak = peak_rss_mb() - base
    print(
        json.dumps(
            {
                "engine": args.engine,
                "seconds": dt,
                "peak_beyond_inputs_mb": peak,
                "gradients_mb": grads_mb,
                "peak_extra_mb": peak - grads_mb,
                "loss": loss.item(),
            }
        )
    )


def bench_memory(args):
    out = {}
    engines = ["kvant", "eager"] + (["chunked"] if hasattr(F, "linear_cross_entropy") else [])
    for eng in engines:
        cmd = [sys.executable, __file__, "--memory-child", "--engine", eng, "--n", str(args.n), "--h", str(args.h), "--v", str(args.v), "--threads", str(args.threads), "--dtype", args.dtype]
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            print(f"{eng}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
            continue
        out[eng] = json.loads(r.stdout.strip().splitlines()[-1])
        print(json.dumps(out[eng]), flush=True)
    if args.json_out:
        json.dump(out, open(args.json_out, "w"), indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--json-out")
    p.add_argument("--memory", choices=["flce"])
    p.add_argument("--memory-child", action="store_true")
    p.add_argument("--engine", default="kvant")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--h", type=int, default=4096)
    p.add_argument("--v", type=int, default=128256)
    args = p.parse_args()
    if args.memory_child:
        memory_child(args)
    elif args.memory:
        bench_memory(args)
    else:
        bench_ops(args)


if __name__ == "__main__":
    main()
