#!/usr/bin/env python3
"""A DeepSeek-V4-shaped model with random weights, for benchmarks against llama.cpp.

The V4 counterpart of make_moe_bench_model.py (DeepSeek-V3's shape): every V4
path at a size a laptop-class CPU runs, 425.8 M parameters of which 224.5 M
are active per token (embedding table excluded), random weights (so the text
is gibberish, but every tensor has the real model's shape, layout and dtype),
and SmolLM2's real tokenizer, rebuilt from a SmolLM2 GGUF by
make_moe_bench_model.smollm2_tokenizer.

transformers' DeepseekV4Config / DeepseekV4ForCausalLM with V4-Flash's
structure scaled down: hidden 1024, 8 layers in transformers' default schedule
(2 HCA, then HCA/CSA alternating: 3 CSA at compress rate 4 and 5 HCA at 128,
the only rates llama.cpp's deepseek4 loader accepts), shared-KV MQA with 16
heads of 512 (rope on the last 64 dims), q LoRA 512, grouped output projection
(4 groups, rank 512), per-head sinks, sliding window 128; Lightning indexer 16
heads of 128, top-512; mHC with 4 streams (llama.cpp asserts 4) and 20
Sinkhorn iterations; MoE in every layer, 16 routed experts of 512 (top-4,
sqrt-softplus, x1.5) plus one shared, the first 3 layers hash-routed
(tid2eid), SwiGLU clamped at 10; main rope theta 1e4, the compressed
branches' rope theta 160000 with V4-Flash's YaRN (factor 16 over 65536
positions, beta 32/1).

Weights: every matrix N(0, STD) (make_moe_bench_model's), every norm weight 1;
what transformers initialises to constants is drawn small and random so that it
does something: attention sinks, compressor/indexer position biases, mHC
base/scale, the router's selection bias, and a tid2eid table with distinct
experts per row. Stored bf16, except what transformers keeps in float32
(`_keep_in_fp32_modules_strict`: the mHC parameters, sinks, position biases,
selection bias, norms), as V4's own checkpoint does.

Outputs in --out-dir (default /work/bench):
  v4-bench-hf/           the transformers checkpoint (save_pretrained: DeepSeek's
                         tensor names under `model.`), tokenizer
  v4-bench.BF16.gguf     llama.cpp's own converter (convert_hf_to_gguf.py,
                         architecture deepseek4) on a copy in DeepSeek's
                         published layout, as tools/reference/make_v4_fixtures.py
                         converts its fixture (published_copy, then
                         convert_with_llama_cpp.py in a child process), with its
                         float-experts stand-in for the FP4 expert repacking; the
                         expert stacks are written BF16 like every other matrix
  v4-bench.Q8_0.gguf     llama-quantize's Q8_0 of the BF16 file

The script checks that the saved checkpoint reloads bit for bit, that a short
forward pass gives finite logits with a sane spread, that every tensor of the
BF16 GGUF equals the checkpoint's bit for bit, and prints both GGUFs' V4
metadata and tensor types as the converter's gguf-py reads them.

  /work/pyvenv/bin/python tools/bench/make_v4_bench_model.py \\
      --tokenizer-gguf ~/.cache/kvant/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --converter PATH/llama.cpp/convert_hf_to_gguf.py \\
      --llama-quantize PATH/build/bin/llama-quantize [--out-dir /work/bench]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REFERENCE = HERE.parent / "reference"
NAME = "v4-bench"

# --------------------------------------------- child processes (llama.cpp's gguf-py)
#
# llama.cpp's converter must import the gguf-py next to it (deepseek4 is not in
# the venv's gguf), and make_moe_bench_model imports the venv's `gguf`; so the
# conversion and the GGUF checks run in a process of their own
# (`make_v4_bench_model.py --llama-cpp-child ...`), dispatched before the imports
# further down, as in make_v4_fixtures.py.

CHILD_FLAG = "--llama-cpp-child"
CHECK_MARK = "V4-BENCH-GGUF "


def _import_converter(converter: Path):
    """Import llama.cpp's converter (which puts its own gguf-py first on sys.path)."""
    sys.path.insert(0, str(converter.parent))
    importlib.import_module(converter.stem)
    sys.path.insert(0, str(REFERENCE))


def _bf16_experts(self, bid: int, proj: str, tensor_key) -> list[str]:
    """make_v4_fixtures._float_experts (the stand-in for the converter's FP4 ->
    MXFP4 expert repacking) on bf16 experts: each expert is widened to float32
    (exact) for it, and the stack it writes is rounded back to BF16 (exact, the
    values are bf16) the way the converter writes every other BF16 tensor."""
    import gguf
    import make_v4_fixtures

    for eid in range(self.hparams["n_routed_experts"]):
        name = f"layers.{bid}.ffn.experts.{eid}.{proj}.weight"
        lazy = self.model_tensors[name]
        self.model_tensors[name] = lambda lazy=lazy: lazy().float()
    writer = self.gguf_writer
    add_tensor = writer.add_tensor
    bf16 = gguf.GGMLQuantizationType.BF16

    def add_bf16(name, data, **kwargs):
        add_tensor(name, gguf.quants.quantize(data, bf16), raw_dtype=bf16)

    writer.add_tensor = add_bf16
    try:
        return make_v4_fixtures._float_experts(self, bid, proj, tensor_key)
    finally:
        del writer.add_tensor


def _convert_child(argv: list[str]) -> None:
    """argv: convert_with_llama_cpp.py's arguments (--converter PATH, the
    published-layout copy, --outtype bf16, --outfile ...)."""
    converter = Path(argv[argv.index("--converter") + 1]).resolve()
    _import_converter(converter)
    from conversion.deepseek import DeepseekV4Model

    import convert_with_llama_cpp

    DeepseekV4Model._write_mxfp4_expert_tensor = _bf16_experts
    # As in make_v4_fixtures: its prepare_tensors only marks the file MXFP4_MOE.
    del DeepseekV4Model.prepare_tensors
    sys.argv = [convert_with_llama_cpp.__file__, *argv]
    convert_with_llama_cpp.main()


def _gguf_summary(path: Path) -> dict:
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()

    def key(k: str):
        f = r.get_field(f"{arch}.{k}")
        return None if f is None else f.contents()

    types: dict[str, int] = {}
    for t in r.tensors:
        q = gguf.GGMLQuantizationType(t.tensor_type).name
        types[q] = types.get(q, 0) + 1
    return {
        "file": str(path),
        "bytes": path.stat().st_size,
        "architecture": arch,
        "file_type": gguf.LlamaFileType(r.fields["general.file_type"].contents()).name,
        "block_count": key("block_count"),
        "hyper_connection.count": key("hyper_connection.count"),
        "hyper_connection.sinkhorn_iterations": key("hyper_connection.sinkhorn_iterations"),
        "attention.compress_ratios": key("attention.compress_ratios"),
        "attention.compress_rope_freq_base": key("attention.compress_rope_freq_base"),
        "rope.scaling": {k: key(f"rope.scaling.{k}") for k in ("type", "factor", "original_context_length")},
        "hash_layer_count": key("hash_layer_count"),
        "sliding_window": key("attention.sliding_window"),
        "expert_count": key("expert_count"),
        "expert_used_count": key("expert_used_count"),
        "expert_gating_func": key("expert_gating_func"),
        "indexer.top_k": key("attention.indexer.top_k"),
        "tokenizer.pre": r.fields["tokenizer.ggml.pre"].contents(),
        "tensors": len(r.tensors),
        "types": types,
        "gguf_py": str(Path(gguf.__file__).parent),
    }


def _bits(t):
    """A torch tensor's bytes as numpy (bf16 has no numpy dtype)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view("uint16")
    return t.numpy()


def _compare_with_checkpoint(path: Path, hf_dir: Path) -> dict:
    """Every tensor of the converted GGUF against model.safetensors, bit for bit
    (make_v4_fixtures' name tables; expert stacks in expert order)."""
    import re

    import gguf
    import numpy as np
    from make_v4_fixtures import GGUF_EXPERTS, GGUF_LAYER, GGUF_ROOT
    from safetensors.torch import load_file

    got = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    seen: set[str] = set()
    experts: dict[tuple[int, str], dict[int, object]] = {}

    def check(name: str, want) -> None:
        t = got.get(name)
        if t is None:
            raise AssertionError(f"{name} missing from the GGUF")
        q = gguf.GGMLQuantizationType(t.tensor_type)
        data = np.asarray(t.data)
        if q == gguf.GGMLQuantizationType.BF16:
            data = data.view(np.uint16).reshape(want.shape)
        if data.shape != want.shape or data.dtype != want.dtype or data.tobytes() != want.tobytes():
            raise AssertionError(
                f"{name}: {q.name} {data.dtype} {data.shape}, not the checkpoint's {want.dtype} {want.shape}"
            )
        seen.add(name)

    for name, value in load_file(str(hf_dir / "model.safetensors")).items():
        if name in GGUF_ROOT:
            check(GGUF_ROOT[name], _bits(value))
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            raise AssertionError(f"unexpected tensor {name}")
        bid, rest = int(m.group(1)), m.group(2)
        e = re.fullmatch(r"ffn\.experts\.(\d+)\.(w[123])\.weight", rest)
        if e:
            experts.setdefault((bid, e.group(2)), {})[int(e.group(1))] = _bits(value)
        elif rest == "ffn.gate.tid2eid":
            check(f"blk.{bid}.{GGUF_LAYER[rest]}", value.numpy().astype(np.int32))
        else:
            check(f"blk.{bid}.{GGUF_LAYER[rest]}", _bits(value))
    for (bid, w), mats in experts.items():
        check(f"blk.{bid}.{GGUF_EXPERTS[w]}", np.stack([mats[i] for i in range(len(mats))]))
    if seen != set(got):
        raise AssertionError(f"GGUF tensors not in the checkpoint: {sorted(set(got) - seen)}")
    return {"tensors_equal": len(seen), "expert_stacks": len(experts)}


def _check_child(argv: list[str]) -> None:
    """argv: --converter PATH GGUF [--against HF_DIR]; prints one CHECK_MARK line."""
    converter = Path(argv[argv.index("--converter") + 1]).resolve()
    _import_converter(converter)
    path = Path(argv[argv.index("--converter") + 2])
    summary = _gguf_summary(path)
    if "--against" in argv:
        summary.update(_compare_with_checkpoint(path, Path(argv[argv.index("--against") + 1])))
    print(CHECK_MARK + json.dumps(summary), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == [CHILD_FLAG]:
    {"convert": _convert_child, "check": _check_child}[sys.argv[2]](sys.argv[3:])
    sys.exit(0)

# ------------------------------------------------------------ the checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

sys.path.insert(0, str(REFERENCE))

import make_moe_bench_model as v3bench  # noqa: E402
import make_v4_fixtures  # noqa: E402

STD = v3bench.STD
ROUTING_BIAS_STD = v3bench.ROUTING_BIAS_STD
DEFAULT_SEED = v3bench.DEFAULT_SEED
# Spreads of what transformers initialises to constants (sinks and position
# biases 0, mHC base 0 and scale 1, tid2eid 0): small, so the model stays sane.
SINK_STD = 0.5  # per-head logit of the sink (attention scores here are ~0.1)
POSITION_BIAS_STD = 0.1  # added to the compressor's gate logits
HC_BASE_STD = 0.1  # mHC pre/post/comb logits are ~N(0, 1.3) before it
HC_SCALE_STD = 0.1  # around 1

# V4-Flash's YaRN for the compressed branches (its config.json's rope_scaling).
COMPRESS_YARN = {
    "rope_type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
# Prompt for the forward-pass check: past the sliding window and one HCA block.
CHECK_TOKENS = 160
CHECK_TEXT = (
    "The keeper climbed the stairs at dusk, lit the lamp, and watched three ships "
    "pass the point before the fog rolled in from the west. "
)


def bench_config(bos_id: int, eos_id: int) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=v3bench.VOCAB_SIZE,
        hidden_size=1024,
        num_hidden_layers=8,  # default layer_types / mlp_layer_types: HCA HCA HCA CSA HCA CSA HCA CSA; 3 hash
        num_attention_heads=16,
        num_key_value_heads=1,
        head_dim=512,
        partial_rotary_factor=64 / 512,  # qk_rope_head_dim 64
        q_lora_rank=512,
        o_groups=4,
        o_lora_rank=512,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        moe_intermediate_size=512,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=512,
        sliding_window=128,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters=dict(COMPRESS_YARN),
        max_position_embeddings=131072,
        num_nextn_predict_layers=0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        initializer_range=STD,
    )


def randomize(model: DeepseekV4ForCausalLM, seed: int) -> None:
    """Seeded weights, in name order: norms 1, matrices N(0, STD), the V4
    constants small and random, tid2eid distinct experts per token."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    tensors = model.state_dict(keep_vars=True)  # persistent tensors only: not rope's inv_freq
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "tid2eid":
                perm = torch.rand(t.shape[0], cfg.n_routed_experts, generator=gen).argsort(dim=-1)
                t.copy_(perm[:, : t.shape[1]])
            elif leaf == "e_score_correction_bias":
                t.copy_(torch.randn(t.shape, generator=gen) * ROUTING_BIAS_STD)
            elif leaf == "sinks":
                t.copy_(torch.randn(t.shape, generator=gen) * SINK_STD)
            elif leaf == "position_bias":
                t.copy_(torch.randn(t.shape, generator=gen) * POSITION_BIAS_STD)
            elif leaf in ("base", "hc_base"):
                t.copy_(torch.randn(t.shape, generator=gen) * HC_BASE_STD)
            elif leaf in ("scale", "hc_scale"):
                t.copy_(1.0 + torch.randn(t.shape, generator=gen) * HC_SCALE_STD)
            elif leaf == "weight" and "norm" in name.rsplit(".", 2)[-2]:
                t.fill_(1.0)
            elif t.is_floating_point() and t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=gen) * STD)
            else:
                raise ValueError(f"no initialisation rule for {name} {tuple(t.shape)}")


def to_checkpoint_dtypes(model: DeepseekV4ForCausalLM) -> None:
    """bf16, except the modules transformers keeps in float32 (as from_pretrained
    with dtype=bfloat16 would load them)."""
    keep = set(model._keep_in_fp32_modules_strict)
    for name, p in model.named_parameters():
        if not keep & set(name.split(".")):
            p.data = p.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16


def hash_table_entries(model: DeepseekV4ForCausalLM) -> int:
    return sum(t.numel() for n, t in model.state_dict().items() if n.endswith("tid2eid"))


def reload_check(model: DeepseekV4ForCausalLM, hf_dir: Path) -> DeepseekV4ForCausalLM:
    """The saved checkpoint loads back (dtype bfloat16) with every tensor's dtype and bits."""
    reloaded = DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    want, got = model.state_dict(), reloaded.state_dict()
    if set(want) != set(got):
        raise AssertionError(f"reloaded tensors differ: {sorted(set(want) ^ set(got))}")
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or not torch.equal(g, w):
            raise AssertionError(f"{name}: reloaded {g.dtype} differs from the saved {w.dtype}")
    return reloaded


def forward_check(model: DeepseekV4ForCausalLM, tokenizer) -> dict:
    """Logits of a CHECK_TOKENS-token prompt (no cache): finite, with a spread."""
    ids = tokenizer(CHECK_TEXT * 8)["input_ids"][:CHECK_TOKENS]
    if len(ids) != CHECK_TOKENS:
        raise AssertionError(f"the check text has only {len(ids)} tokens")
    start = time.monotonic()
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
    seconds = time.monotonic() - start
    if not torch.isfinite(logits).all():
        raise AssertionError("non-finite logits")
    std = logits.std(dim=-1)
    top = logits.softmax(-1).max(-1).values
    argmax = logits.argmax(-1)
    spread = lambda x, nd: [round(float(v), nd) for v in (x.min(), x.median(), x.max())]  # noqa: E731
    out = {
        "tokens": len(ids),
        "seconds": round(seconds, 2),
        "logit_std_per_position": spread(std, 3),
        "max_abs_logit": round(float(logits.abs().max()), 3),
        "top1_prob": spread(top, 4),
        "distinct_argmax": int(argmax.unique().numel()),
    }
    if not 0.05 < out["logit_std_per_position"][1] < 20 or out["distinct_argmax"] < 2:
        raise AssertionError(f"logits without a sane spread: {out}")
    return out


def make_checkpoint(tokenizer_gguf: Path, hf_dir: Path, seed: int) -> None:
    tokenizer = v3bench.smollm2_tokenizer(tokenizer_gguf)
    cfg = bench_config(tokenizer.bos_token_id, tokenizer.eos_token_id)
    cfg.pad_token_id = tokenizer.pad_token_id
    print(f"layer types {cfg.layer_types}\nmlp layer types {cfg.mlp_layer_types}\n"
          f"compress rates {cfg.compress_rates}, qk_rope_head_dim {cfg.qk_rope_head_dim}\n"
          f"rope_parameters {cfg.rope_parameters}", flush=True)
    start = time.monotonic()
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    randomize(model, seed)
    total, active = v3bench.count_parameters(model, cfg)
    tables = hash_table_entries(model)
    to_checkpoint_dtypes(model)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, getattr(cfg, key))
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    # As make_moe_bench_model: llama.cpp's converter copies add_bos_token from here.
    tc_path = hf_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["add_bos_token"] = tokenizer.add_bos_token
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    print(f"wrote {hf_dir} in {time.monotonic() - start:.0f} s", flush=True)

    dtypes: dict[str, int] = {}
    for t in model.state_dict().values():
        dtypes[str(t.dtype)] = dtypes.get(str(t.dtype), 0) + t.numel()
    reloaded = reload_check(model, hf_dir)
    del model
    print(f"reloaded bit for bit; elements by dtype {dtypes}", flush=True)
    print(f"forward check: {json.dumps(forward_check(reloaded, tokenizer))}", flush=True)
    emb = cfg.vocab_size * cfg.hidden_size
    print(f"parameters: total {total:,} ({total / 1e6:.1f} M), active per token {active:,} "
          f"({active / 1e6:.1f} M, embedding table excluded, lm head included), embedding table {emb:,}; "
          f"both counts include the {tables:,} entries of the 3 hash layers' tid2eid tables", flush=True)


# ---------------------------------------------------------------- the GGUFs


def _child(mode: str, args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), CHILD_FLAG, mode, *args]
    print("$ " + " ".join(cmd), flush=True)
    start = time.monotonic()
    run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    return run, time.monotonic() - start


def check_gguf(converter: Path, path: Path, against: Path | None = None) -> dict:
    args = ["--converter", str(converter), str(path)] + (["--against", str(against)] if against else [])
    run, seconds = _child("check", args)
    marks = [line for line in run.stdout.splitlines() if line.startswith(CHECK_MARK)]
    if run.returncode != 0 or len(marks) != 1:
        raise RuntimeError(f"GGUF check of {path} failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    summary = json.loads(marks[0].removeprefix(CHECK_MARK))
    print(f"{path.name} ({seconds:.0f} s): {json.dumps(summary)}", flush=True)
    if summary["architecture"] != "deepseek4" or summary["hyper_connection.count"] != 4:
        raise AssertionError(f"{path}: not a 4-stream deepseek4 GGUF")
    return summary


def convert(converter: Path, hf_dir: Path, out: Path) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        published = make_v4_fixtures.published_copy(hf_dir, Path(tmp) / NAME)
        args = ["--converter", str(converter), str(published), "--outtype", "bf16", "--outfile", str(out)]
        run, seconds = _child("convert", args + ["--model-name", NAME])
    if run.returncode != 0:
        raise RuntimeError(f"converter failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}")
    print(f"converted in {seconds:.0f} s: {out} ({out.stat().st_size:,} bytes)", flush=True)


def wait_for(path: Path, seconds: float, poll: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.is_file():
        if time.monotonic() >= deadline:
            return False
        print(f"waiting for {path} ...", flush=True)
        time.sleep(poll)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer-gguf", type=Path, required=True, help="a SmolLM2 GGUF (its tokenizer is reused)")
    p.add_argument("--converter", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--llama-quantize", type=Path, required=True, help="llama.cpp's llama-quantize binary")
    p.add_argument("--out-dir", type=Path, default=Path("/work/bench"))
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--quantize-threads", type=int, default=2)
    p.add_argument("--wait-for-quantize", type=float, default=0.0, metavar="SECONDS",
                   help="poll (every 2 minutes) this long for --llama-quantize to appear")
    p.add_argument("--skip-checkpoint", action="store_true", help="reuse OUT_DIR/v4-bench-hf")
    p.add_argument("--skip-convert", action="store_true", help="reuse OUT_DIR/v4-bench.BF16.gguf")
    a = p.parse_args()
    converter = a.converter.resolve()
    if not converter.is_file():
        sys.exit(f"no converter at {converter}")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = a.out_dir / f"{NAME}-hf"
    bf16 = a.out_dir / f"{NAME}.BF16.gguf"
    q8 = a.out_dir / f"{NAME}.Q8_0.gguf"

    if not a.skip_checkpoint:
        make_checkpoint(a.tokenizer_gguf, hf_dir, a.seed)
    if not a.skip_convert:
        convert(converter, hf_dir, bf16)
    check_gguf(converter, bf16, against=hf_dir)

    if not wait_for(a.llama_quantize, a.wait_for_quantize, 120.0):
        sys.exit(f"no llama-quantize at {a.llama_quantize}: stopping after {bf16}")
    cmd = [str(a.llama_quantize), str(bf16), str(q8), "Q8_0", str(a.quantize_threads)]
    print("$ " + " ".join(cmd), flush=True)
    start = time.monotonic()
    run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"llama-quantize failed ({run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    print(f"quantized in {time.monotonic() - start:.0f} s: {q8} ({q8.stat().st_size:,} bytes)", flush=True)
    check_gguf(converter, q8)

    for f in sorted(a.out_dir.glob(f"{NAME}*")):
        size = sum(x.stat().st_size for x in f.rglob("*")) if f.is_dir() else f.stat().st_size
        print(f"{size:>14,}  {f}")


if __name__ == "__main__":
    main()
