#!/usr/bin/env bash
# libFuzzer (clang) run of the native plan parser and budget resolution under ASan + UBSan (#16 item 1).
#
#   bash scripts/fuzz_native.sh [libFuzzer flags...]     (default: -max_total_time=60)
#
# e.g. `bash scripts/fuzz_native.sh -runs=1000000` or `-max_total_time=30`. The harness is
# native/fuzz/fuzz-plan.cpp; it is built with clang (Debian: `apt-get install clang libclang-rt-14-dev`) against
# nlohmann/json from the pinned llama.cpp source (the build's cache). Inputs: the corpus kept in the repository
# (native/fuzz/corpus, seeded from plans/ and the plans the tests make), read only; what the run adds goes to
# FUZZ_WORK (default build/fuzz/corpus). Findings (crash-*, leak-*, timeout-*) are written to build/fuzz/ and the
# script exits non-zero; each gets a regression input in native/fuzz/regressions.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX_FUZZ="${CXX_FUZZ:-clang++}"
command -v "$CXX_FUZZ" >/dev/null || { echo "fuzz_native.sh: $CXX_FUZZ not found (apt-get install clang libclang-rt-14-dev)" >&2; exit 2; }
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
llama_src=$("$py" -c "
import sys; sys.path.insert(0, 'native')
import prepare_source as p
c = p.default_cache_dir(); c.mkdir(parents=True, exist_ok=True)
print(p.unpack_pristine(c))")
out=build/fuzz
mkdir -p "$out"
work="${FUZZ_WORK:-$out/corpus}"
mkdir -p "$work"
bin="$out/fuzz-plan"
"$CXX_FUZZ" -std=c++17 -g -O1 -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined,float-cast-overflow,implicit-signed-integer-truncation -fno-sanitize-recover=all \
    -I native/src -isystem "$llama_src/vendor" \
    native/fuzz/fuzz-plan.cpp native/src/llama-polykv-plan.cpp -o "$bin"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-max_total_time=60)
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
exec "$bin" -dict=native/fuzz/plan.dict -max_len=65536 -timeout=10 -rss_limit_mb=2048 -artifact_prefix="$out/" -print_final_stats=1 \
    "${args[@]}" "$work" native/fuzz/corpus native/fuzz/regressions
