#!/usr/bin/env python3
"""Decode throughput of `kvant serve` with every request constrained to a JSON
schema against the same load unconstrained, on one server, on loopback.

One server runs for the whole benchmark. Each round sends the same list of
requests twice, once plain and once with `response_format` (a JSON schema),
from `--concurrency` closed-loop clients; which of the two goes first
alternates from round to round, so drift of the machine falls on both. Every
request samples at `--temperature` (default 1) with a fixed seed and asks for exactly
`--max-tokens` tokens: plain requests set `ignore_eos`, and the schema (an
array of at least 200 small objects) cannot be complete before that, so both
halves generate the same number of tokens and differ only in the grammar
mask each constrained token pays.

Reported: output tokens per second of each half (total completion tokens over
the half's wall time, prefill included, which is the same in both), the
median and spread over rounds, and the ratio constrained / plain (the issue's
target is at least 0.9 at 16 clients). Standard library only.

    python3 tools/bench/structured_load.py --model ~/.cache/kvant/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "Lima", "Osaka", "Accra"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "minItems": 200,
}

WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"kvant exited early with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    sys.exit("kvant did not get ready in time")


def run_half(url: str, bodies: list[dict], concurrency: int, timeout: float) -> tuple[float, int]:
    """(wall seconds, completion tokens) of sending `bodies` from `concurrency` clients."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        outs = list(ex.map(lambda b: post(url, b, timeout), bodies))
    wall = time.perf_counter() - t0
    return wall, sum(o["usage"]["completion_tokens"] for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.environ.get("KVANT_MODEL"), help="GGUF path (default: $KVANT_MODEL)")
    p.add_argument("--kvant-bin", default=str(REPO / "target" / "release" / "kvant"))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32, help="requests per half (default 32)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="1 (default) samples the whole vocabulary, where the mask also shrinks the sampler's work; "
        "0 is greedy, where only the mask's own cost shows",
    )
    p.add_argument("--request-timeout", type=float, default=600.0)
    a = p.parse_args()
    if not a.model:
        p.error("give --model or set KVANT_MODEL")

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="kvant-structured-", suffix=".log", delete=False)
    argv = [a.kvant_bin, "serve", "--model", a.model, "--port", str(port), "--threads", str(a.threads)]
    argv += ["--max-running", str(a.concurrency)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(base, proc, 300)
        url = base + "/v1/completions"
        rng = random.Random(0)
        plain = []
        for i in range(a.requests):
            prompt = "List people as JSON:" + "".join(" " + rng.choice(WORDS) for _ in range(a.prompt_words))
            plain.append(
                {
                    "prompt": prompt,
                    "max_tokens": a.max_tokens,
                    "temperature": a.temperature,
                    "seed": i,
                    "ignore_eos": True,
                }
            )
        constrained = [
            dict(b, response_format={"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}})
            for b in plain
        ]
        # Warm-up: the grammar tables are built on first use.
        post(url, dict(constrained[0], max_tokens=4), a.request_timeout)
        post(url, dict(plain[0], max_tokens=4), a.request_timeout)
        rates: dict[str, list[float]] = {"plain": [], "json_schema": []}
        for r in range(a.rounds):
            order = [("plain", plain), ("json_schema", constrained)]
            if r % 2:
                order.reverse()
            for name, bodies in order:
                wall, toks = run_half(url, bodies, a.concurrency, a.request_timeout)
                rates[name].append(toks / wall)
                print(f"round {r + 1} {name:12s} {toks} tokens in {wall:.2f} s: {toks / wall:.1f} tok/s", file=sys.stderr)
        print(f"### decode under load: {a.concurrency} clients, {a.requests} requests x {a.max_tokens} tokens, "
              f"{a.threads} threads, temperature {a.temperature:g}, medians of {a.rounds} rounds\n")
        print("| requests | out tok/s (median) | spread (min-max) |")
        print("|---|---:|---:|")
        for name, xs in rates.items():
            print(f"| {name} | {statistics.median(xs):.1f} | {min(xs):.1f}-{max(xs):.1f} |")
        ratios = [c / q for c, q in zip(rates["json_schema"], rates["plain"])]
        print(f"\nconstrained / plain, per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.3f}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
