"""The mutation fuzz of PolyKV context states (scripts/fuzz_states.py, #16): 600 mutated states of five plans
(per layer, per head, TOVA, a KVzip prompt scored and not compressed, Expected Attention) are refused with an error
or load and decode on; no crash, abort, hang or stray Python exception. The long runs are in the closing notes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mutated_states_are_refused_or_load_without_a_crash(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts/fuzz_states.py"), "--execs", "600", "--seed", "5",
                          "--out", str(tmp_path / "findings")], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout[run.stdout.index("{"):])
    assert report["inputs"] == 600 and report["findings"] == []
    # the fuzz reaches both sides: states refused with a message, and mutated states that load and decode on
    assert report["outcomes"].get("refused", 0) > 100 and report["outcomes"].get("loaded", 0) > 100
