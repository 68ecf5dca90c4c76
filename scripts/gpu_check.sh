#!/usr/bin/env bash
# GPU check: build polykv-cpp's llama.cpp with CUDA for the local GPU only, run the GPU tests (kept positions
# on the GPU equal the CPU's and the numpy reference's), the native tests with every layer offloaded, and
# bench_kv.py at 4K/16K/32K with and without a plan (and at the deepest depth with graph reuse off, and the per-head
# plan with its moved rows copied by the host). Writes gpu_check.md and gpu_check.json into OUT_DIR.
#
#   bash scripts/gpu_check.sh [OUT_DIR]          (default results/gpu-check)
#
# Environment:
#   POLYKV_LLAMA_CPP_SRC  llama.cpp tree at commit 0c1e57098, or a .tar.xz of one (default: the build's own
#                         cached sdist, fetched by pip when missing)
#   GPU_CHECK_MODEL       GGUF for the benchmark (default: the packaged default model when cached, else a
#                         random-weight model of its shape, quantized to Q4_K_M here: same speed, no quality)
#   GPU_CHECK_BUILD       build directory (default build/gpu; kept, so a second run only relinks)
#   GPU_CHECK_CUDA        ON (default) or OFF: OFF builds for the CPU, to try this script where no GPU is
#   CUDA_ARCH             CMAKE_CUDA_ARCHITECTURES (default native: the local GPU only)
#   GPU_CHECK_DEPTHS      bench depths (default 4096,16384,32000)
#   GPU_CHECK_REPS        bench repetitions (default 3)
#   GPU_CHECK_PREFILL     bench prefill length (default 4096)
#   GPU_CHECK_DEADLINE    seconds for the whole check (default 3600): each step gets what is left, and the
#                         steps run in the order of their value (build, GPU tests, bench, offloaded native suites)
#
# The CUDA toolkit's cuBLAS headers and libraries are taken from the toolkit, or else from the pip packages
# nvidia-cublas(-cu12/-cu13) of the Python that runs this (installed from PyPI when missing and pip can reach it).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=$(mkdir -p "${1:-results/gpu-check}" && cd "${1:-results/gpu-check}" && pwd)
BUILD=${GPU_CHECK_BUILD:-$ROOT/build/gpu}
CUDA=${GPU_CHECK_CUDA:-ON}
DEPTHS=${GPU_CHECK_DEPTHS:-4096,16384,32000}
REPS=${GPU_CHECK_REPS:-3}
PY=${PYTHON:-python3}
JOBS=$(nproc)
LOG=$OUT_DIR/gpu_check.log
: >"$LOG"
STEPS=()
T_START=$(date +%s)

say() { echo "[gpu_check $(($(date +%s) - T_START))s] $*" | tee -a "$LOG"; }
# step NAME TIMEOUT_S CMD...: run, log, record status and seconds
DEADLINE=${GPU_CHECK_DEADLINE:-3600}
step() {
    local name=$1 limit=$2; shift 2
    local t0 rc left
    t0=$(date +%s)
    left=$((DEADLINE - (t0 - T_START) - 5))
    if [ "$left" -lt 15 ]; then
        STEPS+=("$name (skipped: out of time)|124|0")
        say "== $name: skipped, out of time"
        return 124
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    say "== $name: $*"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    STEPS+=("$name|$rc|$(($(date +%s) - t0))")
    say "== $name: rc=$rc in $(($(date +%s) - t0)) s"
    return $rc
}

# ---- report: steps, test summaries, bench tables ------------------------------------------------------------
report() {
    local MODEL_NOTE=${MODEL_NOTE:-not reached}
    {
        echo "# GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
        echo
        echo "Command: \`bash scripts/gpu_check.sh\` (CUDA=$CUDA, arch ${CUDA_ARCH:-native}, $JOBS jobs${PROBE_ENV:+; with $PROBE_ENV})."
        echo
        [ "$CUDA" = ON ] && echo "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null); $(nvcc --version 2>/dev/null | grep release)"
        echo
        echo "| step | rc | seconds |"
        echo "|---|---:|---:|"
        for s in "${STEPS[@]}"; do IFS='|' read -r n rc sec <<<"$s"; echo "| $n | $rc | $sec |"; done
        echo
        echo "Tests (last lines of each pytest run):"
        echo
        echo '```'
        grep -E "^(FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)|=+ .*(passed|failed|error))" "$LOG" | tail -40
        echo '```'
        echo
        echo "Benchmark model: $MODEL_NOTE."
        echo
        [ -f "$OUT_DIR/bench_gpu.md" ] && cat "$OUT_DIR/bench_gpu.md"
        if [ -f "$BUILD/bench_noreuse.md" ]; then
            echo
            echo "The same with graph reuse off (LLAMA_GRAPH_REUSE_DISABLE=1):"
            echo
            cat "$BUILD/bench_noreuse.md"
        fi
        if [ -f "$BUILD/bench_unpacked.md" ]; then
            echo
            echo "The shipped plan (evict_every 64) with the groups' graph inputs copied one by one (LLAMA_POLYKV_PACK_INPUTS=0):"
            echo
            cat "$BUILD/bench_unpacked.md"
        fi
        if [ -f "$BUILD/bench_hostrepack.md" ]; then
            echo
            echo "The per-head plan with its moved rows copied by the host (LLAMA_POLYKV_DEVICE_REPACK=0):"
            echo
            cat "$BUILD/bench_hostrepack.md"
        fi
    } >"$OUT_DIR/gpu_check.md"
    "$PY" - "$OUT_DIR" "${STEPS[@]}" <<'EOF'
import json, sys
out, steps = sys.argv[1], sys.argv[2:]
rows = [dict(zip(("step", "rc", "seconds"), s.split("|"))) for s in steps]
json.dump({"steps": [{"step": r["step"], "rc": int(r["rc"]), "seconds": int(r["seconds"])} for r in rows]},
          open(f"{out}/gpu_check.json", "w"), indent=1)
EOF
}

say "machine: $(nproc) cores; $(uname -sr)"
if [ "$CUDA" = ON ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
    nvcc --version 2>&1 | tail -2 | tee -a "$LOG"
fi

# ---- cuBLAS: the toolkit's, else the pip package's -----------------------------------------------------------
CUDA_ARGS=()
if [ "$CUDA" = ON ]; then
    NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
    for root in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do  # nvcc may be a link or a wrapper outside it
        if [ ! -f "$CUDA_ROOT/include/cuda_runtime.h" ] && [ -n "$root" ] && [ -f "$root/include/cuda_runtime.h" ]; then
            CUDA_ROOT=$root
        fi
    done
    if ! ls "$CUDA_ROOT"/include/cublas_v2.h "$CUDA_ROOT"/targets/*/include/cublas_v2.h >/dev/null 2>&1; then
        say "no cublas_v2.h in $CUDA_ROOT: looking for the nvidia-cublas pip package"
        find_cublas() {
            "$PY" - <<'EOF'
import glob, importlib.util, os, sys
for name in ("nvidia.cu13", "nvidia.cublas", "nvidia"):
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        continue
    for root in (spec.submodule_search_locations or []):
        hits = glob.glob(os.path.join(root, "**", "include", "cublas_v2.h"), recursive=True)
        if hits:
            print(os.path.dirname(os.path.dirname(hits[0])))
            sys.exit(0)
sys.exit(1)
EOF
        }
        CUBLAS_ROOT=$(find_cublas) || {
            major=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
            say "installing nvidia-cublas for CUDA $major from PyPI"
            "$PY" -m pip install -q "nvidia-cublas-cu${major}" >>"$LOG" 2>&1 || "$PY" -m pip install -q nvidia-cublas >>"$LOG" 2>&1
            CUBLAS_ROOT=$(find_cublas)
        } || { say "FAIL: no cuBLAS headers (toolkit or pip)"; exit 1; }
        LIB=$(ls -d "$CUBLAS_ROOT"/lib* | head -1)
        LINKS=$BUILD/cuda-links  # the unversioned names the linker wants, outside the (maybe read-only) package
        mkdir -p "$LINKS"
        ln -sf "$(ls "$LIB"/libcublas.so.* | head -1)" "$LINKS/libcublas.so"
        ln -sf "$(ls "$LIB"/libcublasLt.so.* | head -1)" "$LINKS/libcublasLt.so"
        CUDA_ARGS+=("-DCUDA_cublas_LIBRARY=$LINKS/libcublas.so" "-DCUDA_cublasLt_LIBRARY=$LINKS/libcublasLt.so"
                    "-DCMAKE_CUDA_FLAGS=-I$CUBLAS_ROOT/include" "-DCMAKE_CXX_FLAGS=-I$CUBLAS_ROOT/include")
        export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        say "cuBLAS from $CUBLAS_ROOT"
    fi
    # the driver library for ggml's virtual-memory pool: the toolkit's stub, else the driver's own, else no VMM
    if ! ls "$CUDA_ROOT"/lib64/stubs/libcuda.so "$CUDA_ROOT"/targets/*/lib/stubs/libcuda.so >/dev/null 2>&1; then
        DRIVER=$(ldconfig -p 2>/dev/null | sed -n 's/.*libcuda\.so\.1 .*=> //p' | head -1)
        [ -z "$DRIVER" ] && DRIVER=$(ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null | head -1)
        if [ -n "$DRIVER" ]; then
            mkdir -p "$BUILD/cuda-links"
            ln -sf "$DRIVER" "$BUILD/cuda-links/libcuda.so"
            CUDA_ARGS+=("-DCUDA_cuda_driver_LIBRARY=$BUILD/cuda-links/libcuda.so")
            say "CUDA driver library: $DRIVER"
        else
            CUDA_ARGS+=("-DGGML_CUDA_NO_VMM=ON")
            say "no libcuda.so found: building without ggml's VMM pool"
        fi
    fi
    # one GPU: no NCCL. Its library and static archives can carry their own libstdc++ objects, and libstdc++
    # symbols that a backend exports can capture libllama's (a load segfaulted in std::ostream on an H200
    # machine, 2026-11-30, with NCCL found); --exclude-libs keeps what static archives bring private
    CUDA_ARGS+=("-DGGML_CUDA=ON" "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-native}" "-DGGML_CUDA_NCCL=OFF"
                "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL")
fi

# ---- source --------------------------------------------------------------------------------------------------
SRC=${POLYKV_LLAMA_CPP_SRC:-}
if [[ "$SRC" == *.tar.xz || "$SRC" == *.tar.gz ]]; then
    mkdir -p /tmp/gpu-check-llama-src
    step unpack 300 tar -xf "$SRC" -C /tmp/gpu-check-llama-src || exit 1
    SRC=/tmp/gpu-check-llama-src
fi
SRC_ARGS=()
[ -n "$SRC" ] && SRC_ARGS=("-DPOLYKV_LLAMA_CPP_SRC=$SRC")
export POLYKV_CPP_CACHE=${POLYKV_CPP_CACHE:-$BUILD/cache}

# ---- build: libllama (with our sources) and llama-quantize, nothing else ------------------------------------
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
step configure 600 cmake "${GEN[@]}" -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    "${SRC_ARGS[@]}" "${CUDA_ARGS[@]}" || { say "FAIL: configure (see $LOG)"; report; exit 1; }
if [ -z "${GPU_CHECK_CONFIGURE_ONLY:-}" ]; then
    step build 1800 cmake --build "$BUILD" -j "$JOBS" --target llama llama-quantize || { say "FAIL: build"; report; exit 1; }
fi
OUT_BIN=$BUILD/bin  # llama.cpp puts its libraries and tools there
ls -la "$OUT_BIN" >>"$LOG" 2>&1
std_exports() {  # what each library needs and exports of std:: (libllama binds to ggml-cuda's before libstdc++'s)
    for lib in "$OUT_BIN"/libllama.so "$OUT_BIN"/libggml-cuda.so; do
        [ -e "$lib" ] || continue
        { echo "== $lib"; readelf -d "$lib" | grep NEEDED
          # libstdc++'s own (not template instances every C++ library exports): none, unless a static archive
          echo "exported libstdc++ internals: $(nm -DC --defined-only "$lib" | grep -cE ' [A-Za-z] std::(locale|codecvt|ios_base|basic_ostream)')"
          nm -DC --defined-only "$lib" | grep -E ' [A-Za-z] std::(locale|codecvt|ios_base|basic_ostream)' | head -5; } >>"$LOG" 2>&1
    done
}
std_exports
{ echo "== toolchain: $(command -v c++) $(c++ -dumpfullversion 2>/dev/null)"
  echo "libstdc++.so: $(c++ -print-file-name=libstdc++.so)  libstdc++.a: $(c++ -print-file-name=libstdc++.a)"
  echo "== ggml-cuda's link:"; ninja -C "$BUILD" -t commands "$(cd "$BUILD" && ls bin/libggml-cuda.so.*.*.* 2>/dev/null | head -1)" 2>/dev/null | tail -1
} >>"$LOG" 2>&1
if [ -n "${GPU_CHECK_CONFIGURE_ONLY:-}" ]; then  # a machine without a GPU: compile our sources in the CUDA configuration
    OBJS=$(cd "$BUILD" && ninja -t targets all 2>/dev/null | sed -n 's/^\([^:]*llama-polykv[^:]*\.o\):.*/\1/p')
    step compile_ours 1200 ninja -C "$BUILD" $OBJS
    report
    exit $?
fi

# ---- Python: this checkout's package on the library just built ----------------------------------------------
export POLYKV_CPP_LIB_DIR=$OUT_BIN POLYKV_CPP_BIN_DIR=$OUT_BIN
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
step import 120 "$PY" -c "from polykv_cpp import _native; i=_native.version_info(); print(i); \
print('gpu offload:', _native.has_gpu())"

# ---- probe: load a tiny model, offload it, decode; on a crash, try llama.cpp's load switches one by one -------
PROBE=$BUILD/probe.gguf
"$PY" -c "import sys; sys.path.insert(0, 'tests'); from tiny_models import write_tiny_gguf; write_tiny_gguf('$PROBE')" >>"$LOG" 2>&1
PROBE_CODE="from polykv_cpp.api import Model
with Model('$PROBE', n_gpu_layers=99) as m, m.context(n_ctx=256) as c:
    c.decode(list(range(3, 40))); print('probe ok', c.logits()[:3])"
PROBE_ENV=""
PROBE_OK=""
STDCXX=$(ldconfig -p 2>/dev/null | sed -n 's/.*libstdc++\.so\.6 .*=> //p' | head -1)
for variant in "" "LD_PRELOAD=$STDCXX" "LLAMA_ARG_REPACK=0" "GGML_CUDA_NO_PINNED=1" "LLAMA_ARG_LOAD_MODE=none" \
               "LLAMA_ARG_REPACK=0 GGML_CUDA_NO_PINNED=1 LLAMA_ARG_LOAD_MODE=none"; do
    if step "probe${variant:+ ($variant)}" 60 env $variant "$PY" -X faulthandler -c "$PROBE_CODE"; then
        PROBE_ENV=$variant
        PROBE_OK=1
        break
    fi
    if [ -z "$variant" ]; then  # the first failure: llama.cpp's log up to it, and a native backtrace
        POLYKV_CPP_VERBOSE=1 timeout 60 "$PY" -c "$PROBE_CODE" 2>&1 | tail -25 >>"$LOG"
        if command -v cuda-gdb >/dev/null; then
            timeout 90 cuda-gdb -q -batch -ex run -ex bt --args "$PY" -c "$PROBE_CODE" 2>&1 | grep -E "^#|signal|SIG" | head -40 >>"$LOG"
        fi
    fi
done
if [ -z "$PROBE_OK" ] && [ "$CUDA" = ON ]; then
    # last resort, a relink only: the CUDA runtime as a shared library and every shared library's static
    # archives private
    say "every probe crashed: relinking with the shared CUDA runtime"
    step relink_shared_cudart 300 sh -c "cmake -S '$ROOT' -B '$BUILD' -DCMAKE_CUDA_RUNTIME_LIBRARY=Shared \
        && cmake --build '$BUILD' -j $JOBS --target llama llama-quantize"
    std_exports
    step "probe (shared cudart)" 60 "$PY" -X faulthandler -c "$PROBE_CODE" && PROBE_OK=1
elif [ -n "$PROBE_ENV" ]; then
    export $PROBE_ENV
    say "running the rest with $PROBE_ENV"
fi

# ---- tests: kept positions on the GPU (tests/test_gpu.py) ---------------------------------------------------------
step test_gpu 600 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py --junitxml="$OUT_DIR/test_gpu.xml"


# ---- benchmark model --------------------------------------------------------------------------------------------
MODEL=${GPU_CHECK_MODEL:-}
MODEL_NOTE="given"
if [ -z "$MODEL" ]; then
    MODEL=$("$PY" -c "from polykv_cpp import models as m; p=m.model_path(m.DEFAULT_MODEL); print(p or '')" 2>/dev/null)
    MODEL_NOTE="the packaged default model"
fi
if [ -z "$MODEL" ] || [ ! -f "$MODEL" ]; then
    MODEL=$BUILD/random-qwen2.5-coder-0.5b-q4_k_m.gguf
    MODEL_NOTE="random weights in the default model's shape (Qwen2.5-Coder-0.5B, Q4_K_M): speed only"
    if [ ! -f "$MODEL" ]; then
        rm -f "$BUILD/random-f32.gguf"
        step random_model 600 "$PY" scripts/random_model.py --like qwen2.5-coder-0.5b --out "$BUILD/random-f32.gguf" &&
            step quantize 600 "$OUT_BIN/llama-quantize" "$BUILD/random-f32.gguf" "$MODEL" Q4_K_M
        rm -f "$BUILD/random-f32.gguf"
    fi
fi
say "bench model: $MODEL ($MODEL_NOTE)"

# ---- benchmark: FullKV vs uniform SnapKV per layer and per KV head at budget 512 --------------------------------
HEAD_PLAN=$BUILD/snapkv-head-b512.json
"$PY" -c "
from polykv_cpp.api import Model
from polykv_cpp.plan import uniform_plan
with Model('$MODEL', n_gpu_layers=0) as m:
    n = m.n_layer
open('$HEAD_PLAN', 'w').write(uniform_plan(n, 'snapkv', 512, selection='head').to_json())" >>"$LOG" 2>&1
# the shipped plan of the default model (24 layers, as the random model), as it is (evict_every 1) and with
# decode evictions every 64 tokens (what calibrated plans carry)
SHIPPED=$ROOT/plans/qwen2.5-coder-0.5b-instruct-q4_k_m.b512.json
SHIPPED_E64=$BUILD/qwen-b512-e64.json
"$PY" -c "
import json
plan = json.load(open('$SHIPPED'))
plan['evict_every'] = 64
json.dump(plan, open('$SHIPPED_E64', 'w'))" >>"$LOG" 2>&1
PREFILL=${GPU_CHECK_PREFILL:-4096}
MAXD=$( (echo "$DEPTHS" | tr "," "\n"; echo "$PREFILL") | sort -n | tail -1)
NGL=99
[ "$CUDA" = ON ] || NGL=0
step bench 1200 "$PY" scripts/bench_kv.py --model "$MODEL" -ngl "$NGL" -fa on --depths "$DEPTHS" \
    --prefill-len "$PREFILL" --n-gen 64 --reps "$REPS" --ctx $((MAXD + 160)) --uniform snapkv --plan "$HEAD_PLAN" --plan "$SHIPPED" --plan "$SHIPPED_E64" \
    --kv-budget 512 --no-progress --out "$OUT_DIR/bench_gpu.json" --md "$OUT_DIR/bench_gpu.md"

# ---- graph reuse on the GPU: FullKV and the plan with evict_every 64 again, with LLAMA_GRAPH_REUSE_DISABLE=1 ----
REUSE_DEPTH=$(echo "$DEPTHS" | tr "," "\n" | sort -n | tail -1)
step bench_noreuse 300 env LLAMA_GRAPH_REUSE_DISABLE=1 "$PY" scripts/bench_kv.py --model "$MODEL" -ngl "$NGL" -fa on \
    --depths "$REUSE_DEPTH" --prefill-len "$PREFILL" --n-gen 64 --reps "$REPS" --ctx $((MAXD + 160)) --plan "$SHIPPED_E64" \
    --kv-budget 512 --no-progress --out "$BUILD/bench_noreuse.json" --md "$BUILD/bench_noreuse.md"

# ---- per-head moves on the GPU: the per-head plan again with the host copying the moved rows (as before
# session 36: LLAMA_POLYKV_DEVICE_REPACK=0) against the default, one graph per eviction on the device --------------
step bench_hostrepack 300 env LLAMA_POLYKV_DEVICE_REPACK=0 "$PY" scripts/bench_kv.py --model "$MODEL" -ngl "$NGL" -fa on \
    --depths "$REUSE_DEPTH" --prefill-len "$PREFILL" --n-gen 64 --reps "$REPS" --ctx $((MAXD + 160)) --plan "$HEAD_PLAN" \
    --kv-budget 512 --no-progress --out "$BUILD/bench_hostrepack.json" --md "$BUILD/bench_hostrepack.md"

# ---- the groups' graph inputs copied one by one (LLAMA_POLYKV_PACK_INPUTS=0, as before session 53: ~3 synchronous
# copies per layer and ubatch) against the default, packed into one input per type ----------------------------------
step bench_unpacked 300 env LLAMA_POLYKV_PACK_INPUTS=0 "$PY" scripts/bench_kv.py --model "$MODEL" -ngl "$NGL" -fa on \
    --depths "$REUSE_DEPTH" --prefill-len "$PREFILL" --n-gen 64 --reps "$REPS" --ctx $((MAXD + 160)) --plan "$SHIPPED_E64" \
    --kv-budget 512 --no-progress --out "$BUILD/bench_unpacked.json" --md "$BUILD/bench_unpacked.md"

# ---- the native suites with every layer offloaded (last: the CPU runs them in CI) ------------------------------
step test_native_ngl99 900 env LLAMA_ARG_N_GPU_LAYERS=99 POLYKV_SKIP_SLOW=1 "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/test_polykv_native.py tests/test_per_head.py tests/test_device_repack.py tests/test_packed_inputs.py \
    --junitxml="$OUT_DIR/test_native_ngl99.xml"

# ---- report ----------------------------------------------------------------------------------------------------
report
say "report: $OUT_DIR/gpu_check.md"
FAILED=0
for s in "${STEPS[@]}"; do IFS='|' read -r n rc sec <<<"$s"; [ "$rc" = 0 ] || FAILED=1; done
exit $FAILED
