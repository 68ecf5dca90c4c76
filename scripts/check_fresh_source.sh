#!/usr/bin/env bash
# The fresh-install check (CI runs it on every submission): prepare the patched llama.cpp tree exactly as
# `pip install .` does, inside pip's isolated build environment, with an empty POLYKV_CPP_CACHE, so that the
# download, sha256 check, unpack and patch series are exercised as on a machine that never built polykv-cpp.
# It builds nothing else (POLYKV_SOURCE_ONLY), so it takes seconds, not the full compile.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
unset POLYKV_LLAMA_CPP_SRC PIP_NO_BUILD_ISOLATION
cache=$(mktemp -d)
out=$(mktemp -d)
trap 'rm -rf "$cache" "$out"' EXIT
echo "[polykv-cpp] fresh-install check: empty cache $cache, pip build isolation"
if ! POLYKV_CPP_CACHE="$cache" python -m pip wheel -q --no-deps --disable-pip-version-check -w "$out/wheel" \
        -C cmake.define.POLYKV_SOURCE_ONLY=ON -C build.targets=polykv-source -C build-dir="$out/build" . \
        >"$out/log" 2>&1; then
    cat "$out/log"
    echo "[polykv-cpp] fresh-install check FAILED: the source could not be prepared from an empty cache" >&2
    exit 1
fi
# the same preparation again must find everything in place: the sdist (sha256-checked), the unpacked tree and
# every one of our files and patches already applied
again=$(POLYKV_CPP_CACHE="$cache" python native/prepare_source.py 2>&1)
if ! grep -q "(0 files rewritten)" <<<"$again" || grep -q "downloading\|unpacking" <<<"$again"; then
    echo "$again"
    echo "[polykv-cpp] fresh-install check FAILED: the prepared tree is incomplete" >&2
    exit 1
fi
tail -n 2 <<<"$again" | head -n 1
echo "[polykv-cpp] fresh-install check passed"
