#!/usr/bin/env python3
"""transformers' prefill speed on a GGUF, for compare_llamacpp.py.

Loads the GGUF with transformers' own loader (dequantized to float32), sets
torch's thread count, runs one warm-up forward pass, then times
`--repetitions` forward passes over `--prompt-tokens` random token ids (a
seeded RNG over the vocabulary) with an empty cache, computing only the last
position's logits as kvant's and llama.cpp's prefill do. Prints one JSON
line: `prefill_runs` (tok/s each), their median `prefill_tokens_per_s`,
`load_secs`, `threads`, `torch`, `transformers`.

Needs torch, transformers and gguf:
  PY tools/bench/transformers_prefill.py --model M.gguf --threads 2 --prompt-tokens 512 --repetitions 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

PROMPT_SEED = 0x6B76616E74


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--repetitions", type=int, default=5)
    a = p.parse_args()
    if a.threads < 1 or a.prompt_tokens < 1 or a.repetitions < 1:
        p.error("--threads, --prompt-tokens and --repetitions must be at least 1")
    torch.set_num_threads(a.threads)
    path = Path(a.model)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    load_secs = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    ids = torch.randint(0, model.config.vocab_size, (1, a.prompt_tokens), generator=gen)

    def prefill() -> float:
        t = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return a.prompt_tokens / (time.perf_counter() - t)

    with torch.inference_mode():
        prefill()
        runs = [prefill() for _ in range(a.repetitions)]
    print(json.dumps({
        "prefill_runs": runs,
        "prefill_tokens_per_s": statistics.median(runs),
        "load_secs": load_secs,
        "threads": a.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }))


if __name__ == "__main__":
    main()
