"""scripts/bad_inputs.py: every bad input of docs/bad-inputs.md gets a message and a non-zero exit, no crash."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "bad_inputs.py"


def test_every_bad_input_gets_a_message_and_no_crash(tmp_path):
    out = tmp_path / "bad-inputs.md"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| input")]
    assert len(rows) >= 40 and all(ln.endswith("| yes |") for ln in rows)
    assert "model files unchanged" in out.read_text()
    assert "PolyKV: LLAMA_POLYKV_PREFILL must be chunked, exact or portable" in out.read_text()
