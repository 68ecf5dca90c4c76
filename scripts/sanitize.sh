#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer build of libllama with our sources, then the native tests against
# it (#16 item 2). A separate build folder; the installed package is not touched.
#
#   bash scripts/sanitize.sh [pytest args...]       (default: the native test files below)
#
# SANITIZE_BUILD: the build folder (default build/sanitize). The Python interpreter is not instrumented, so the
# sanitizer runtimes are preloaded; leak detection is off (CPython keeps memory until exit by design). Any report
# aborts the test process (halt_on_error), so a clean run is a pytest pass.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
build="${SANITIZE_BUILD:-build/sanitize}"
version=$(python -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSKBUILD_PROJECT_VERSION="$version" \
    -DLLAMA_SANITIZE_ADDRESS=ON -DLLAMA_SANITIZE_UNDEFINED=ON -DGGML_SANITIZE_ADDRESS=ON -DGGML_SANITIZE_UNDEFINED=ON \
    -DGGML_NATIVE=ON >"$build.configure.log" 2>&1 || { tail -30 "$build.configure.log"; exit 1; }
cmake --build "$build" --target llama llama-completion -j "$(nproc)"
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
    tests=(tests/test_native.py tests/test_polykv_native.py tests/test_per_head.py tests/test_kvzip.py
           tests/test_expected_attention.py tests/test_gemma3.py tests/test_state_files.py
           tests/test_plan_parsers_agree.py)
fi
export LD_PRELOAD="$asan $ubsan"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:print_summary=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export POLYKV_CPP_LIB_DIR="$PWD/$build/bin" POLYKV_CPP_BIN_DIR="$PWD/$build/bin"
exec python -m pytest -q -p no:cacheprovider "${tests[@]}"
