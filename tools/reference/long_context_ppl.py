#!/usr/bin/env python3
"""Gemma 3 270M perplexity at long context: transformers against kvant.

transformers loads the Q4_K_M GGUF and dequantizes every tensor to float32
(as gemma3_reference.py does), runs on the CPU with SDPA attention, and scores
a long text under `kvant perplexity`'s convention: the file tokenized once
(BOS first), cut into consecutive non-overlapping windows of `ctx` tokens (a
last window under 2 tokens dropped), every token of a window after its first
predicted from its prefix within the window, PPL = exp(mean NLL), the NLL
taken from float32 logits in float64.

A window runs through transformers in chunks of `--chunk` tokens with its KV
cache (`DynamicCache` built from the config: the sliding-window layers keep
their last 512 positions, the global ones everything), and the logits of a
chunk are computed `LOGIT_ROWS` rows at a time from the final hidden states.
So the attention mask is [chunk, ctx], never [ctx, ctx] (two of those in
bool for 32768 would be 2 GiB, and SDPA's CPU fallback with a mask would
materialise [4 heads, ctx, ctx] float32 weights, 16 GiB), and no
[ctx, vocab] logits exist (32768 x 262144 float32 = 34 GB). Before the long
runs the script checks that chunking changes nothing: the first `CHECK_LEN`
tokens scored in one forward pass and in chunks of `CHECK_CHUNK` agree.

With `--kvant BIN`, it also runs `kvant perplexity --ctx N --json` on the same
file (plus `--kvant-args`), checks that kvant tokenizes the file into the
same ids (`kvant tokenize --file`), and fails if the two perplexities differ
by more than `--tol` (relative; default 0.5%).

    /work/refvenv/bin/python tools/reference/long_context_ppl.py \\
        --gguf ~/.cache/kvant/gemma-3-270m-q4_k_m.gguf --ctx 8192,32768 \\
        --kvant target/release/kvant --threads 2 --json-out /tmp/long_ppl.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TEXT = REPO / "tests" / "fixtures" / "text" / "jargon-4.4.7.txt"
# Hidden-state rows per lm_head product: 128 x 262144 float64 is 268 MB.
LOGIT_ROWS = 128
# The chunking self-check: this many tokens (several sliding windows of 512)
# in one pass against chunks of CHECK_CHUNK, relative NLL tolerance. Both
# compute the same products in float32 with SDPA; only the blocking of the
# attention and matmul sums differs (~1e-6 relative).
CHECK_LEN = 2048
CHECK_CHUNK = 384
CHECK_TOL = 1e-5


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=os.environ.get("KVANT_GEMMA3_MODEL",
                                                    str(Path.home() / ".cache/kvant/gemma-3-270m-q4_k_m.gguf")))
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--ctx", default="8192,32768", help="comma list of window lengths")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per transformers forward pass")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kvant", help="kvant binary: also run `kvant perplexity` and compare")
    p.add_argument("--kvant-args", default="", help="extra `kvant perplexity` arguments")
    p.add_argument("--tol", type=float, default=0.005, help="relative PPL tolerance against kvant")
    p.add_argument("--json-out")
    a = p.parse_args()
    try:
        a.ctxs = [int(c) for c in a.ctx.split(",") if c]
    except ValueError:
        p.error(f"--ctx must be a comma list of integers, not {a.ctx!r}")
    if not a.ctxs or min(a.ctxs) < 2 or a.chunk < 1 or a.threads < 1:
        p.error("--ctx values must be at least 2, --chunk and --threads at least 1")
    return a


def load(gguf_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    c = model.config
    if c.model_type not in ("gemma3_text", "gemma3"):
        raise ValueError(f"expected a Gemma 3 GGUF, got {c.model_type}")
    # The logits below are lm_head(final hidden state): no soft-capping to apply.
    if c.final_logit_softcapping is not None:
        raise AssertionError(f"final_logit_softcapping {c.final_logit_softcapping}: not handled here")
    return tok, model


def window_nll(model, ids: list[int], chunk: int) -> tuple[float, int]:
    """Sum of NLL (float64) of ids[1:] given their prefixes, and the count."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    total, scored = 0.0, 0
    with torch.no_grad():
        for a in range(0, len(ids), chunk):
            piece = ids[a : a + chunk]
            # The cache grows in place: the global layers keep every position,
            # the sliding ones their window.
            out = model.model(input_ids=torch.tensor([piece]), cache=cache, use_cache=True)
            hidden = out.last_hidden_state[0]
            for r in range(0, len(piece), LOGIT_ROWS):
                # Row i predicts ids[a + r + i + 1], if the window has it.
                targets = ids[a + r + 1 : a + r + 1 + LOGIT_ROWS]
                if not targets:
                    break
                rows = hidden[r : r + len(targets)]
                logits = model.lm_head(rows).to(torch.float64)
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1)
                total += float((lse - picked).sum())
                scored += len(targets)
    return total, scored


def perplexity(model, ids: list[int], ctx: int, chunk: int) -> dict:
    total, scored, windows = 0.0, 0, 0
    t0 = time.perf_counter()
    for start in range(0, len(ids), ctx):
        w = ids[start : start + ctx]
        if len(w) < 2:
            continue
        s, n = window_nll(model, w, chunk)
        total += s
        scored += n
        windows += 1
        print(f"  transformers ctx {ctx}: window {windows} ({len(w)} tokens) mean NLL {s / n:.5f}, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    secs = time.perf_counter() - t0
    return {"ctx": ctx, "ppl": math.exp(total / scored), "mean_nll": total / scored, "tokens_scored": scored,
            "windows": windows, "wall_secs": secs}


def check_chunking(model, ids: list[int]) -> dict:
    head = ids[:CHECK_LEN]
    one, n = window_nll(model, head, len(head))
    chunked, m = window_nll(model, head, CHECK_CHUNK)
    rel = abs(one - chunked) / abs(one)
    if n != m or rel > CHECK_TOL:
        raise AssertionError(f"chunked transformers differs from one pass: {chunked} vs {one} ({rel:.2e})")
    return {"tokens": len(head), "chunk": CHECK_CHUNK, "mean_nll_one_pass": one / n,
            "mean_nll_chunked": chunked / m, "rel_diff": rel}


def run_kvant(a: argparse.Namespace, ctx: int) -> dict:
    cmd = ["/usr/bin/time", "-v", a.kvant, "perplexity", "--model", a.gguf, "--file", a.text, "--ctx", str(ctx),
           "--threads", str(a.threads), "--json", *a.kvant_args.split()]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"kvant failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall_secs"] = secs
    for line in r.stderr.splitlines():
        if "Maximum resident set size" in line:
            out["peak_rss_bytes"] = int(line.split(":")[1]) * 1024
    return out


def kvant_ids(a: argparse.Namespace) -> list[int]:
    cmd = [a.kvant, "tokenize", "--model", a.gguf, "--file", a.text]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kvant failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    return json.loads(r.stdout)


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    tok, model = load(Path(a.gguf))
    text = Path(a.text).read_text(encoding="utf-8")
    ids = tok(text).input_ids
    if ids[:1] != [tok.bos_token_id]:
        raise AssertionError(f"transformers did not put BOS first: {ids[:4]}")
    print(f"{len(ids)} tokens", file=sys.stderr)
    report = {"gguf": a.gguf, "text": os.path.relpath(a.text, REPO), "tokens": len(ids), "threads": a.threads,
              "chunk": a.chunk, "torch": torch.__version__, "attention": model.config._attn_implementation}
    if a.kvant:
        same = kvant_ids(a) == ids
        report["kvant_ids_equal"] = same
        if not same:
            sys.exit("kvant tokenizes the text differently from transformers' GGUF tokenizer")
    report["chunking_check"] = check_chunking(model, ids)
    rows, failed = [], []
    for ctx in a.ctxs:
        hf = perplexity(model, ids, ctx, a.chunk)
        row = {"transformers": hf}
        line = f"ctx {ctx}: transformers PPL {hf['ppl']:.4f} ({hf['tokens_scored']} tokens, {hf['wall_secs']:.0f} s)"
        if a.kvant:
            kv = run_kvant(a, ctx)
            rel = kv["ppl"] / hf["ppl"] - 1
            row["kvant"] = kv
            row["rel_diff"] = rel
            same = (kv["tokens_scored"], kv["windows"]) == (hf["tokens_scored"], hf["windows"])
            line += (f", kvant {kv['ppl']:.4f} ({kv['wall_secs']:.0f} s, peak RSS "
                     f"{kv.get('peak_rss_bytes', 0) / 2**20:.0f} MiB), kvant/transformers - 1 = {100 * rel:+.3f}%")
            if not same or abs(rel) > a.tol:
                failed.append(ctx)
        rows.append(row)
        print(line, flush=True)
    report["results"] = rows
    report["transformers_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if failed:
        sys.exit(f"kvant and transformers differ by more than {100 * a.tol}% (or scored other tokens) at ctx {failed}")


if __name__ == "__main__":
    main()
