"""The coverage-guided atheris fuzz of the Python plan parser and budget arithmetic (scripts/fuzz_plans_atheris.py,
#16 item 1) runs for 30 s from the kept corpus with no finding. Needs atheris, which `.ci/run` installs; elsewhere
the test skips unless POLYKV_REQUIRE_FUZZ=1, as CI sets it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_python_plan_fuzz_30s(tmp_path):
    if importlib.util.find_spec("atheris") is None:
        if os.environ.get("POLYKV_REQUIRE_FUZZ") == "1":
            pytest.fail("POLYKV_REQUIRE_FUZZ=1 but atheris is not installed")
        pytest.skip("atheris is not installed")
    work = tmp_path / "corpus"
    work.mkdir()
    run = subprocess.run([sys.executable, str(ROOT / "scripts/fuzz_plans_atheris.py"), "-max_total_time=30",
                          "-print_final_stats=1", f"-artifact_prefix={tmp_path}/",
                          f"-dict={ROOT / 'native/fuzz/plan.dict'}", str(work),
                          str(ROOT / "native/fuzz/corpus"), str(ROOT / "native/fuzz/regressions")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert not list(tmp_path.glob("crash-*")), log[-4000:]
    executed = int(log.split("stat::number_of_executed_units:")[1].split()[0])
    assert executed > 500, log[-2000:]
