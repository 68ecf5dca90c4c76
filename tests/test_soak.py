"""scripts/soak.py: its repetition measures, its sampler, and a short run on a tiny model."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from polykv_cpp.plan import uniform_plan

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_distinct_ngrams(soak):
    assert soak.distinct_ngram_share(list(range(100))) == 1.0
    assert soak.distinct_ngram_share([1, 2, 3] * 40) == pytest.approx(3 / 117)
    assert soak.distinct_ngram_share([5, 6]) == 1.0  # shorter than one 4-gram


def test_tail_loop(soak):
    assert soak.tail_loop_length([1, 2, 3, 4, 5, 6]) == 0
    assert soak.tail_loop_length([9, 8] + [1, 2, 3] * 5) == 15
    assert soak.tail_loop_length([4, 7, 7, 7, 7]) == 4
    # a period longer than max_period is not a loop
    assert soak.tail_loop_length(list(range(40)) * 2, max_period=32) == 0


def test_sampler_masks_banned_and_follows_top_k(soak):
    rng = np.random.default_rng(0)
    logits = np.zeros(50, dtype=np.float32)
    logits[[3, 7, 11]] = [10.0, 9.0, 8.0]
    draws = [soak.sample_token(logits, rng, np.array([3]), 1.0, 2, 1.0) for _ in range(200)]
    assert set(draws) == {7, 11}  # 3 banned, top-2 of the rest
    assert draws.count(7) > draws.count(11)
    # top-p this small keeps only the most likely token
    assert {soak.sample_token(logits, rng, np.array([3]), 1.0, 40, 0.01) for _ in range(20)} == {7}


def test_repeat_penalty_is_llama_cpps(soak):
    """llama.cpp's penalty divides a recent token's positive logit and multiplies a negative one: with 9 vs 8 and
    penalty 2 on token 7, token 11 (8) beats 7 (4.5); a negative recent logit moves further down."""
    rng = np.random.default_rng(0)
    logits = np.full(50, -30.0, dtype=np.float32)
    logits[[7, 11]] = [9.0, 8.0]
    assert {soak.sample_token(logits, rng, np.array([], dtype=np.int64), 0.01, 40, 1.0) for _ in range(10)} == {7}
    pick = {soak.sample_token(logits, rng, np.array([], dtype=np.int64), 0.01, 40, 1.0, recent=[7, 7, 2],
                              repeat_penalty=2.0) for _ in range(10)}
    assert pick == {11}
    logits[[7, 11]] = [-1.0, -1.5]
    assert {soak.sample_token(logits, rng, np.array([], dtype=np.int64), 0.01, 40, 1.0, recent=[7],
                              repeat_penalty=2.0) for _ in range(10)} == {11}


def test_loop_verdict_is_relative_to_fullkv(soak):
    def run(*distinct):
        return {"blocks": [{"tokens": 100 * (i + 1), "rss_bytes": 1000, "tok_per_s": 10.0, "distinct_4grams": d}
                           for i, d in enumerate(distinct)]}

    full = run(0.8, 0.2, 0.2)
    assert soak.verdict(run(0.8, 0.15, 0.1), 0, full)["no_loop"]  # repeats as much as FullKV does
    assert not soak.verdict(run(0.8, 0.05, 0.2), 0, full)["no_loop"]  # one block far below FullKV's
    assert not soak.verdict(run(0.8, 0.2, 0.2), 0, None)["no_loop"]  # without FullKV: an absolute floor of 0.3
    assert soak.verdict(run(0.8, 0.5, 0.4), 0, None)["no_loop"]


def test_soak_tiny_model(soak, tiny_gguf, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(uniform_plan(2, "streamingllm", 32).to_json())
    out = tmp_path / "soak.json"
    args = ["--model", str(tiny_gguf), "--plan", str(plan), "--kv-budget", "32", "--tokens", "300", "--every", "100",
            "--warmup", "100", "--n-ubatch", "32", "--threads", "1", "--out", str(out)]
    rc = soak.main(args)
    report = json.loads(out.read_text())
    names = [c["name"] for c in report["configs"]]
    assert names == ["plan", "snapkv", "fullkv"]
    # --resume runs only the configurations the file lacks
    assert soak.main(args + ["--configs", "plan,streamingllm,fullkv", "--resume"]) in (0, 1)
    again = json.loads(out.read_text())
    assert [c["name"] for c in again["configs"]] == ["plan", "streamingllm", "fullkv"]
    assert again["configs"][0]["blocks"] == report["configs"][0]["blocks"]
    with pytest.raises(SystemExit, match="other settings"):
        soak.main([a if a != "300" else "200" for a in args] + ["--resume"])
    with pytest.raises(SystemExit):
        soak.main(args + ["--configs", "plan,nonsense"])
    # --fullkv-from: FullKV's run comes from a soak of another budget (it does not depend on it), never re-run
    other = tmp_path / "b48.json"
    at48 = list(args)
    at48[at48.index("--kv-budget") + 1] = "48"
    at48[at48.index("--out") + 1] = str(other)
    soak.main(at48 + ["--configs", "streamingllm,fullkv", "--fullkv-from", str(out)])
    taken = {c["name"]: c for c in json.loads(other.read_text())["configs"]}
    assert taken["fullkv"]["blocks"] == report["configs"][-1]["blocks"]
    assert taken["streamingllm"]["blocks"][0]["kv_bytes"] > again["configs"][1]["blocks"][0]["kv_bytes"]
    with pytest.raises(SystemExit, match="differ in seed"):
        soak.main(at48 + ["--seed", "7", "--configs", "fullkv", "--fullkv-from", str(out)])
    plan_only = tmp_path / "plan-only.json"
    plan_only.write_text(json.dumps({**report, "configs": report["configs"][:1]}))
    with pytest.raises(SystemExit, match="no fullkv run"):
        soak.main(at48 + ["--configs", "fullkv", "--fullkv-from", str(plan_only)])
    by = {c["name"]: c for c in report["configs"]}
    for c in report["configs"]:
        assert [b["tokens"] for b in c["blocks"]] == [100, 200, 300]
    # the evicting configurations hold a fixed cache far below FullKV's, and evict as they go
    for name in ("plan", "snapkv"):
        kv = {b["kv_bytes"] for b in by[name]["blocks"]}
        assert len(kv) == 1 and kv.pop() < by["fullkv"]["blocks"][0]["kv_bytes"] / 2
        ev = [b["evicted"] for b in by[name]["blocks"]]
        assert ev[0] > 0 and ev == sorted(ev) and ev[-1] > ev[0]
        assert max(b["cells_used"] for b in by[name]["blocks"]) <= 2 * (32 + 32)
    assert by["fullkv"]["blocks"][-1]["evicted"] == 0
    assert out.with_suffix(".md").read_text().count("\n| ") == 4  # header + 3 rows
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    verdicts = [c["verdict"]["rss_ok"] and c["verdict"]["speed_ok"] and c["verdict"]["no_loop"]
                for c in report["configs"] if c["name"] != "fullkv"]
    assert rc == (0 if all(verdicts) else 1)
