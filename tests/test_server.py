"""The stock llama-server with a plan at its defaults: several slots (4, a unified context), continuous batching."""

import importlib.util
import json
from pathlib import Path

import pytest

from polykv_cpp.plan import uniform_plan
from tiny_models import TinyConfig

spec = importlib.util.spec_from_file_location("server_load", Path(__file__).parents[1] / "scripts" / "server_load.py")
server_load = importlib.util.module_from_spec(spec)
spec.loader.exec_module(server_load)


@pytest.mark.parametrize("slots", [[], ["-np", "4"]])  # the default (4 slots, unified context), and 4 streams
def test_server_with_four_slots_answers_concurrent_requests_as_alone(tiny_gguf, tmp_path, slots):
    plan = tmp_path / "plan.json"
    plan.write_text(uniform_plan(TinyConfig().n_layer, "snapkv", 48).to_json())
    out = tmp_path / "load"
    # prompts of 150-300 tokens fit one ubatch, so a request is cut into the same ubatches with or without others
    rc = server_load.main([str(tiny_gguf), "--plan", str(plan), "--clients", "4", "--requests", "2", "--min-tokens",
                           "150", "--max-tokens", "300", "--n-predict", "8", "-c", "8192", "-t", "2", "--alone",
                           "--turns", "2", "--out", str(out), *slots])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    log = (out / "server.log").read_text()
    assert report["n_slots"] == 4 and "4 sequences" in log
    assert report["requests"] == 8 and sum(len(a["tokens"]) for a in report["answers"]) > 8  # (EOS may stop one)
    assert report["same_as_alone"] == 8
    assert report["second_turn"]["cache_n"] > 0 and report["second_turn"]["answer_tokens"] > 0  # the slot's cache reused
    # memory: 4 plan-sized caches (48 + one ubatch of 512 cells, padded to 576, per layer) instead of 8192 shared cells
    n_layer = TinyConfig().n_layer
    assert f"{4 * 576 * n_layer} cells (FullKV: {8192 * n_layer})" in log
    rc = server_load.main([str(tiny_gguf), "--no-plan", "--clients", "1", "--requests", "1", "--min-tokens", "150",
                           "--max-tokens", "150", "--n-predict", "2", "-c", "8192", "-t", "2", "--out", str(tmp_path / "full")])
    full = json.loads((tmp_path / "full" / "report.json").read_text())
    assert rc == 0 and abs(report["kv_mib"] - full["kv_mib"] * 4 * 576 / 8192) < 0.01  # the logs round to 0.01 MiB


def test_a_slots_prompt_cut_by_other_slots_keeps_what_it_keeps_alone(tiny_gguf, tmp_path):
    """Prompts of 150-300 tokens in ubatches of 32 and batches of 64 shared by 4 slots: under load a batch holds the
    other slots' decode tokens and a piece of a prompt that ends anywhere, alone it holds whole ubatches. Chunks are
    cut by position (docs/design.md), so every answer equals the request alone."""
    plan = tmp_path / "plan.json"
    plan.write_text(uniform_plan(TinyConfig().n_layer, "snapkv", 48).to_json())
    out = tmp_path / "load"
    rc = server_load.main([str(tiny_gguf), "--plan", str(plan), "--clients", "4", "--requests", "2", "--min-tokens",
                           "150", "--max-tokens", "300", "--n-predict", "8", "-c", "8192", "-t", "2", "--alone",
                           "--server-args", "-b 64 -ub 32", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["requests"] == 8 and report["same_as_alone"] == 8
