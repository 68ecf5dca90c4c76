"""The libFuzzer harness of the native plan parser and budget resolution (native/fuzz/fuzz-plan.cpp, #16 item 1)
runs for 30 s under ASan + UBSan over the kept corpus and the regression inputs. Needs clang with its fuzzer
runtime (Debian: clang, libclang-rt-14-dev), which `.ci/run` installs; elsewhere the test skips unless
POLYKV_REQUIRE_FUZZ=1, as CI sets it."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _libfuzzer_missing() -> str | None:
    if shutil.which("clang++") is None:
        return "no clang++"
    runtime = subprocess.run(["clang++", "-print-runtime-dir"], capture_output=True, text=True).stdout.strip()
    if not (Path(runtime) / f"libclang_rt.fuzzer-{platform.machine()}.a").exists():
        return f"no libFuzzer runtime in {runtime}"
    return None


@pytest.fixture(scope="module")
def libfuzzer():
    missing = _libfuzzer_missing()
    if missing and os.environ.get("POLYKV_REQUIRE_FUZZ") == "1":
        pytest.fail(f"POLYKV_REQUIRE_FUZZ=1 but {missing}")
    if missing:
        pytest.skip(missing)


def test_regression_inputs_are_kept():
    assert sorted(p.name for p in (ROOT / "native/fuzz/regressions").iterdir()), "the regressions folder is empty"
    assert len(list((ROOT / "native/fuzz/corpus").iterdir())) >= 20


def test_native_plan_fuzz_30s(libfuzzer, tmp_path):
    env = {**os.environ, "FUZZ_WORK": str(tmp_path / "corpus")}
    run = subprocess.run(["bash", "scripts/fuzz_native.sh", "-max_total_time=30"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "Done " in log and "stat::number_of_executed_units" in log, log[-2000:]
    executed = int(log.split("stat::number_of_executed_units:")[1].split()[0])
    assert executed > 1000, log[-2000:]
