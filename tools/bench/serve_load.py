#!/usr/bin/env python3
"""Load test of `kvant serve` against llama.cpp's server, on loopback.

For every concurrency level (default 1, 4, 16, 64) and repetition, the script
starts each server in turn on a free loopback port, waits until it is ready,
sends one unmeasured warm-up request, then runs a closed loop: `concurrency`
clients each take the next request of a fixed list and send it as a streaming
`/v1/completions` call (server-sent events) until the list is empty. The
server is stopped before the next one starts, so the servers never compete for
the cores, and alternating them per level spreads any drift of the machine
(other load, thermal state) over all of them. Each level restarts the servers
because llama.cpp's `llama-server` fixes its number of parallel slots at start
(`--parallel` = the level's concurrency, with continuous batching and a
context of slots x per-slot context).

Workloads (the request list is seeded, identical for every server):
  mixed   prompts of 32-512 tokens and max_tokens 16-256, both uniform;
  prefix  every prompt is one shared ~1,000-token prefix plus a short unique
          suffix; kvant runs twice, with its prefix cache on and with
          `--no-prefix-caching`, and llama.cpp (which reuses a slot's cached
          prompt) is the reference. The columns to read are TTFT and the
          share of prompt tokens the server reports as cached
          (`usage.prompt_tokens_details.cached_tokens`, "—" if it does not).
          The first requests of a level find the prefix uncached (the
          warm-up prompt shares none of it), so p99 shows the cold prefill.
Prompts are words of a fixed list, each one token (with its leading space) in
SmolLM2's tokenizer, so N words are N prompt tokens there; other tokenizers
may differ a little, and the JSON keeps the server-reported prompt tokens.
Every request has temperature 0, `ignore_eos: true` (so each runs to its
max_tokens where the server honours it) and `stream_options.include_usage`.

Measured per level, over the successful requests:
  req/s       requests / wall time (first send to last finish);
  out tok/s   output tokens / wall time; a request's tokens are its
              server-reported `usage.completion_tokens` when the stream has it,
              else its count of non-empty content chunks;
  TTFT        send to first non-empty content chunk, p50 and p99;
  ITL         gaps between consecutive non-empty content chunks of a request,
              pooled over all requests, p50 and p99 (a chunk holding several
              tokens counts once, so such a server shows longer gaps);
  errors      HTTP errors, error events, broken or timed-out streams, and
              streams without content or without a finish_reason (cut short).
With `--repetitions R` each figure is the median over the R repetitions.
Percentiles interpolate linearly between order statistics.

Markdown tables go to stdout, progress and server failures to stderr; `--json
PATH` keeps every raw number (each request's TTFT, gaps and token counts).
If kvant cannot start (no binary, no `serve` subcommand, an early exit), the
script says so and carries on with the other servers.

Run it under a Python with aiohttp (see README.md):
  python tools/bench/serve_load.py --model M.gguf --threads 2 \\
      --servers kvant,llamacpp --concurrency 1,4,16,64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_LLAMA_SERVER = Path("/tmp/llama-server-build/build/bin/llama-server")

# Words that are each exactly one token, with their leading space, in
# SmolLM2's gpt2-style BPE (checked with `kvant tokenize`); a prompt of N of
# them is N tokens there.
WORDS = (
    "the of and to in is was for on that with as by at from his her they this which be are or an "
    "had not but it have were all one their said there we been if more when will would who so no "
    "out up into do than can time two may then these only other new some could see over such our "
    "first its like people me now just him made after also years year did many before must through "
    "back where much your way well down should because each those even most state world still life "
    "work old last part between off long great under here day house man while government since "
    "against never three however both know again take might good same another place around small"
).split()

# The warm-up request: short, and no prefix of any measured prompt.
WARMUP_PROMPT = "Warm-up request before the measured run."
WARMUP_MAX_TOKENS = 4
# Per-slot context = longest prompt + largest max_tokens + this margin (for
# BOS and a tokenizer that splits a word or two), rounded up to CTX_ROUND.
CTX_MARGIN = 64
CTX_ROUND = 256
# How often a starting server is polled for readiness, in seconds.
READY_POLL_S = 0.25
# How long a stopping server gets after SIGTERM before SIGKILL, in seconds.
STOP_GRACE_S = 15.0
# Lines of a failed server's log shown on stderr.
LOG_TAIL_LINES = 15
# Longest SSE line accepted (one event is far smaller).
MAX_LINE_BYTES = 1 << 20


# ---------------------------------------------------------------- workloads


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: its prompt and output length."""

    prompt: str
    prompt_words: int
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """A named request mix and the per-slot context it needs."""

    name: str
    title: str
    max_prompt_words: int
    max_out_tokens: int
    prefix_cache_pair: bool  # run kvant with and without its prefix cache

    def slot_ctx(self, override: int | None) -> int:
        if override:
            return override
        need = self.max_prompt_words + self.max_out_tokens + CTX_MARGIN
        return -(-need // CTX_ROUND) * CTX_ROUND


def words(rng: random.Random, n: int) -> str:
    """N seeded one-token words, each with its leading space."""
    return "".join(" " + rng.choice(WORDS) for _ in range(n))


def make_requests(a: argparse.Namespace, wl: Workload, concurrency: int, n: int) -> list[RequestSpec]:
    """The level's request list: the same for every server and repetition."""
    rng = random.Random(f"{a.seed}/{wl.name}/{concurrency}")
    out = []
    if wl.name == "mixed":
        for _ in range(n):
            p = rng.randint(a.prompt_tokens[0], a.prompt_tokens[1])
            out.append(RequestSpec(words(rng, p), p, rng.randint(a.max_tokens[0], a.max_tokens[1])))
    else:
        # The prefix does not depend on the level, so it is the same everywhere.
        prefix = words(random.Random(f"{a.seed}/prefix"), a.prefix_tokens)
        for _ in range(n):
            s = rng.randint(a.suffix_tokens[0], a.suffix_tokens[1])
            out.append(
                RequestSpec(
                    prefix + words(rng, s),
                    a.prefix_tokens + s,
                    rng.randint(a.prefix_max_tokens[0], a.prefix_max_tokens[1]),
                )
            )
    return out


def workloads(a: argparse.Namespace) -> list[Workload]:
    table = {
        "mixed": Workload(
            "mixed",
            f"mixed: prompts {a.prompt_tokens[0]}-{a.prompt_tokens[1]} tokens, "
            f"max_tokens {a.max_tokens[0]}-{a.max_tokens[1]}",
            a.prompt_tokens[1],
            a.max_tokens[1],
            False,
        ),
        "prefix": Workload(
            "prefix",
            f"prefix: shared {a.prefix_tokens}-token prefix + {a.suffix_tokens[0]}-{a.suffix_tokens[1]}"
            f"-token suffix, max_tokens {a.prefix_max_tokens[0]}-{a.prefix_max_tokens[1]}",
            a.prefix_tokens + a.suffix_tokens[1],
            a.prefix_max_tokens[1],
            True,
        ),
    }
    return [table[w] for w in a.workloads]


# ------------------------------------------------------------------ servers


@dataclass(frozen=True)
class ServerKind:
    """How to start one server under test and tell when it is ready."""

    key: str
    label: str
    ready_path: str

    def argv(self, a: argparse.Namespace, port: int, concurrency: int, slot_ctx: int) -> list[str]:
        if self.key in ("kvant", "kvant-noprefix"):
            cmd = [a.kvant_bin, "serve", "--model", a.model, "--port", str(port), "--threads", str(a.threads)]
            if self.key == "kvant-noprefix":
                cmd.append("--no-prefix-caching")
            return cmd + shlex.split(a.kvant_args)
        if self.key == "llamacpp":
            cmd = [a.llama_server_bin, "--model", a.model, "--host", "127.0.0.1", "--port", str(port)]
            cmd += ["--threads", str(a.threads), "--threads-batch", str(a.threads)]
            cmd += ["--parallel", str(concurrency), "--cont-batching"]
            cmd += ["--ctx-size", str(concurrency * slot_ctx), "--no-webui"]
            return cmd + shlex.split(a.llamacpp_args)
        # llama-cpp-python's server: one model instance behind a lock, so it
        # serves one request at a time whatever the concurrency; by default a
        # waiting request cuts the streaming one short, which it must not here.
        cmd = [a.llamacpp_python, "-m", "llama_cpp.server", "--model", a.model]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--n_threads", str(a.threads), "--n_threads_batch", str(a.threads), "--n_ctx", str(slot_ctx)]
        cmd += ["--interrupt_requests", "false"]
        return cmd + shlex.split(a.llamacpp_args)


SERVER_KINDS = {
    "kvant": ServerKind("kvant", "kvant", "/health"),
    "kvant-noprefix": ServerKind("kvant-noprefix", "kvant --no-prefix-caching", "/health"),
    "llamacpp": ServerKind("llamacpp", "llama.cpp llama-server", "/health"),
    "llamacpp-py": ServerKind("llamacpp-py", "llama-cpp-python server", "/v1/models"),
}


class ServerError(RuntimeError):
    """A server that did not start or become ready; the message says why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in lines[-LOG_TAIL_LINES:])


class ManagedServer:
    """A server subprocess in its own session, with its output in a log file."""

    def __init__(self, argv: list[str], port: int, ready_path: str, log: Path) -> None:
        self.argv = argv
        self.base = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float) -> None:
        with open(self.log, "wb") as out:
            try:
                self.proc = subprocess.Popen(
                    self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
                )
            except OSError as e:
                raise ServerError(f"cannot start {self.argv[0]}: {e}") from e
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(
                    f"exited with status {code} before it was ready; log {self.log}:\n{log_tail(self.log)}"
                )
            try:
                with urllib.request.urlopen(self.base + self.ready_path, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while it loads the model
            time.sleep(READY_POLL_S)
        self.stop()
        raise ServerError(f"not ready after {timeout_s:.0f} s; log {self.log}:\n{log_tail(self.log)}")

    def model_id(self, fallback: str) -> str:
        """The first model id of /v1/models, which the requests then name."""
        try:
            with urllib.request.urlopen(self.base + "/v1/models", timeout=10) as r:
                data = json.load(r).get("data") or []
                if data and isinstance(data[0].get("id"), str):
                    return data[0]["id"]
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            pass
        return fallback

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------- client


@dataclass
class RequestResult:
    """What one streamed request did; times in seconds."""

    ok: bool
    error: str = ""
    ttft: float | None = None
    latency: float | None = None
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def out_tokens(self) -> int:
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else self.chunks


def int_or_none(x: object) -> int | None:
    """A usage count, or None where the server sent something else."""
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def request_body(model: str, spec: RequestSpec) -> dict:
    return {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float) -> RequestResult:
    """Send one streaming completion and time its content chunks."""
    res = RequestResult(ok=False)
    t0 = time.perf_counter()
    last = None
    done = False
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    res.error = f"HTTP {resp.status}: {text}"
                    return res
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event names
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    event = json.loads(payload)
                    if not isinstance(event, dict):
                        res.error = f"non-object event: {payload[:200]!r}"
                        return res
                    if "error" in event:
                        res.error = f"error event: {json.dumps(event['error'])[:200]}"
                        return res
                    usage = event.get("usage")
                    if isinstance(usage, dict):
                        res.usage_completion_tokens = int_or_none(usage.get("completion_tokens"))
                        res.usage_prompt_tokens = int_or_none(usage.get("prompt_tokens"))
                        details = usage.get("prompt_tokens_details")
                        if isinstance(details, dict):
                            res.usage_cached_tokens = int_or_none(details.get("cached_tokens"))
                    for choice in event.get("choices") or []:
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
                        if choice.get("text"):
                            res.chunks += 1
                            if last is None:
                                res.ttft = now - t0
                            else:
                                res.gaps.append(now - last)
                            last = now
    except TimeoutError:
        res.error = f"timed out after {timeout_s:.0f} s"
        return res
    except (aiohttp.ClientError, ValueError, AttributeError, TypeError) as e:
        # Transport failures, bad JSON, and events of the wrong shape.
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - t0
    if not done:
        res.error = "stream ended without [DONE]"
    elif res.ttft is None:
        res.error = "no content chunk"
    elif res.finish_reason is None:
        res.error = "stream ended without a finish_reason"
    else:
        res.ok = True
    return res


async def run_level(base: str, model: str, specs: list[RequestSpec], concurrency: int, timeout_s: float):
    """Closed loop: `concurrency` clients drain the request list in order."""
    url = base + "/v1/completions"
    results: list[RequestResult | None] = [None] * len(specs)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(specs)):
        queue.put_nowait(i)
    # A fresh connection per request: llama-server closes kept-alive
    # connections under the client, which then fails to write the next body.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None), read_bufsize=MAX_LINE_BYTES
    ) as session:
        warm = await stream_one(
            session,
            url,
            request_body(model, RequestSpec(WARMUP_PROMPT, 0, WARMUP_MAX_TOKENS)),
            timeout_s,
        )

        async def client() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results[i] = await stream_one(session, url, request_body(model, specs[i]), timeout_s)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return warm, [r for r in results if r is not None], wall


# ------------------------------------------------------------------ metrics


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    out_tokens = sum(r.out_tokens for r in ok)
    prompt_tokens = [r.usage_prompt_tokens for r in ok if r.usage_prompt_tokens is not None]
    cached = [r for r in ok if r.usage_cached_tokens is not None and r.usage_prompt_tokens]

    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1000.0

    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "wall_s": wall,
        "req_per_s": len(ok) / wall if wall > 0 else None,
        "out_tok_per_s": out_tokens / wall if wall > 0 else None,
        "out_tokens": out_tokens,
        "tokens_from_usage": sum(r.usage_completion_tokens is not None for r in ok),
        "mean_prompt_tokens_reported": statistics.fmean(prompt_tokens) if prompt_tokens else None,
        # Share of prompt tokens served from the server's prefix cache, where
        # its usage reports `prompt_tokens_details.cached_tokens`.
        "cached_prompt_pct": 100.0
        * sum(r.usage_cached_tokens for r in cached)
        / sum(r.usage_prompt_tokens for r in cached)
        if cached
        else None,
        "ttft_p50_ms": ms(percentile(ttfts, 50)),
        "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "itl_p50_ms": ms(percentile(gaps, 50)),
        "itl_p99_ms": ms(percentile(gaps, 99)),
        "finish_reasons": {k: sum(r.finish_reason == k for r in ok) for k in {r.finish_reason for r in ok}},
        "first_errors": sorted({r.error for r in results if not r.ok})[:5],
    }


MEDIAN_KEYS = (
    "req_per_s",
    "out_tok_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "cached_prompt_pct",
)


def median_summary(reps: list[dict]) -> dict:
    """Median of each figure over repetitions; errors are summed."""
    out = {"repetitions": len(reps), "errors": sum(r["errors"] for r in reps)}
    for k in MEDIAN_KEYS:
        vals = [r[k] for r in reps if r[k] is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


# ------------------------------------------------------------------- output


def fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}"


def markdown_table(wl: Workload, rows: list[dict], repetitions: int) -> str:
    reference = {r["concurrency"]: r for r in rows if r["server"] in ("llamacpp", "llamacpp-py")}
    head = [
        "server",
        "conc",
        "req/s",
        "out tok/s",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "ITL p50 (ms)",
        "ITL p99 (ms)",
        "errors",
        "kvant/llama.cpp out tok/s",
    ]
    if wl.prefix_cache_pair:
        head += ["kvant/llama.cpp TTFT p50", "cached prompt %"]
    lines = [
        f"### {wl.title}" + (f" (medians of {repetitions} repetitions)" if repetitions > 1 else ""),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|",
    ]
    for r in rows:
        if r.get("unavailable"):
            cells = [SERVER_KINDS[r["server"]].label, str(r["concurrency"])] + ["—"] * (len(head) - 2)
            cells[8] = "not run"
        else:
            m = r["median"]
            ref = reference.get(r["concurrency"])
            is_kvant = r["server"].startswith("kvant")
            ref_m = ref["median"] if ref and not ref.get("unavailable") else None
            cells = [
                SERVER_KINDS[r["server"]].label,
                str(r["concurrency"]),
                fmt(m["req_per_s"], 2),
                fmt(m["out_tok_per_s"]),
                fmt(m["ttft_p50_ms"]),
                fmt(m["ttft_p99_ms"]),
                fmt(m["itl_p50_ms"]),
                fmt(m["itl_p99_ms"]),
                str(m["errors"]),
                ratio(m["out_tok_per_s"], ref_m["out_tok_per_s"]) if is_kvant and ref_m else "—",
            ]
            if wl.prefix_cache_pair:
                cells.append(ratio(m["ttft_p50_ms"], ref_m["ttft_p50_ms"]) if is_kvant and ref_m else "—")
                cells.append(fmt(m["cached_prompt_pct"], 0))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------- main


def int_list(text: str, name: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t]
    except ValueError:
        p.error(f"{name} must be a comma list of integers, not {text!r}")
    if not vals or min(vals) < 1:
        p.error(f"{name} needs at least one value, each at least 1")
    return vals


def int_range(text: str, name: str, p: argparse.ArgumentParser) -> tuple[int, int]:
    """`A:B` (inclusive, uniform) or a single `A`."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        p.error(f"{name} must be A:B or A with integers, not {text!r}")
    if lo < 1 or hi < lo:
        p.error(f"{name} needs 1 <= A <= B, not {text!r}")
    return lo, hi


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.environ.get("KVANT_MODEL"), help="GGUF path (default: $KVANT_MODEL)")
    p.add_argument(
        "--servers",
        default="kvant,llamacpp",
        help="comma list of kvant, llamacpp (llama.cpp's llama-server), llamacpp-py "
        "(llama-cpp-python's server, one request at a time) (default kvant,llamacpp)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of every server")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma list of client counts (default 1,4,16,64)")
    p.add_argument("--requests", type=int, help="requests per level (default max(16, 4 x concurrency))")
    p.add_argument("--repetitions", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", default="mixed", help="comma list of mixed, prefix (default mixed)")
    p.add_argument("--prefix-workload", action="store_true", help="same as --workloads prefix")
    p.add_argument("--prompt-tokens", default="32:512", help="mixed: prompt length range A:B (default 32:512)")
    p.add_argument("--max-tokens", default="16:256", help="mixed: max_tokens range A:B (default 16:256)")
    p.add_argument("--prefix-tokens", type=int, default=1000, help="prefix: shared prefix length (default 1000)")
    p.add_argument("--suffix-tokens", default="8:32", help="prefix: unique suffix length range (default 8:32)")
    p.add_argument("--prefix-max-tokens", default="16:64", help="prefix: max_tokens range (default 16:64)")
    p.add_argument("--slot-ctx", type=int, help="llama.cpp per-slot context (default: fits the workload)")
    p.add_argument("--kvant-bin", default=str(REPO / "target" / "release" / "kvant"))
    p.add_argument("--kvant-args", default="", help="extra arguments of `kvant serve`")
    p.add_argument(
        "--llama-server-bin",
        default=os.environ.get("LLAMA_SERVER", str(DEFAULT_LLAMA_SERVER)),
        help=f"llama.cpp's llama-server (default $LLAMA_SERVER, else {DEFAULT_LLAMA_SERVER})",
    )
    p.add_argument(
        "--llamacpp-python", default=sys.executable, help="Python with llama-cpp-python[server] (llamacpp-py)"
    )
    p.add_argument("--llamacpp-args", default="", help="extra arguments of the llama.cpp server")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to get ready")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds for one request")
    p.add_argument("--log-dir", help="server logs (default: a fresh temporary directory)")
    p.add_argument("--json", help="write every raw result to this JSON file")
    a = p.parse_args()
    if not a.model or not Path(a.model).is_file():
        p.error(f"--model (or $KVANT_MODEL) must name a GGUF file, not {a.model!r}")
    a.model = str(Path(a.model).resolve())
    a.server_list = [s for s in a.servers.split(",") if s]
    for s in a.server_list:
        if s not in ("kvant", "llamacpp", "llamacpp-py"):
            p.error(f"unknown server {s!r}; choose from kvant, llamacpp, llamacpp-py")
    if not a.server_list:
        p.error("--servers needs at least one server")
    a.levels = int_list(a.concurrency, "--concurrency", p)
    a.workloads = ["prefix"] if a.prefix_workload else [w for w in a.workloads.split(",") if w]
    for w in a.workloads:
        if w not in ("mixed", "prefix"):
            p.error(f"unknown workload {w!r}; choose from mixed, prefix")
    a.prompt_tokens = int_range(a.prompt_tokens, "--prompt-tokens", p)
    a.max_tokens = int_range(a.max_tokens, "--max-tokens", p)
    a.suffix_tokens = int_range(a.suffix_tokens, "--suffix-tokens", p)
    a.prefix_max_tokens = int_range(a.prefix_max_tokens, "--prefix-max-tokens", p)
    if a.threads < 1 or a.repetitions < 1 or a.prefix_tokens < 1 or (a.requests is not None and a.requests < 1):
        p.error("--threads, --repetitions, --prefix-tokens and --requests must be at least 1")
    return a


def servers_for(a: argparse.Namespace, wl: Workload) -> list[str]:
    out = []
    for s in a.server_list:
        out.append(s)
        if s == "kvant" and wl.prefix_cache_pair:
            out.append("kvant-noprefix")
    return out


def run_one(a, wl, kind: ServerKind, concurrency: int, specs, log_dir: Path, rep: int) -> dict:
    """Start one server, run one level against it, stop it."""
    port = free_port()
    argv = kind.argv(a, port, concurrency, wl.slot_ctx(a.slot_ctx))
    log = log_dir / f"{wl.name}-{kind.key}-c{concurrency}-r{rep}.log"
    server = ManagedServer(argv, port, kind.ready_path, log)
    print(f"[{wl.name} c={concurrency} rep {rep}] {kind.label}: {shlex.join(argv)}", file=sys.stderr)
    load_before = os.getloadavg()[0]
    try:
        t_start = time.perf_counter()
        server.start(a.startup_timeout)
        startup_s = time.perf_counter() - t_start
        model = server.model_id(Path(a.model).stem)
        warm, results, wall = asyncio.run(run_level(server.base, model, specs, concurrency, a.request_timeout))
    finally:
        server.stop()
    summary = summarize(results, wall)
    print(
        f"    {summary['ok']}/{summary['requests']} ok in {wall:.1f} s, "
        f"{fmt(summary['out_tok_per_s'])} out tok/s, TTFT p50 {fmt(summary['ttft_p50_ms'])} ms"
        + (f"; errors: {summary['first_errors']}" if summary["errors"] else "")
        + ("" if warm.ok else f"; warm-up failed: {warm.error}")
        + f"; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        file=sys.stderr,
    )
    return {
        "argv": argv,
        "log": str(log),
        "startup_s": startup_s,
        # The 1-minute load average: other work on the machine skews a run.
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg()[0],
        "warmup_ok": warm.ok,
        "summary": summary,
        "requests": [asdict(r) for r in results],
    }


def main() -> int:
    a = parse_args()
    log_dir = Path(a.log_dir) if a.log_dir else Path(tempfile.mkdtemp(prefix="serve_load-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {log_dir}", file=sys.stderr)
    unavailable: dict[str, str] = {}
    report = {"config": {k: v for k, v in vars(a).items()}, "unavailable": unavailable, "workloads": {}}
    tables = []
    for wl in workloads(a):
        names = servers_for(a, wl)
        raw: dict[tuple[str, int], list[dict]] = {}
        for concurrency in a.levels:
            n = a.requests or max(16, 4 * concurrency)
            specs = make_requests(a, wl, concurrency, n)
            for rep in range(a.repetitions):
                # Reverse the order on odd repetitions so neither server always goes first.
                for name in names if rep % 2 == 0 else names[::-1]:
                    if name in unavailable:
                        continue
                    try:
                        raw.setdefault((name, concurrency), []).append(
                            run_one(a, wl, SERVER_KINDS[name], concurrency, specs, log_dir, rep)
                        )
                    except ServerError as e:
                        unavailable[name] = str(e).splitlines()[0].rstrip(":")
                        print(f"    {SERVER_KINDS[name].label} UNAVAILABLE, skipped from now on: {e}", file=sys.stderr)
        rows = []
        for name in names:
            for concurrency in a.levels:
                runs = raw.get((name, concurrency), [])
                row = {"server": name, "concurrency": concurrency}
                if runs:
                    row["median"] = median_summary([r["summary"] for r in runs])
                    row["runs"] = runs
                else:
                    row["unavailable"] = unavailable.get(name, "not run")
                rows.append(row)
        report["workloads"][wl.name] = {"title": wl.title, "slot_ctx": wl.slot_ctx(a.slot_ctx), "rows": rows}
        tables.append(markdown_table(wl, rows, a.repetitions))
    print(
        f"\nmodel {Path(a.model).name}, {a.threads} threads per server, streaming /v1/completions, "
        "temperature 0, ignore_eos\n"
    )
    print("\n\n".join(tables))
    for name, why in unavailable.items():
        print(f"\n{SERVER_KINDS[name].label} was not measured: {why}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
        print(f"raw results in {a.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
