"""`polykv-cpp calibrate --method runtime`: the plan search measured on the GGUF through the native cache."""

import hashlib

import numpy as np
import pytest

from calibration.runtime import _Measure, build, move_budget, runtime_calibrate
from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.errors import CalibrationError

from conftest import run_cli


def test_move_budget_keeps_the_total_and_b_min():
    b = [100, 100, 100, 100]
    up = move_budget(b, 1, 60, 40)
    assert up is not None and up[1] == 160 and sum(up) == 400 and min(up) >= 40
    down = move_budget(b, 0, -50, 40)
    assert down == [50, 117, 117, 116]
    assert move_budget(b, 0, -70, 40) is None           # below b_min
    assert move_budget([40, 40, 40], 0, 10, 40) is None  # nobody can pay


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def searched(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("rtcal") / "tiny.polykv.gguf"
    before = _sha(tiny_gguf)
    res = runtime_calibrate(tiny_gguf, out, budget=48, samples=2, ctx=384, n_cont=32,
                            patterns=("streamingllm", "h2o", "snapkv"), progress=False, log=lambda m: None)
    assert _sha(tiny_gguf) == before
    return res


def test_search_returns_a_valid_plan_no_worse_than_the_best_uniform(searched, tiny_gguf):
    res = searched
    plan = res.plan
    assert plan.n_layer == 2 and plan.budget_rule == "search"
    assert sum(lp.prefill.budget for lp in plan.layers) == 2 * 48
    assert res.kl_plan <= min(res.kl_uniform.values())
    assert all(v > 0 for v in res.kl_uniform.values())
    accepted = [s.kl for s in res.steps if s.accepted]
    assert accepted == sorted(accepted, reverse=True)
    # the written GGUF carries the plan; measuring the plan again gives the same KL (deterministic)
    assert plan_mod.read_gguf(res.out).to_dict()["layers"] == plan.to_dict()["layers"]


def test_measure_is_zero_for_fullkv_and_reproducible(tiny_gguf):
    from calibration.data import pack, generated_texts

    with Model(tiny_gguf) as model:
        samples = pack(generated_texts(0, n=8, words=400), lambda t: model.tokenize(t, add_special=False),
                       ctx=256, n_samples=2)
        m = _Measure(model, samples, 16, None, False)
        full = plan_mod.uniform_plan(2, "fullkv", m.n_ctx)
        assert m.kl(full) == pytest.approx(0.0, abs=1e-6)
        p = build(2, ["snapkv", "h2o"], [40, 56], 48, 32)
        a, b = m.kl(p), m.kl(p)
        assert a > 1e-4 and a == b


def test_bad_input_is_refused(tiny_gguf, tmp_path):
    with pytest.raises(CalibrationError, match="never modified"):
        runtime_calibrate(tiny_gguf, tiny_gguf, budget=48, progress=False, log=lambda m: None)
    with pytest.raises(CalibrationError, match="n-cont"):
        runtime_calibrate(tiny_gguf, None, budget=48, ctx=256, n_cont=200, progress=False, log=lambda m: None)
    with pytest.raises(CalibrationError, match="nothing to"):
        runtime_calibrate(tiny_gguf, None, budget=300, ctx=256, n_cont=16, progress=False, log=lambda m: None)
    with pytest.raises(CalibrationError, match="not found"):
        runtime_calibrate(tmp_path / "missing.gguf", None, budget=48, progress=False, log=lambda m: None)


def test_cli_runtime_method(cli_exe, tiny_gguf, tmp_path):
    plan_json = tmp_path / "p.json"
    r = run_cli(cli_exe, "calibrate", "--method", "runtime", "--gguf", tiny_gguf, "--budget", "48", "--samples", "1",
                "--ctx", "256", "--n-cont", "16", "--patterns", "streamingllm,tova", "--no-budget-moves",
                "--plan-out", plan_json, "-q")
    assert r.returncode == 0, r.stderr
    assert "plans measured" in r.stdout and plan_json.exists()
    assert plan_mod.load(plan_json).budget_rule == "search"
    r = run_cli(cli_exe, "calibrate", "--method", "runtime", "--gguf", tmp_path / "nope.gguf", "-q")
    assert r.returncode != 0 and "not found" in r.stderr
