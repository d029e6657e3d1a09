#!/usr/bin/env bash
# Builds the `kvant` Python package (one abi3 wheel, by maturin) into a venv
# under target/ and runs its pytest suite against PyTorch from PyPI.
#   bash crates/kvant-py/run_tests.sh [pytest args...]
# KVANT_PY_VENV overrides the venv's place (a venv that already has torch
# saves the ~5 GB download); KVANT_PY_PROFILE the cargo profile (default
# `pyext`: optimised, with debug assertions; benchmarks build `release`).
set -euo pipefail
cd "$(dirname "$0")/../.."

venv="${KVANT_PY_VENV:-target/py-venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
venv="$(cd "$venv" && pwd)"
# torch from PyPI (the CUDA build: it runs on the CPU), transformers for the
# Hugging Face patches and references.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "torch>=2.4" "transformers>=4.56" numpy pytest "maturin>=1.7,<2"

# The wheel, installed over any earlier one.
wheels="target/wheels"
rm -f "$wheels"/kvant-*.whl
"$venv/bin/maturin" build --profile "${KVANT_PY_PROFILE:-pyext}" --locked --quiet -m crates/kvant-py/Cargo.toml -o "$wheels" \
  --interpreter "$venv/bin/python"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheels"/kvant-*.whl

# Run from the tests folder so `import kvant` finds the installed wheel, not
# the source tree.
cd crates/kvant-py/tests
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
