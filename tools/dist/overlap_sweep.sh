#!/usr/bin/env bash
# Two-batch overlap under the modelled network, measured against the α-β
# model: for each latency and bandwidth, four `kvant bench` runs back to
# back on 2 MPI ranks × 1 thread (without and with the network model, each
# without and with --two-batch-overlap), then the model's predictions.
#
#   bash tools/dist/overlap_sweep.sh MODEL OUT_DIR [extra bench flags...]
#
# ROUNDS (default 3) alternates the runs without and with the network
# model that many times; the model compares medians over the rounds (a
# 2-core VM's compute moves by 10-20% between runs).
#
# e.g. MODEL = the default model with "--tp 2" (the default flags), or a
# mixture of experts with "--ep 2". Needs target/release/kvant built with
# `--features mpi`. Prefill only (a batch of one decoded token has nothing
# to split in two).
set -euo pipefail
model="$1"
out="$2"
shift 2
layout=("$@")
[ ${#layout[@]} -gt 0 ] || layout=(--tp 2)
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
bench() {
  mpirun -np 2 --bind-to core target/release/kvant bench --model "$model" --threads 1 \
    --prompt-tokens "${PROMPT_TOKENS:-512}" --gen-tokens 0 --repetitions "${REPETITIONS:-5}" \
    --json "${layout[@]}" "$@"
}
pairs=()
for lat in ${LATENCIES:-2us 20us 100us}; do
  for bw in ${BANDWIDTHS:-0.05 0.1 0.2 1}; do
    tag="${lat}_${bw}"
    for tbo in off on; do
      flag=()
      [ "$tbo" = on ] && flag=(--two-batch-overlap)
      nets=() bases=()
      for round in $(seq "${ROUNDS:-3}"); do
        bench "${flag[@]}" >"$out/base_${tag}_${tbo}_$round.json"
        bench "${flag[@]}" --net-latency "$lat" --net-bandwidth "$bw" >"$out/net_${tag}_${tbo}_$round.json"
        bases+=("$out/base_${tag}_${tbo}_$round.json")
        nets+=("$out/net_${tag}_${tbo}_$round.json")
      done
      pairs+=("$(IFS=,; echo "${nets[*]}"):$(IFS=,; echo "${bases[*]}")")
    done
  done
done
python3 "$(dirname "$0")/alpha_beta.py" predict "${pairs[@]}" | tee "$out/predict.txt"
