#!/usr/bin/env bash
# Build and install polykv-cpp (our llama.cpp build + Python package), fetch the default model, and ask it a
# question about a long document, once with FullKV and once with the calibrated PolyKV plan: each answer
# streams, then its summary shows the tokens evicted, the KV memory against FullKV and the speed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
echo "[polykv-cpp] building and installing (first build: several minutes; ccache makes repeats fast)"
python -m pip install -q --disable-pip-version-check ".[plot]"
model=$(polykv-cpp models fetch | tail -n 1)
echo "[polykv-cpp] model: $model"

# a long real prompt: the first lines (up to 13,000 characters, about 3,700 tokens, so that the document may grow
# without overflowing the 4096-token context) of one of our own documents, ending in a question about its first section
doc=docs/plan-format.md
question="Which two GGUF metadata keys hold a PolyKV plan inside a model file?"
prompt=$(mktemp)
trap 'rm -f "$prompt"' EXIT
{
    printf 'Read the document below, then answer the question after it.\n\n'
    awk '{ n += length($0) + 1; if (n > 13000) exit; print }' "$doc" # whole lines
    printf '\n\nQuestion: %s\n' "$question"
} >"$prompt"
echo "[polykv-cpp] prompt: $doc + \"$question\""
plan=plans/qwen2.5-coder-0.5b-instruct-q4_k_m.ea-budgets-stream.b512.json
run() { polykv-cpp run "$model" --chat -f "$prompt" --no-echo -c 4096 -n 64 "$@"; }
echo
echo "[polykv-cpp] 1/2 FullKV (stock llama.cpp cache), for reference:"
run
echo
echo "[polykv-cpp] 2/2 the calibrated plan ($plan, 512 tokens per layer on average), the prompt streamed"
echo "[polykv-cpp]     with the plan's prefill slack of 2 (at most 2 x the budget per layer until the question is read),"
echo "[polykv-cpp]     the prompt's last 32 tokens (the question) probing each chunk before it is evicted (run's default):"
run --plan "$plan"
echo
echo "[polykv-cpp] where the two answers differ, the facts asked for were evicted while the prompt streamed"
echo "[polykv-cpp] (docs/results.md measures how often, per method and budget)"
