#!/usr/bin/env python3
"""Load time of quantization at load (`--quantize`) on a Hugging Face bf16
checkpoint of about 1.1B parameters (Llama shape: hidden 2048, 16 layers,
GQA 16/8 heads, FFN 5632, vocabulary 32000; random weights from
transformers' config class, no download), against llama.cpp's path to the
same integer weights (convert_hf_to_gguf.py to bf16, then llama-quantize).

    python tools/bench/isq_load.py --dir /tmp/isq-1b --kvant target/release/kvant \\
        [--llama-cpp PATH/llama.cpp --llama-bin PATH/build/bin] [--rounds 3]

Makes the checkpoint in --dir unless it is there (tokenizer files from the
tiny fixture). Times `kvant perplexity` over one short window (load,
quantize, one pass; it decodes nothing, as the 32000-row head outnumbers
the tokenizer's 320 ids) per type, alternating types per round, and prints
medians and spreads; with --llama-cpp, times the converter and
llama-quantize once each (the converted bf16 file is kept in --dir).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TYPES = ["none", "q8_0", "q4_0", "q4_k"]


def make(dirpath: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(dirpath)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(ROOT / "tests/fixtures/models/llama-gqa" / f, dirpath / f)


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--kvant", type=Path, required=True)
    ap.add_argument("--llama-cpp", type=Path, help="a llama.cpp source tree (its convert_hf_to_gguf.py)")
    ap.add_argument("--llama-bin", type=Path, help="its build/bin (llama-quantize)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not (args.dir / "config.json").is_file():
        args.dir.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        make(args.dir)
        print(f"made {args.dir} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    text = args.dir / "short.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 2)
    times: dict[str, list[float]] = {t: [] for t in TYPES}
    for _ in range(args.rounds):
        for t in TYPES:
            cmd = [str(args.kvant), "perplexity", "-m", str(args.dir), "-f", str(text), "--ctx", "32"]
            if t != "none":
                cmd += ["--quantize", t]
            times[t].append(timed(cmd))
    print("| kvant load (+ one 32-token window) | median s | spread |")
    print("|---|---:|---|")
    for t, xs in times.items():
        print(f"| {'bf16 as stored' if t == 'none' else '--quantize ' + t} | {statistics.median(xs):.2f} | {min(xs):.2f}–{max(xs):.2f} |")
    if args.llama_cpp and args.llama_bin:
        bf16 = args.dir / "model-bf16.gguf"
        conv = timed([sys.executable, str(ROOT / "tools/reference/convert_with_llama_cpp.py"),
                      "--converter", str(args.llama_cpp / "convert_hf_to_gguf.py"), str(args.dir),
                      "--outtype", "bf16", "--outfile", str(bf16)])
        print(f"\nllama.cpp: convert_hf_to_gguf.py to bf16 {conv:.2f} s")
        for name in ["Q8_0", "Q4_0", "Q4_K"]:
            out = args.dir / f"model-{name}.gguf"
            q = timed([str(args.llama_bin / "llama-quantize"), str(bf16), str(out), name, "2"])
            print(f"llama-quantize {name}: {q:.2f} s (total with the conversion {conv + q:.2f} s)")
            out.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
