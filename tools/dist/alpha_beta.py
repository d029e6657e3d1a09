#!/usr/bin/env python3
"""The α-β cost model of kvant's collectives, and what it predicts.

Two uses, both standard library only:

  predict   step times of `kvant bench` runs under the network model
            (--net-latency α, --net-bandwidth β), from a run of the same
            layout without it (the compute) and the collectives each step
            posts (counts and bytes, from the bench's JSON); prints
            measured against predicted, with and without two-batch overlap.

  project   DeepSeek-V3 decode under expert parallelism at EP 8 to 64 with
            published interconnect numbers: dispatch and combine per layer
            and per step, and how much compute must hide them.

A message of n bytes between two ranks takes α + n/β; a collective of p
ranks costs its algorithm's critical path (Thakur, Rabenseifner, Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA
19(1), 2005), the formulas of kvant-dist's `cost.rs`:

  barrier          ⌈log2 p⌉·α
  broadcast        ⌈log2 p⌉·(α + n/β)            (binomial tree)
  all-reduce       2(p−1)·α + 2(p−1)/p·n/β       (ring)
  all-gather       (p−1)·α + (p−1)/p·n/β          (ring, n the whole vector)
  reduce-scatter   (p−1)·α + (p−1)/p·n/β
  all-to-all-v     (p−1)·α + max(sent, received)/β (pairwise exchange)

The network model in kvant (`Metered`) completes each collective no sooner
than its post plus this cost, each collective on its own (collectives in
flight together do not share the bandwidth): a NIC that moves the bytes
while the cores compute. The step-time model here makes the same
assumption.

Step time without overlap: the collectives of a forward pass run one after
another between compute, so T = T_compute + Σ cost. With two-batch overlap
the batch runs as two micro-batches on one CPU, each posting its own
collectives (twice as many, half the bytes each); while one waits for its
collective the other computes. The model simulates exactly that schedule
(the micro-batch that can run, runs; the first one first), with each
micro-batch's compute spread evenly between its collectives, which is what
a transformer layer's pattern of compute-then-collective gives.

  python3 tools/dist/alpha_beta.py predict run.json:base.json ...
  python3 tools/dist/alpha_beta.py predict run1.json,run2.json:base1.json,base2.json ...
                                    (rounds: medians over each side)
  python3 tools/dist/alpha_beta.py project
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass

KINDS = ["barrier", "broadcast", "all_reduce", "all_gather", "reduce_scatter", "all_to_all_v"]


@dataclass
class Net:
    alpha: float  # seconds
    beta: float  # bytes per second

    def parts(self, kind: str, p: int, n: float) -> tuple[float, float]:
        """(latency, transfer) of one collective of `kind` on p ranks, n as
        in the module doc: the α terms, and the bytes over β, the part
        that occupies the rank's link."""
        if p <= 1:
            return 0.0, 0.0
        logp = math.ceil(math.log2(p))
        messages, moved = {
            "barrier": (logp, 0.0),
            "broadcast": (logp, logp * n),
            "all_reduce": (2 * (p - 1), 2 * (p - 1) / p * n),
            "all_gather": (p - 1, (p - 1) / p * n),
            "reduce_scatter": (p - 1, (p - 1) / p * n),
            "all_to_all_v": (p - 1, n),
        }[kind]
        return messages * self.alpha, moved / self.beta

    def time(self, kind: str, p: int, n: float) -> float:
        return sum(self.parts(kind, p, n))


def two_streams(compute: float, comms: list[tuple[float, float]]) -> float:
    """Wall time of two micro-batches sharing one CPU and one link. Each
    runs `compute` seconds (its own) split evenly around its collectives `comms`
    ((latency, transfer) each; one compute slice before each collective and
    one after the last); a collective's transfer starts when the link is
    free, its latency overlaps others'. The micro-batch that can run, runs,
    the first one first, as kvant's executor polls them."""
    slices = len(comms) + 1
    c = compute / slices
    nxt = [0, 0]
    ready = [0.0, 0.0]
    now = link = 0.0
    while nxt[0] < slices or nxt[1] < slices:
        runnable = [s for s in (0, 1) if nxt[s] < slices and ready[s] <= now]
        if not runnable:
            now = min(ready[s] for s in (0, 1) if nxt[s] < slices)
            continue
        s = runnable[0]
        now += c
        i = nxt[s]
        nxt[s] += 1
        if i < len(comms):
            lat, xfer = comms[i]
            link = max(link, now) + xfer
            ready[s] = link + lat
        else:
            ready[s] = now
    return now


def step(bench: dict | list[dict]) -> float:
    """Median prefill step time of a `kvant bench --json` report, or the
    median over several reports (rounds of the same run)."""
    if isinstance(bench, list):
        return statistics.median(step(b) for b in bench)
    return bench["prompt_tokens"] / bench["prefill_tokens_per_s"]


def load_runs(paths: str) -> list[dict]:
    """The reports in a comma-separated list of paths."""
    return [json.load(open(p)) for p in paths.split(",")]


def collectives(bench: dict, phase: str = "prefill") -> dict:
    return bench["parallel"][phase]["collectives"]


def predict_one(run: dict, base: list[dict], p: int) -> tuple[float, float, float]:
    """(predicted, compute, communication) step times of `run` (a run
    under the network model) from `base` (rounds of the same layout
    without it)."""
    net = Net(run["parallel"]["net_latency_s"], run["parallel"]["net_bandwidth_bytes_per_s"])
    overlap = run["parallel"]["two_batch_overlap"]
    forward: list[tuple[float, float]] = []
    serial = 0.0
    for kind, c in collectives(run).items():
        count = round(c["count"])
        if count == 0:
            continue
        if kind == "all_reduce":
            n = c["bytes_sent"] / count
        elif kind == "broadcast":
            n = c["bytes_sent"] / count / max(p - 1, 1)
        else:
            n = max(c["bytes_sent"], c["bytes_received"]) / count
        cost = net.parts(kind, p, n)
        if kind == "broadcast":
            # The step's plan, before the forward pass.
            serial += count * sum(cost)
        elif kind == "all_to_all_v":
            # One of them is the logits' way back, after the forward pass.
            serial += sum(cost)
            forward += [cost] * (count - 1)
        else:
            forward += [cost] * count
    compute = step(base)
    comm = serial + sum(map(sum, forward))
    if not overlap:
        return compute + comm, compute, comm
    # Each micro-batch posts half of the forward collectives, in order,
    # and does half the compute.
    half = len(forward) // 2
    return serial + two_streams(compute / 2, forward[:half]), compute, comm


def cmd_predict(a: argparse.Namespace) -> None:
    rows = []
    for pair in a.runs:
        run_path, _, base_path = pair.partition(":")
        if not base_path:
            sys.exit(f"{pair}: give RUN:BASE")
        runs, base = load_runs(run_path), load_runs(base_path)
        run = runs[0]
        par = run["parallel"]
        pred, compute, comm = predict_one(run, base, par["ranks"])
        meas = step(runs)
        rows.append(
            (
                par["net_latency_s"] * 1e6,
                par["net_bandwidth_bytes_per_s"] / 1e9,
                "on" if par["two_batch_overlap"] else "off",
                compute,
                comm,
                meas,
                pred,
                (pred - meas) / meas,
                meas / max(compute, comm),
            )
        )
    print(
        f"{'α µs':>6} {'β GB/s':>7} {'TBO':>4} {'compute s':>10} {'comm s':>8} "
        f"{'measured s':>10} {'model s':>8} {'error':>7} {'meas/max':>8}"
    )
    for r in rows:
        print(
            f"{r[0]:6.0f} {r[1]:7.3g} {r[2]:>4} {r[3]:10.3f} {r[4]:8.3f} "
            f"{r[5]:10.3f} {r[6]:8.3f} {r[7]:+7.1%} {r[8]:8.2f}"
        )


# DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3): hidden 7168, 58 MoE
# layers of 61, 8 of 256 routed experts per token (plus one shared), expert
# FFN 2048, MLA with q_lora 1536, kv_lora 512, 128 heads of 128 + 64 rope.
HIDDEN = 7168
MOE_LAYERS = 58
TOP_K = 8
EXPERT_FF = 2048
HEADS = 128
# MLA's weights per layer (parameters): q_a, q_b, kv_a, kv_b, o.
MLA_PARAMS = HIDDEN * 1536 + 1536 * HEADS * 192 + HIDDEN * 576 + 512 * HEADS * 256 + HEADS * 128 * HIDDEN
# One cached latent row per token and layer: 512 + 64 values, BF16.
LATENT_BYTES = 576 * 2
# H800 HBM3: batches this small are memory-bound, compute = bytes / bandwidth.
HBM = 3.35e12


def cmd_project(a: argparse.Namespace) -> None:
    # DeepEP's low-latency messages: one per (token, expert), FP8 rows with
    # one f32 scale per 128 values and a 16-byte header out; BF16 rows back.
    disp_row = 16 + HIDDEN + HIDDEN // 128 * 4
    comb_row = 2 * HIDDEN
    print(
        f"DeepSeek-V3 decode under expert parallelism, per MoE layer ({MOE_LAYERS} of them): "
        f"B tokens per rank (attention data-parallel), top-{TOP_K}, context {a.context}."
    )
    print(
        f"{'EP':>3} {'network':>10} {'B':>4} {'dispatch':>9} {'combine':>8} {'compute':>8} "
        f"{'serial':>7} {'TBO':>7}  exposed without overlap"
    )
    print(f"{'':>3} {'':>10} {'':>4} {'µs':>9} {'µs':>8} {'µs':>8} {'ms':>7} {'ms':>7}")
    for ep in (8, 16, 32, 64):
        # Within a node (EP8): NVLink at DeepEP's measured ~160 GB/s;
        # beyond: 400 Gb/s InfiniBand (CX7), ~50 GB/s, 3 µs a message.
        net, name = (Net(2e-6, 160e9), "NVLink") if ep <= 8 else (Net(3e-6, 50e9), "IB 50GB/s")
        for b in a.batch:
            # The low-latency kernels overlap the per-peer messages: the
            # critical path is one latency plus the bytes.
            def comm(tokens: float) -> tuple[float, float]:
                return (
                    net.alpha + tokens * TOP_K * disp_row / net.beta,
                    net.alpha + tokens * TOP_K * comb_row / net.beta,
                )

            d, c = comm(b)
            # What a rank computes per layer: its routed experts' and the
            # shared expert's FP8 weights, MLA's weights, its sequences'
            # cache rows.
            weights = (256 / ep + 1) * 3 * HIDDEN * EXPERT_FF + MLA_PARAMS
            t = (weights + b * a.context * LATENT_BYTES) / HBM
            serial = (t + d + c) * MOE_LAYERS
            # Two micro-batches of B/2: each reads every weight again (the
            # price of overlap in a memory-bound step) and half the cache;
            # one's dispatch and combine run while the other computes.
            t_mb = (weights + b / 2 * a.context * LATENT_BYTES) / HBM
            d2, c2 = comm(b / 2)
            tbo = 2 * max(t_mb, d2 + c2) * MOE_LAYERS
            print(
                f"{ep:3d} {name:>10} {b:4d} {d * 1e6:9.1f} {c * 1e6:8.1f} {t * 1e6:8.1f} "
                f"{serial * 1e3:7.1f} {tbo * 1e3:7.1f}  {(d + c) / (t + d + c):5.1%}"
            )
    print(
        "\nCheck against DeepEP's measured low-latency kernels (H800, 128 tokens per rank, "
        "top-8, FP8 dispatch, BF16 combine): EP8 77 / 114 µs, EP64 173 / 314 µs."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict", help="measured vs predicted step times")
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN:BASE",
        help="bench JSONs (comma-separated rounds) under the network model, and of the same layout without it",
    )
    p.set_defaults(func=cmd_predict)
    q = sub.add_parser("project", help="DeepSeek-V3 decode at EP 8-64")
    q.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    q.add_argument("--context", type=int, default=4096, help="tokens each sequence attends to")
    q.set_defaults(func=cmd_project)
    a = ap.parse_args()
    a.func(a)


if __name__ == "__main__":
    sys.exit(main())
