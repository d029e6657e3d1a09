#!/usr/bin/env python3
"""kvant against llama.cpp (and optionally transformers) on the same GGUF.

For every (model, thread count) the script loads the model in llama.cpp (the
`llama_cpp` package of llama-cpp-python), runs one warm-up, then alternates
repetitions: one llama.cpp run in this process, one `kvant bench --json
--repetitions 1` run in a subprocess. Alternating spreads any drift of the
machine (other load, thermal state) over both sides. Medians over the
repetitions are compared.

Both sides time the same work:
  prefill  one forward pass over `--prompt-tokens` random token ids (a seeded
           RNG over the vocabulary, as llama-bench does) into an empty cache;
  decode   `--gen-tokens` one-token passes after it, each fed the argmax of
           the previous logits (no sampler).
The ids differ between the two engines (each draws its own); the speed of a
forward pass does not depend on them.

Decode speed is also reported as a fraction of the memory-bandwidth roofline,
`tok/s * bytes_per_token / bandwidth`, with kvant's measured read bandwidth
and its bytes per token (weights plus the f32 KV cache at the mean decode
position) for both engines; llama.cpp's f16 KV cache reads a little less, so
its fraction is a slight overestimate.

`--transformers-python PY` adds transformers' prefill speed on the same GGUF
(dequantized to float32 by transformers' loader), measured by
`transformers_prefill.py` under PY, which needs torch, transformers and gguf.

Run it under a Python with llama-cpp-python and numpy (see README.md):
  python tools/bench/compare_llamacpp.py --model M.gguf --threads 1,2
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

import numpy as np
import llama_cpp

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# Seed of llama.cpp's prompt ids: the same prompt in every repetition.
PROMPT_SEED = 0x6B76616E74
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
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--kvant", default=str(REPO / "target" / "release" / "kvant"), help="kvant binary")
    p.add_argument("--json-out", help="write every raw number to this JSON file")
    p.add_argument("--transformers-python", help="a Python with torch, transformers and gguf")
    p.add_argument("--llama-bench", help="measure llama.cpp with this llama-bench binary (C++, no Python "
                   "in the loop) instead of the llama_cpp package; see LlamaBench")
    a = p.parse_args()
    a.models = [m for arg in a.model for m in arg.split(",") if m]
    try:
        a.thread_counts = [int(t) for t in a.threads.split(",") if t]
    except ValueError:
        p.error(f"--threads must be a comma list of integers, not {a.threads!r}")
    if not a.thread_counts or min(a.thread_counts) < 1:
        p.error("--threads needs at least one count, each at least 1")
    if a.prompt_tokens < 1 or a.gen_tokens < 1 or a.repetitions < 1:
        p.error("--prompt-tokens, --gen-tokens and --repetitions must be at least 1")
    for m in a.models:
        if not Path(m).is_file():
            p.error(f"no such model file: {m}")
    if not Path(a.kvant).is_file():
        p.error(f"no kvant binary at {a.kvant}: build it with `cargo build --release -p kvant` or pass --kvant")
    return a


class LlamaCpp:
    """One model loaded in llama.cpp for one thread count."""

    def __init__(self, model: str, threads: int, prompt_tokens: int, gen_tokens: int):
        batch = max(prompt_tokens, MIN_BATCH)
        self.llm = llama_cpp.Llama(
            model_path=model,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=prompt_tokens + gen_tokens + CTX_MARGIN,
            n_batch=batch,
            n_ubatch=batch,
            logits_all=False,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()
        rng = np.random.default_rng(PROMPT_SEED)
        self.prompt = [int(t) for t in rng.integers(0, self.n_vocab, size=prompt_tokens)]
        self.gen_tokens = gen_tokens

    def _next(self) -> int:
        """Argmax of the last evaluated token's logits, read in place."""
        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def run(self) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) of one repetition from an empty cache."""
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(self.prompt)
        prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(self.gen_tokens):
            self.llm.eval([self._next()])
        decode = time.perf_counter() - t1
        return len(self.prompt) / prefill, self.gen_tokens / decode

    def close(self) -> None:
        self.llm.close()


class LlamaBench:
    """llama.cpp measured by its own `llama-bench` (one process per test
    and repetition, `-r 1`, its own warm-up), the peer without the Python
    binding's per-token overhead. The decode test runs at depth P
    (`-d P`: positions P..P+N, after a prompt), as kvant bench decodes."""

    def __init__(self, binary: str, model: str, threads: int, prompt_tokens: int, gen_tokens: int):
        base = [binary, "-m", model, "-t", str(threads), "-r", "1", "-o", "json"]
        self.pp = base + ["-p", str(prompt_tokens), "-n", "0"]
        self.tg = base + ["-p", "0", "-n", str(gen_tokens), "-d", str(prompt_tokens)]

    @staticmethod
    def _rate(cmd: list[str]) -> float:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"llama-bench failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
        return json.loads(r.stdout)[0]["avg_ts"]

    def run(self) -> tuple[float, float]:
        return self._rate(self.pp), self._rate(self.tg)

    def close(self) -> None:
        pass


def run_kvant(a: argparse.Namespace, model: str, threads: int) -> dict:
    cmd = [
        a.kvant, "bench", "--json", "--model", model, "--threads", str(threads),
        "--prompt-tokens", str(a.prompt_tokens), "--gen-tokens", str(a.gen_tokens), "--repetitions", "1",
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


def measure(a: argparse.Namespace, model: str, threads: int) -> dict:
    if a.llama_bench:
        lc = LlamaBench(a.llama_bench, model, threads, a.prompt_tokens, a.gen_tokens)
    else:
        lc = LlamaCpp(model, threads, a.prompt_tokens, a.gen_tokens)
        lc.run()  # warm-up; every kvant bench run warms itself up
    lc_pp, lc_tg, kv_runs = [], [], []
    for rep in range(a.repetitions):
        pp, tg = lc.run()
        lc_pp.append(pp)
        lc_tg.append(tg)
        kv_runs.append(run_kvant(a, model, threads))
        print(f"  {Path(model).name} t={threads} rep {rep + 1}/{a.repetitions}: "
              f"llama.cpp pp {pp:.1f} tg {tg:.1f}, kvant pp {kv_runs[-1]['prefill_tokens_per_s']:.1f} "
              f"tg {kv_runs[-1]['decode_tokens_per_s']:.1f}", file=sys.stderr)
    lc.close()
    bandwidth = statistics.median(r["bandwidth_bytes_per_s"] for r in kv_runs)
    bytes_per_token = kv_runs[0]["bytes_per_token"]
    res = {
        "model": model,
        "threads": threads,
        "bandwidth_bytes_per_s": bandwidth,
        "bytes_per_token": bytes_per_token,
        "llamacpp": {"prefill_runs": lc_pp, "decode_runs": lc_tg,
                     "prefill_tokens_per_s": statistics.median(lc_pp),
                     "decode_tokens_per_s": statistics.median(lc_tg)},
        "kvant": {"runs": kv_runs,
                  "prefill_tokens_per_s": statistics.median(r["prefill_tokens_per_s"] for r in kv_runs),
                  "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in kv_runs)},
    }
    for side in ("llamacpp", "kvant"):
        res[side]["decode_roofline_fraction"] = res[side]["decode_tokens_per_s"] * bytes_per_token / bandwidth
    if a.transformers_python:
        res["transformers"] = run_transformers(a, model, threads)
    return res


def print_table(a: argparse.Namespace, results: list[dict]) -> None:
    hf = a.transformers_python is not None
    cols = ["model", "thr", "BW GB/s", f"pp{a.prompt_tokens} llama.cpp", "kvant", "kv/lc"]
    if hf:
        cols += ["transformers", "kv/hf"]
    cols += [f"tg{a.gen_tokens} llama.cpp", "kvant", "kv/lc", "roof% lc", "roof% kv"]
    rows = []
    for r in results:
        lc, kv = r["llamacpp"], r["kvant"]
        row = [Path(r["model"]).name, str(r["threads"]), f"{r['bandwidth_bytes_per_s'] / 1e9:.1f}",
               f"{lc['prefill_tokens_per_s']:.1f}", f"{kv['prefill_tokens_per_s']:.1f}",
               f"{kv['prefill_tokens_per_s'] / lc['prefill_tokens_per_s']:.2f}"]
        if hf:
            t = r["transformers"]["prefill_tokens_per_s"]
            row += [f"{t:.1f}", f"{kv['prefill_tokens_per_s'] / t:.2f}"]
        row += [f"{lc['decode_tokens_per_s']:.1f}", f"{kv['decode_tokens_per_s']:.1f}",
                f"{kv['decode_tokens_per_s'] / lc['decode_tokens_per_s']:.2f}",
                f"{100 * lc['decode_roofline_fraction']:.1f}", f"{100 * kv['decode_roofline_fraction']:.1f}"]
        rows.append(row)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print(f"medians of {a.repetitions} alternating repetitions; tok/s; "
          f"roof% = decode tok/s x bytes/token / measured read bandwidth")
    for line in [cols, *rows]:
        print("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths))))


def main() -> None:
    a = parse_args()
    results = [measure(a, m, t) for m in a.models for t in a.thread_counts]
    print_table(a, results)
    if a.json_out:
        config = {k: getattr(a, k) for k in ("prompt_tokens", "gen_tokens", "repetitions", "kvant")}
        config["llama_cpp_version"] = llama_cpp.__version__
        config["cpu_count"] = os.cpu_count()
        Path(a.json_out).write_text(json.dumps({"config": config, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
