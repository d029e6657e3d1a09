#!/usr/bin/env python3
"""kvant against llama.cpp (and optionally transformers) on the same GGUF.

For every (model, thread count) the script measures llama.cpp either with
its own `llama-bench` (`--llama-bench PATH`, one process per test) or in this
process through the `llama_cpp` package of llama-cpp-python (one warm-up
first), and kvant with one `kvant bench --json --repetitions 1 --depth D`
subprocess per repetition and depth, alternating the engines. Alternating
spreads any drift of the machine (other load, thermal state) over both
sides. Medians over the repetitions are compared.

Both sides time the same work, at each depth D of `--depth` (default 0):
  context  D random token ids already in the cache, run through the model
           untimed (llama-bench's `-d D`; kvant bench's `--depth D`);
  prefill  one forward pass over `--prompt-tokens` random token ids (a seeded
           RNG over the vocabulary, as llama-bench does) after the context;
  decode   `--gen-tokens` one-token passes after the prompt, each fed the
           argmax of the previous logits (no sampler): positions D+P onwards
           (llama-bench: its tg test at depth D+P).
The ids differ between the two engines (each draws its own); the speed of a
forward pass does not depend on them. Each repetition runs every depth, one
engine after the other, the order swapped on odd repetitions; medians and
the spread (min-max) over the repetitions are reported per depth.

Decode speed is also reported as a fraction of the memory-bandwidth roofline,
`tok/s * bytes_per_token / bandwidth`, with kvant's measured read bandwidth
and its bytes per token at that depth (weights plus the KV cache its decode
steps read: every earlier position, or the window in a sliding-window layer,
in kvant's f16 cache) for both engines.

`--transformers-python PY` adds transformers' prefill speed on the same GGUF
(dequantized to float32 by transformers' loader), measured by
`transformers_prefill.py` under PY, which needs torch, transformers and gguf.

Run it under a Python with llama-cpp-python and numpy (see README.md), or
any Python 3 with --llama-bench:
  python tools/bench/compare_llamacpp.py --model M.gguf --threads 1,2
  python3 tools/bench/compare_llamacpp.py --llama-bench llama-bench --model M.gguf --threads 2 \
      --depth 512,4096,16384 --repetitions 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# Seed of llama.cpp's prompt ids: the same prompt in every repetition.
PROMPT_SEED = 0x6B76616E74
# Seed of its context-fill ids (llama_cpp package only; llama-bench draws its own).
FILL_SEED = 0x6B76616E75
# llama.cpp's KV cache is sized to the run plus this margin.
CTX_MARGIN = 16
# llama.cpp's batch is at least its default, so a short prompt is one batch too.
MIN_BATCH = 512


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="GGUF path; repeatable or a comma list")
    p.add_argument("--threads", default="1,2", help="comma list of thread counts (default 1,2)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--depth", default="0", help="comma list of context depths (tokens already in the "
                   "cache before each test; default 0)")
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--kvant", default=str(REPO / "target" / "release" / "kvant"), help="kvant binary")
    p.add_argument("--json-out", help="write every raw number to this JSON file")
    p.add_argument("--transformers-python", help="a Python with torch, transformers and gguf")
    p.add_argument("--llama-bench", help="measure llama.cpp with this llama-bench binary (C++, no Python "
                   "in the loop) instead of the llama_cpp package; see LlamaBench")
    p.add_argument("--llama-bench-args", default="-ctk f16 -ctv f16 -fa 1",
                   help="extra llama-bench arguments (default: f16 KV cache, flash attention, as kvant runs)")
    p.add_argument("--kvant-args", default="", help="extra `kvant bench` arguments")
    a = p.parse_args()
    a.models = [m for arg in a.model for m in arg.split(",") if m]
    try:
        a.thread_counts = [int(t) for t in a.threads.split(",") if t]
    except ValueError:
        p.error(f"--threads must be a comma list of integers, not {a.threads!r}")
    if not a.thread_counts or min(a.thread_counts) < 1:
        p.error("--threads needs at least one count, each at least 1")
    try:
        a.depths = [int(d) for d in a.depth.split(",") if d]
    except ValueError:
        p.error(f"--depth must be a comma list of integers, not {a.depth!r}")
    if not a.depths or min(a.depths) < 0:
        p.error("--depth needs at least one depth, each at least 0")
    if a.transformers_python and a.depths != [0]:
        p.error("--transformers-python measures prefill from an empty cache: use it with --depth 0")
    if a.prompt_tokens < 1 or a.gen_tokens < 1 or a.repetitions < 1:
        p.error("--prompt-tokens, --gen-tokens and --repetitions must be at least 1")
    for m in a.models:
        if not Path(m).is_file():
            p.error(f"no such model file: {m}")
    if not Path(a.kvant).is_file():
        p.error(f"no kvant binary at {a.kvant}: build it with `cargo build --release -p kvant` or pass --kvant")
    return a


class LlamaCpp:
    """One model loaded in llama.cpp (the llama_cpp package) for one thread
    count, with room for the deepest test."""

    def __init__(self, model: str, threads: int, prompt_tokens: int, gen_tokens: int, depth: int):
        import numpy as np
        import llama_cpp

        self.np = np
        self.llama_cpp = llama_cpp
        batch = max(prompt_tokens, MIN_BATCH)
        self.llm = llama_cpp.Llama(
            model_path=model,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=depth + prompt_tokens + gen_tokens + CTX_MARGIN,
            n_batch=batch,
            n_ubatch=batch,
            logits_all=False,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()
        rng = np.random.default_rng(PROMPT_SEED)
        self.prompt = [int(t) for t in rng.integers(0, self.n_vocab, size=prompt_tokens)]
        self.fill = [int(t) for t in np.random.default_rng(FILL_SEED).integers(0, self.n_vocab, size=depth)]
        self.gen_tokens = gen_tokens

    def _next(self) -> int:
        """Argmax of the last evaluated token's logits, read in place."""
        ptr = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def run(self, depth: int) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) of one repetition after `depth`
        context tokens (evaluated untimed, from an empty cache)."""
        self.llm.reset()
        if depth:
            self.llm.eval(self.fill[:depth])
        t0 = time.perf_counter()
        self.llm.eval(self.prompt)
        prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(self.gen_tokens):
            self.llm.eval([self._next()])
        decode = time.perf_counter() - t1
        return len(self.prompt) / prefill, self.gen_tokens / decode

    def version(self) -> str:
        return self.llama_cpp.__version__

    def close(self) -> None:
        self.llm.close()


class LlamaBench:
    """llama.cpp measured by its own `llama-bench` (one process per test,
    depth and repetition, `-r 1`, its own warm-up), the peer without the
    Python binding's per-token overhead. The prefill test runs at depth D
    (`-d D -p P -n 0`); the decode test at depth D+P (`-d D+P -p 0 -n G`:
    positions D+P.., after a prompt), as kvant bench decodes."""

    def __init__(self, binary: str, model: str, threads: int, prompt_tokens: int, gen_tokens: int,
                 extra: list[str]):
        self.binary = binary
        self.base = [binary, "-m", model, "-t", str(threads), "-r", "1", "-o", "json", *extra]
        self.prompt_tokens = prompt_tokens
        self.gen_tokens = gen_tokens

    @staticmethod
    def _rate(cmd: list[str]) -> float:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"llama-bench failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
        return json.loads(r.stdout)[0]["avg_ts"]

    def run(self, depth: int) -> tuple[float, float]:
        pp = self.base + ["-p", str(self.prompt_tokens), "-n", "0", "-d", str(depth)]
        tg = self.base + ["-p", "0", "-n", str(self.gen_tokens), "-d", str(depth + self.prompt_tokens)]
        return self._rate(pp), self._rate(tg)

    def version(self) -> str:
        r = subprocess.run([self.binary, "--version"], capture_output=True, text=True)
        return (r.stdout + r.stderr).strip().splitlines()[0] if (r.stdout + r.stderr).strip() else "unknown"

    def close(self) -> None:
        pass


def run_kvant(a: argparse.Namespace, model: str, threads: int, depth: int) -> dict:
    cmd = [
        a.kvant, "bench", "--json", "--model", model, "--threads", str(threads),
        "--prompt-tokens", str(a.prompt_tokens), "--gen-tokens", str(a.gen_tokens), "--repetitions", "1",
        "--depth", str(depth), *a.kvant_args.split(),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kvant failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    return json.loads(r.stdout)


def run_transformers(a: argparse.Namespace, model: str, threads: int) -> dict:
    cmd = [
        a.transformers_python, str(HERE / "transformers_prefill.py"), "--model", model, "--threads", str(threads),
        "--prompt-tokens", str(a.prompt_tokens), "--repetitions", str(a.repetitions),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"transformers failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def spread(runs: list[float]) -> dict:
    return {"runs": runs, "median": statistics.median(runs), "min": min(runs), "max": max(runs)}


def measure(a: argparse.Namespace, model: str, threads: int) -> list[dict]:
    """One result per depth for (model, threads)."""
    if a.llama_bench:
        lc = LlamaBench(a.llama_bench, model, threads, a.prompt_tokens, a.gen_tokens, a.llama_bench_args.split())
    else:
        lc = LlamaCpp(model, threads, a.prompt_tokens, a.gen_tokens, max(a.depths))
        lc.run(0)  # warm-up; every kvant bench run warms itself up
    a.llama_cpp_version = lc.version()
    lc_pp = {d: [] for d in a.depths}
    lc_tg = {d: [] for d in a.depths}
    kv_runs = {d: [] for d in a.depths}
    for rep in range(a.repetitions):
        for d in a.depths:
            # Alternate which engine goes first, so neither always runs on a
            # machine the other just warmed (or heated).
            for side in (("lc", "kv") if rep % 2 == 0 else ("kv", "lc")):
                if side == "lc":
                    pp, tg = lc.run(d)
                    lc_pp[d].append(pp)
                    lc_tg[d].append(tg)
                else:
                    kv_runs[d].append(run_kvant(a, model, threads, d))
            kv = kv_runs[d][-1]
            print(f"  {Path(model).name} t={threads} depth {d} rep {rep + 1}/{a.repetitions}: "
                  f"llama.cpp pp {lc_pp[d][-1]:.1f} tg {lc_tg[d][-1]:.1f}, kvant pp {kv['prefill_tokens_per_s']:.1f} "
                  f"tg {kv['decode_tokens_per_s']:.1f}", file=sys.stderr, flush=True)
    lc.close()
    results = []
    for d in a.depths:
        runs = kv_runs[d]
        bandwidth = statistics.median(r["bandwidth_bytes_per_s"] for r in runs)
        bytes_per_token = runs[0]["bytes_per_token"]
        res = {
            "model": model,
            "threads": threads,
            "depth": d,
            "bandwidth_bytes_per_s": bandwidth,
            "bytes_per_token": bytes_per_token,
            "llamacpp": {"prefill": spread(lc_pp[d]), "decode": spread(lc_tg[d])},
            "kvant": {"runs": runs,
                      "prefill": spread([r["prefill_tokens_per_s"] for r in runs]),
                      "decode": spread([r["decode_tokens_per_s"] for r in runs])},
        }
        for side in ("llamacpp", "kvant"):
            res[side]["decode_roofline_fraction"] = res[side]["decode"]["median"] * bytes_per_token / bandwidth
        if a.transformers_python:
            res["transformers"] = run_transformers(a, model, threads)
        results.append(res)
    return results


def print_table(a: argparse.Namespace, results: list[dict]) -> None:
    hf = a.transformers_python is not None

    def cell(x: dict) -> str:
        return f"{x['median']:.1f} ({x['min']:.1f}-{x['max']:.1f})"

    cols = ["model", "thr", "depth", "BW GB/s", f"pp{a.prompt_tokens} llama.cpp", "kvant", "kv/lc"]
    if hf:
        cols += ["transformers", "kv/hf"]
    cols += [f"tg{a.gen_tokens} llama.cpp", "kvant", "kv/lc", "roof% lc", "roof% kv"]
    rows = []
    for r in results:
        lc, kv = r["llamacpp"], r["kvant"]
        row = [Path(r["model"]).name, str(r["threads"]), str(r["depth"]), f"{r['bandwidth_bytes_per_s'] / 1e9:.1f}",
               cell(lc["prefill"]), cell(kv["prefill"]),
               f"{kv['prefill']['median'] / lc['prefill']['median']:.2f}"]
        if hf:
            t = r["transformers"]["prefill_tokens_per_s"]
            row += [f"{t:.1f}", f"{kv['prefill']['median'] / t:.2f}"]
        row += [cell(lc["decode"]), cell(kv["decode"]),
                f"{kv['decode']['median'] / lc['decode']['median']:.2f}",
                f"{100 * lc['decode_roofline_fraction']:.1f}", f"{100 * kv['decode_roofline_fraction']:.1f}"]
        rows.append(row)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print(f"medians (min-max) of {a.repetitions} alternating repetitions; tok/s; prefill after `depth` tokens, "
          f"decode after depth + {a.prompt_tokens}; roof% = decode tok/s x bytes/token / measured read bandwidth")
    for line in [cols, *rows]:
        print("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths))))


def main() -> None:
    a = parse_args()
    results = [r for m in a.models for t in a.thread_counts for r in measure(a, m, t)]
    print_table(a, results)
    if a.json_out:
        config = {k: getattr(a, k) for k in ("prompt_tokens", "gen_tokens", "depths", "repetitions", "kvant",
                                             "llama_bench", "llama_bench_args", "kvant_args")}
        config["llama_cpp_version"] = a.llama_cpp_version
        config["cpu_count"] = os.cpu_count()
        Path(a.json_out).write_text(json.dumps({"config": config, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
