#!/usr/bin/env bash
# Drives a real `kvant serve` through the official `openai` Python package,
# LangChain's OpenAI adapters and LiteLLM.
#
#   bash tools/serve_tests/run.sh [MODEL]
#
# MODEL: a .gguf or Hugging Face directory (default: the tiny fixture model,
# tests/fixtures/models/llama-gqa). The server binary is $KVANT_BIN, default
# target/debug/kvant (built here with `cargo build --profile test` if absent).
# KVANT_SERVE_RANKS=N runs the server as N MPI ranks under mpirun (a binary
# built with `--features mpi`), with the layout flags in $KVANT_SERVE_LAYOUT
# (e.g. "--tp 2"); the graceful shutdown then goes to rank 0's process.
# KVANT_STRUCTURED_SAMPLES (default 64) sets how many outputs at
# temperature 1 the JSON-schema test validates.
# The venv (openai, langchain-openai, litellm, pytest, jsonschema) lives in $KVANT_SERVE_VENV, default
# target/serve-tests-venv, and is reused. The server listens on a free
# loopback port with an API key; after the tests it gets SIGTERM and must
# exit 0 (graceful shutdown).
set -euo pipefail
cd "$(dirname "$0")/../.."

model="${1:-tests/fixtures/models/llama-gqa}"
bin="${KVANT_BIN:-target/debug/kvant}"
venv="${KVANT_SERVE_VENV:-target/serve-tests-venv}"
name="kvant-test"
key="test-key-$$"

if [ ! -x "$bin" ]; then
  cargo build --locked --profile test -p kvant
fi
if [ ! -x "$venv/bin/pytest" ] || ! LITELLM_LOCAL_MODEL_COST_MAP=True "$venv/bin/python" -c "import openai, jsonschema, langchain_openai, litellm" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check openai pytest jsonschema langchain-openai litellm
fi

log="$(mktemp)"
ranks="${KVANT_SERVE_RANKS:-1}"
launch=()
if [ "$ranks" -gt 1 ]; then
  launch=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    OMPI_MCA_btl_vader_single_copy_mechanism=none KVANT_THREADS=1 KVANT_SERVE_JOB=$$
    mpirun --oversubscribe -x KVANT_API_KEY -np "$ranks")
fi
# The key from the environment (`--api-key` would show it in `ps`).
export KVANT_API_KEY="$key"
# shellcheck disable=SC2086 # the layout is a list of flags
"${launch[@]}" "$bin" serve --model "$model" --host 127.0.0.1 --port 0 --kv-cache-memory 256MiB \
  --served-model-name "$name" --shutdown-grace 5 ${KVANT_SERVE_LAYOUT:-} >"$log" 2>&1 &
pid=$!
# The process that shuts the server down gracefully: the server itself, or
# under mpirun its rank 0 (mpirun's own SIGTERM kills the whole job).
rank0() {
  if [ "$ranks" -le 1 ]; then echo "$pid"; return; fi
  for env in /proc/[0-9]*/environ; do
    vars="$({ tr '\0' '\n' <"$env"; } 2>/dev/null || true)"
    if grep -qx "KVANT_SERVE_JOB=$$" <<<"$vars" && grep -qx "OMPI_COMM_WORLD_RANK=0" <<<"$vars"; then
      basename "$(dirname "$env")"
      return
    fi
  done
}
cleanup() {
  if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$log"
}
trap cleanup EXIT

# The ready line names the address: "kvant serve: NAME on http://HOST:PORT (...)".
url=""
for _ in $(seq 1200); do
  url="$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -n 1 || true)"
  [ -n "$url" ] && break
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "kvant serve exited before it was ready:" >&2
    cat "$log" >&2
    exit 1
  fi
  sleep 0.1
done
if [ -z "$url" ]; then
  echo "kvant serve was not ready after 120 s:" >&2
  cat "$log" >&2
  exit 1
fi

status=0
KVANT_BASE_URL="$url/v1" KVANT_API_KEY="$key" KVANT_SERVED_MODEL="$name" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  -W "ignore::UserWarning:pydantic._internal._generate_schema" tools/serve_tests/test_openai_client.py \
  tools/serve_tests/test_langchain.py tools/serve_tests/test_litellm.py || status=$?

kill -TERM "$(rank0)"
server_status=0
wait "$pid" || server_status=$?
if [ "$server_status" -ne 0 ]; then
  echo "kvant serve exited with status $server_status after SIGTERM:" >&2
  cat "$log" >&2
  exit 1
fi
exit "$status"
