#!/usr/bin/env bash
# Build and install polykv-cpp (our llama.cpp build + Python package), fetch the default model, generate.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
echo "[polykv-cpp] building and installing (first build: a few minutes; ccache makes repeats fast)"
python -m pip install -q --disable-pip-version-check ".[plot]"
model=$(polykv-cpp models fetch | tail -n 1)
echo "[polykv-cpp] model: $model"
# the calibrated plan of the default model (made by `polykv-cpp calibrate --budget 512`, see docs/results.md)
polykv-cpp run "$model" --plan plans/qwen2.5-coder-0.5b-instruct-q4_k_m.b512.json -c 8192 -n 64 -p "def quicksort(arr):
    \"\"\"Sort a list of numbers.\"\"\"
"
