"""The evaluation suite (polykv_cpp.evaluation): task generators, scorers, reports, the runner end to end on a
tiny model, and the `eval` sub-command."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from polykv_cpp.evaluation import report, scoring
from polykv_cpp.evaluation import tasks as T
from polykv_cpp.evaluation.runner import EvalConfig, EvalError, Evaluator, keeps_everything, run_eval

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ tokenizers


def char_tokenize(text: str, add_special: bool, parse_special: bool) -> list[int]:
    """One token per character (+ BOS 1): exact lengths for the generator tests."""
    return ([1] if add_special else []) + [ord(c) % 1000 + 10 for c in text]


def word_tokenize(text: str, add_special: bool, parse_special: bool) -> list[int]:
    return ([1] if add_special else []) + [len(w) for w in re.findall(r"\S+|\n", text)]


def measure_with(tok):
    b = T.PromptBuilder(tok, "none")
    return lambda s: b.count(s) + s.max_new_tokens


@pytest.fixture(scope="module")
def tiny_model(tiny_gguf):
    from polykv_cpp.api import Model

    with Model(tiny_gguf) as m:
        yield m


# -------------------------------------------------------------------------------------- task generators


@pytest.mark.parametrize("task", T.RULER_TASKS)
@pytest.mark.parametrize("length", [2500, 6000])
def test_answer_is_recoverable_from_the_text(task, length):
    samples = T.generate_ruler([task], [length], 2, seed=3, measure=measure_with(word_tokenize))
    assert len(samples) == 2
    for s in samples:
        assert T.answer_in_text(s), (task, s.answers)
        text = s.instruction + s.context
        for a in s.answers:
            assert a in text, a
        assert s.question.strip() and s.metric in scoring.METRICS
        # an answer never leaks into the question part (it must come from the compressed context)
        assert not any(a in s.question + s.answer_prefix for a in s.answers), task


def test_answer_checker_detects_a_broken_sample():
    s = T.generate_ruler(["niah_single"], [3000], 1, seed=0, measure=measure_with(word_tokenize))[0]
    s.context = s.context.replace(s.answers[0], "1234567")
    assert not T.answer_in_text(s)
    v = T.generate_ruler(["vt"], [3000], 1, seed=0, measure=measure_with(word_tokenize))[0]
    v.context = v.context.replace(f"VAR {v.answers[2]} = VAR {v.answers[1]}", "")
    assert not T.answer_in_text(v)
    c = T.generate_ruler(["cwe"], [3000], 1, seed=0, measure=measure_with(word_tokenize))[0]
    c.answers = c.answers[:-1] + ["zzzz"]
    assert not T.answer_in_text(c)


def test_seeds_are_reproducible_and_distinct():
    gen = lambda seed: T.generate_ruler(list(T.RULER_TASKS), [2000], 2, seed=seed,  # noqa: E731
                                        measure=measure_with(word_tokenize))
    a, b, c = gen(7), gen(7), gen(8)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    for x, y in zip(a, c):
        assert x.context != y.context
    # samples of one (task, length) differ from each other
    assert a[0].context != a[1].context and a[0].answers != a[1].answers


@pytest.mark.parametrize("length", [7000, 12000])
def test_lengths_are_as_asked_exact_tokenizer(length):
    m = measure_with(char_tokenize)
    for s in T.generate_ruler(list(T.RULER_TASKS), [length], 1, seed=1, measure=m):
        n = m(s)
        assert n <= length, (s.task, n)
        assert n >= 0.93 * length, (s.task, n)  # filled up to one filler unit of the target
        assert s.meta["n_tokens"] == n


def test_lengths_with_the_model_tokenizer(tiny_model):
    b = T.PromptBuilder(lambda t, a, p: tiny_model.tokenize(t, add_special=a, parse_special=p), "none")
    measure = lambda s: b.count(s) + s.max_new_tokens  # noqa: E731
    for s in T.generate_ruler(["niah_single", "vt", "qa", "qa_2hop"], [2000], 1, seed=0, measure=measure):
        prompt = b.build(s)
        assert prompt.part1 + prompt.part2 == prompt.tokens
        assert prompt.n_prompt + s.max_new_tokens <= 2000
        assert prompt.n_prompt + s.max_new_tokens >= 1800, s.task
        # the model's own tokenizer sees the same count as the builder
        assert len(tiny_model.tokenize(s.instruction + s.context, add_special=True)) == len(prompt.part1)


@pytest.mark.slow
def test_lengths_with_the_real_tokenizer(default_model):
    from polykv_cpp.api import Model

    with Model(default_model, vocab_only=True) as m:
        chat = T.detect_chat_format(m.meta("tokenizer.chat_template"))
        assert chat == "chatml-qwen"
        b = T.PromptBuilder(lambda t, a, p: m.tokenize(t, add_special=a, parse_special=p), chat)
        measure = lambda s: b.count(s) + s.max_new_tokens  # noqa: E731
        for s in T.generate_ruler(list(T.RULER_TASKS), [4096, 8192], 1, seed=0, measure=measure):
            n = b.build(s).n_prompt + s.max_new_tokens
            assert 0.97 * s.length <= n <= s.length, (s.task, s.length, n)
            assert T.answer_in_text(s)


def test_needles_sit_at_their_depths():
    for s in T.generate_ruler(["niah_multikey"], [6000], 3, seed=2, measure=measure_with(word_tokenize)):
        ctx = s.context
        for key, depth in zip(s.meta["keys"], s.meta["depths"]):
            pos = ctx.index(f"numbers for {key} is:") / len(ctx)
            assert abs(pos - depth) < 0.08, (key, pos, depth)


def test_haystack_choice_and_unknown_task():
    a = T.make_ruler_sample("niah_single", 1000, 0, 0, 20, haystack="noise")
    b = T.make_ruler_sample("niah_single", 1000, 0, 0, 20, haystack="text")
    assert T.NOISE in a.context and T.NOISE not in b.context
    assert b.meta["haystack"] in ("text", "noise")
    with pytest.raises(T.TaskError, match="unknown task"):
        T.make_ruler_sample("nope", 1000, 0, 0, 5)
    with pytest.raises(T.TaskError, match="task qa: length 50 is too small"):
        T.generate_ruler(["qa"], [50], 1, seed=0, measure=measure_with(char_tokenize))


def test_prompt_builder_chat_parts_and_truncation():
    calls = []

    def tok(text, add_special, parse_special):
        calls.append((text, add_special, parse_special))
        return char_tokenize(text, add_special, parse_special)

    s = T.Sample(kind="longbench", task="hotpotqa", length=200, index=0, instruction="Read:\n",
                 context="A" * 100 + "B" * 100, question="\nQ?", answer_prefix=" A:", answers=["x"], metric="qa_f1",
                 max_new_tokens=10)
    b = T.PromptBuilder(tok, "chatml")
    full = b.build(s)
    fmt = T.CHAT_FORMATS["chatml"]
    assert len(full.part1) == 1 + len(fmt.user_prefix) + len("Read:\n") + 200
    assert len(full.part2) == len("\nQ?") + len(fmt.user_suffix) + len(" A:")
    # template pieces are parsed for special tokens, the texts are not
    assert (fmt.user_prefix, True, True) in calls and ("Read:\n" + s.context, False, False) in calls
    cut = b.build(s, max_prompt=150)
    assert cut.n_prompt == 150 and cut.n_truncated == full.n_prompt - 150
    kept = cut.part1[1 + len(fmt.user_prefix) + len("Read:\n"):]
    assert kept[0] == char_tokenize("A", False, False)[0] and kept[-1] == char_tokenize("B", False, False)[0]
    # no chat wrapping for samples that opt out (LongBench few-shot tasks)
    s.use_chat = False
    assert b.build(s).n_prompt == 1 + len("Read:\n") + 200 + len("\nQ?") + len(" A:")
    assert T.detect_chat_format("{% ... <|im_start|> ... %}") == "chatml"
    assert T.detect_chat_format(None) == "none"


def test_builtin_texts_and_user_texts(tmp_path):
    srcs = T.builtin_texts()
    assert srcs and srcs[0].name == "python-docs" and len(srcs[0].text) > 100_000
    ids = T.text_tokens(srcs[0], 5000, word_tokenize)
    assert ids is not None and len(ids) == 5000
    f = tmp_path / "short.txt"
    f.write_text("only a few words")
    (u,) = T.user_texts([f])
    assert T.text_tokens(u, 100, word_tokenize) is None
    with pytest.raises(T.TaskError, match="not found"):
        T.user_texts([tmp_path / "missing.txt"])


def test_longbench_from_local_files_and_clear_message_otherwise(tmp_path, monkeypatch):
    rec = {"input": "Who wrote it?", "context": "Passage 1: Ann wrote the book.", "answers": ["Ann"],
           "all_classes": None, "_id": "x1"}
    (tmp_path / "hotpotqa.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    samples, status = T.load_longbench(["hotpotqa", "trec"], 1, data_dir=tmp_path, length=512)
    assert len(samples) == 1 and samples[0].answers == ["Ann"] and samples[0].metric == "qa_f1"
    assert samples[0].context == rec["context"] and "Who wrote it?" in samples[0].question
    assert samples[0].instruction.startswith("Answer the question based on the given passages")
    assert status["hotpotqa"].endswith("hotpotqa.jsonl")
    assert status["trec"].startswith("unavailable") and "trec.jsonl" in status["trec"]

    datasets = pytest.importorskip("datasets")

    def boom(*a, **k):
        raise ConnectionError("Couldn't reach the Hugging Face Hub (offline mode is enabled)")

    monkeypatch.setattr(datasets, "load_dataset", boom)
    samples, status = T.load_longbench(["qasper"], 1)
    assert samples == []
    assert "not available locally" in status["qasper"] and "--longbench-dir" in status["qasper"]


# ---------------------------------------------------------------------------------------------- scorers


def test_ruler_string_match():
    assert scoring.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert scoring.string_match_all("ABCDE, fghij", ["abcde", "FGHIJ"]) == 1.0
    assert scoring.string_match_all("nothing", []) == 0.0
    assert scoring.string_match_part("It is Paris.", ["London", "paris"]) == 1.0
    assert scoring.string_match_part("It is Rome.", ["London", "paris"]) == 0.0
    assert scoring.score("match_all", "<|im_start|> 1234567<|im_end|>", ["1234567"]) == 1.0
    assert scoring.clean_prediction("  x<|im_end|>\n") == "x"


def test_longbench_metrics():
    assert scoring.qa_f1("The Eiffel Tower", "eiffel tower") == 1.0
    assert scoring.qa_f1("in Paris France", "Paris") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert scoring.qa_f1("nope", "Paris") == 0.0
    assert scoring.rouge_l("a b c d", "a b c d") == 1.0
    assert scoring.rouge_l("a x b y", "a b") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert scoring.rouge_l("", "a") == 0.0
    assert scoring.classification("It is a Location question", "Location",
                                  all_classes=["Location", "Person", "Number"]) == 1.0
    assert scoring.classification("Person or Location", "Location",
                                  all_classes=["Location", "Person"]) == 0.5
    assert scoring.retrieval("Paragraph 12", "Paragraph 12") == 1.0
    assert scoring.retrieval("Paragraph 3 or 12", "Paragraph 12") == 0.5
    assert scoring.count("There are 7 unique", "7") == 1.0
    assert scoring.count("none", "7") == 0.0
    assert scoring.code_sim("# comment\nreturn x + 1\n", "return x + 1") == 1.0
    assert scoring.score("qa_f1", "Ann\nand more", ["Bob", "Ann"], first_line=True) == 1.0
    with pytest.raises(ValueError, match="unknown metric"):
        scoring.score("bleu", "a", ["a"])


def test_kl_perplexity_and_gap():
    lp = scoring.log_softmax(np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]))
    assert np.allclose(np.exp(lp).sum(axis=-1), 1.0, atol=1e-6)
    assert np.allclose(scoring.kl_divergence(lp, lp), 0.0, atol=1e-7)
    p, q = np.log(np.array([[0.5, 0.5]])), np.log(np.array([[0.9, 0.1]]))
    assert scoring.kl_divergence(p, q)[0] == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1))
    assert scoring.perplexity([math.log(4.0)] * 3) == pytest.approx(4.0)
    # gap recovered: (plan - best) / (full - best)
    assert scoring.gap_recovered(37.79, 36.35, 38.99) == pytest.approx((37.79 - 36.35) / (38.99 - 36.35))
    assert scoring.gap_recovered(30.0, 36.0, 40.0) == pytest.approx(-1.5)
    assert scoring.gap_recovered(0.05, 0.10, 0.0, higher_is_better=False) == pytest.approx(0.5)
    assert scoring.gap_recovered(50.0, 40.0, 40.0) is None  # no gap
    assert scoring.gap_recovered(50.0, 45.0, 40.0) is None  # FullKV worse than the baseline
    assert scoring.gap_recovered(None, 1.0, 2.0) is None
    assert scoring.best_baseline({"h2o": 3.0, "snapkv": 5.0, "polykv": 9.0}, ["h2o", "snapkv"]) == ("snapkv", 5.0)
    assert scoring.best_baseline({"h2o": 3.0, "snapkv": 5.0}, ["h2o", "snapkv"], False) == ("h2o", 3.0)


def _rec(task, method, budget, score, protocol="query-aware", length=100):
    return {"kind": "ruler", "task": task, "length": length, "index": 0, "protocol": protocol, "method": method,
            "budget": budget, "score": score}


def test_summary_and_markdown_from_records():
    recs = [_rec("a", "fullkv", None, 1.0), _rec("b", "fullkv", None, 0.8),
            _rec("a", "snapkv", 64, 0.6), _rec("b", "snapkv", 64, 0.4),
            _rec("a", "h2o", 64, 0.2), _rec("b", "h2o", 64, 0.2),
            _rec("a", "polykv", 64, 0.8), _rec("b", "polykv", 64, 0.5)]
    data = {"records": recs, "methods": ["fullkv", "h2o", "snapkv", "polykv"], "plans": {"polykv": {}},
            "config": {"lengths": [100]}, "protocols": {"query-aware": "q in prompt"}}
    summ = report.summarize(data)
    cell = summ["ruler"]["query-aware"]["100"]
    assert cell["fullkv"]["full"]["avg"] == pytest.approx(90.0)
    assert cell["snapkv"]["64"]["tasks"] == {"a": pytest.approx(60.0), "b": pytest.approx(40.0)}
    g = summ["gap_recovered"]["ruler"]["query-aware"]["100"]["polykv"]["64"]
    assert g["best"] == "snapkv" and g["value"] == pytest.approx((65 - 50) / (90 - 50))
    data["summary"] = summ
    md = report.to_markdown(data)
    assert "protocol: query-aware" in md and "gap recovered by polykv" in md
    assert re.search(r"38% \[-?\d+%, -?\d+%\] \(vs snapkv\)", md)
    # one sample per task: every replicate draws that sample, so the intervals are points
    assert cell["snapkv"]["64"]["ci95"] == [pytest.approx(50.0), pytest.approx(50.0)]
    assert "50.0 [50.0-50.0]" in md


def test_bootstrap_intervals_are_paired_stratified_and_cover_the_average():
    rng = np.random.default_rng(1)
    a = {t: {i: float(x) for i, x in enumerate(rng.random(30) < p)} for t, p in (("t1", 0.7), ("t2", 0.3))}
    same = {t: dict(v) for t, v in a.items()}
    ones = {t: {i: 1.0 for i in v} for t, v in a.items()}
    reps = report.bootstrap_task_average({"a": a, "same": same, "ones": ones}, n_boot=500)
    avg = 100 * np.mean([np.mean(list(v.values())) for v in a.values()])
    lo, hi = report.interval(reps["a"])
    assert lo < avg < hi and 10 < hi - lo < 40          # 60 binary samples: an interval of about +-12 points
    assert np.all(reps["a"] == reps["same"])            # paired: the same draws for every method
    assert report.interval(reps["ones"]) == [100.0, 100.0]
    # more samples, narrower interval
    big = {t: {i: float(x) for i, x in enumerate(rng.random(600) < 0.5)} for t in ("t1", "t2")}
    lo2, hi2 = report.interval(report.bootstrap_task_average({"big": big}, n_boot=500)["big"])
    assert hi2 - lo2 < (hi - lo) / 2


def test_gap_interval_from_paired_replicates():
    recs = []
    rng = np.random.default_rng(2)
    for i in range(20):
        for task in ("a", "b"):
            rec = lambda m, b, s: {**_rec(task, m, b, s), "index": i}  # noqa: E731
            recs += [rec("fullkv", None, 1.0), rec("snapkv", 64, float(rng.random() < 0.4)),
                     rec("polykv", 64, float(rng.random() < 0.7))]
    data = {"records": recs, "methods": ["fullkv", "snapkv", "polykv"], "plans": {"polykv": {}},
            "config": {"lengths": [100]}}
    g = report.summarize(data)["gap_recovered"]["ruler"]["query-aware"]["100"]["polykv"]["64"]
    lo, hi = g["ci95"]
    assert lo < g["value"] < hi
    assert g["diff_ci95"][0] < g["plan"] - g["best_value"] < g["diff_ci95"][1]


# ------------------------------------------------------------------------------------------- end to end

TINY_BASE = dict(lengths=[600], budgets=[48, 1024], n_samples=1, tasks=["niah_single", "vt", "qa"],
                 ppl_tokens=8, n_ppl_texts=1, n_ubatch=64, n_threads=1, progress=False)


def _mixed_plan(tmp_path: Path) -> Path:
    """A hand-made 'calibrated' plan for the 2-layer tiny model: snapkv then h2o/tova, unequal budgets."""
    from polykv_cpp.plan import Plan

    plan = {"version": 1, "n_layer": 2, "budget_avg": 96, "b_min": 40, "budget_rule": "manual",
            "layers": [{"layer": 0, "prefill": {"pattern": "snapkv", "budget": 128, "window": 16, "obs_window": 16,
                                                "pool_kernel": 7},
                        "decode": {"pattern": "h2o", "budget": 128, "window": 16}},
                       {"layer": 1, "prefill": {"pattern": "h2o", "budget": 64, "window": 16},
                        "decode": {"pattern": "tova", "budget": 64, "window": 1}}]}
    p = tmp_path / "mixed.json"
    p.write_text(Plan.from_dict(plan).validate(n_layer=2).to_json())
    return p


@pytest.fixture(scope="module")
def tiny_run(tiny_gguf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    plan = _mixed_plan(tmp)
    cfg = EvalConfig(model=str(tiny_gguf), out_dir=str(tmp / "out"), plans=[str(plan)], **TINY_BASE)
    return cfg, run_eval(cfg, log=lambda m: None), tmp


def test_end_to_end_tiny_run_writes_json_markdown_png(tiny_run):
    cfg, res, _ = tiny_run
    out = Path(cfg.out_dir)
    data = json.loads((out / "results.json").read_text())
    assert data["format"] == "polykv-eval-results" and data["partial"] is False
    assert data["methods"] == ["fullkv", "streamingllm", "h2o", "snapkv", "tova", "knorm", "pyramidkv", "polykv"]
    # every (sample, protocol, method, budget) has exactly one scored record
    samples = [s["key"] for s in data["samples"]]
    assert len(samples) == 3
    task_recs = [r for r in data["records"] if r["kind"] == "ruler"]
    n_runs = 1 + 7 * 2
    assert len(task_recs) == len(samples) * 2 * n_runs
    assert {r["protocol"] for r in task_recs} == {"query-aware", "query-agnostic"}
    assert all(0.0 <= r["score"] <= 1.0 and isinstance(r["prediction"], str) for r in task_recs)
    assert all(r["status"] == "ok" for r in data["runs"]), data["runs"]
    # compressed runs really hold less KV than FullKV; budget 1024 >= every token: copied from FullKV
    kv = {(r["method"], r["budget"]): r for r in data["runs"]}
    assert kv[("snapkv", 48)]["kv_bytes"] < kv[("fullkv", None)]["kv_bytes"]
    copied = [r for r in task_recs if r.get("reused_from")]
    assert copied and all(r["budget"] == 1024 for r in copied)
    # exact prefill (default): one prefill per sample, loaded by every other run
    assert data["reuse"]["fullkv_protocols_shared"] == 3
    assert data["reuse"]["prompt_tokens_shared"] > 0
    assert data["reuse"]["prompt_tokens_reused"] >= 5 * data["reuse"]["prompt_tokens_shared"]
    # perplexity / KL
    ppl = {(r["method"], r["budget"]): r for r in data["records"] if r["kind"] == "ppl"}
    assert ppl[("fullkv", None)]["kl"] == 0.0 and ppl[("fullkv", None)]["ppl"] > 1
    assert ppl[("h2o", 48)]["kl"] > 0 and ppl[("h2o", 48)]["n_scored"] == 8
    assert ppl[("h2o", 1024)]["kl"] == 0.0
    # summary, gap, markdown, plots
    summ = data["summary"]
    assert set(summ["ruler"]) == {"query-aware", "query-agnostic"}
    assert "polykv" in summ["gap_recovered"]["ppl"]["kl"]["all"]
    md = (out / "results.md").read_text()
    for needle in ("query-aware", "query-agnostic", "## What was reused", "polykv", "Perplexity and KL",
                   "| method | 48 (8.0%) | 1024 (170.7%) |", "mixed.json"):
        assert needle in md, needle
    for png in ("score_vs_budget.png", "tasks_query-aware.png", "tasks_query-agnostic.png", "ppl_vs_budget.png"):
        blob = (out / png).read_bytes()
        assert blob.startswith(PNG_MAGIC) and len(blob) > 5000, png
        assert f"]({png})" in md


def test_reuse_changes_nothing_that_it_claims_to_keep(tiny_run, tiny_gguf):
    cfg, res, tmp = tiny_run
    cfg2 = EvalConfig(model=str(tiny_gguf), out_dir=str(tmp / "noreuse"), plans=cfg.plans, reuse=False, png=False,
                      **TINY_BASE)
    res2 = run_eval(cfg2, log=lambda m: None)
    key = lambda r: (r["kind"], r["task"], r["protocol"], r["method"], r["budget"])  # noqa: E731
    a = {key(r): r for r in res["records"]}
    b = {key(r): r for r in res2["records"]}
    assert a.keys() == b.keys()
    assert res2["reuse"]["copied_from_fullkv"] == 0 and res2["reuse"]["prompt_tokens_reused"] == 0
    for k, r in a.items():
        # without reuse every run prefills each sample itself (exact prefill): a shared prefill loaded into the
        # run's context, and a copy from FullKV where nothing can be evicted, give the same results
        if r["kind"] == "ppl":
            assert b[k]["nll"] == pytest.approx(r["nll"], abs=1e-3), k
        else:
            assert b[k]["prediction"] == r["prediction"], k


def test_resume_skips_finished_work_and_refuses_another_config(tiny_run, tiny_gguf):
    cfg, res, _ = tiny_run
    ev = Evaluator(EvalConfig(model=str(tiny_gguf), out_dir=cfg.out_dir, plans=cfg.plans, resume=True,
                              png=False, **TINY_BASE), log=lambda m: None)
    ev.setup()
    again = ev.run()
    ev.model.close()
    assert ev.reuse["contexts_created"] == 0
    assert len(again["records"]) == len(res["records"])
    bad = EvalConfig(model=str(tiny_gguf), out_dir=cfg.out_dir, plans=cfg.plans, resume=True, **{**TINY_BASE,
                                                                                               "n_ubatch": 32})
    with pytest.raises(EvalError, match="another configuration"):
        Evaluator(bad, log=lambda m: None).setup()


def test_resume_adds_a_plan_to_a_finished_sweep(tiny_run, tiny_gguf, tmp_path):
    import shutil

    from polykv_cpp.plan import uniform_plan

    cfg, res, _ = tiny_run
    out = tmp_path / "sweep"
    shutil.copytree(cfg.out_dir, out)
    other = tmp_path / "other.json"
    other.write_text(uniform_plan(2, "tova", 96).to_json())
    ev = Evaluator(EvalConfig(model=str(tiny_gguf), out_dir=str(out), plans=[*cfg.plans, f"other={other}"],
                              resume=True, png=False, **TINY_BASE), log=lambda m: None)
    ev.setup()
    again = ev.run()
    ev.model.close()
    old = {(r["kind"], r["task"], r["protocol"], r["method"], r["budget"]): r for r in res["records"]}
    new = {(r["kind"], r["task"], r["protocol"], r["method"], r["budget"]): r for r in again["records"]}
    assert {k[3] for k in set(new) - set(old)} == {"other"}
    assert all(new[k]["prediction" if k[0] != "ppl" else "nll"] == v["prediction" if k[0] != "ppl" else "nll"]
               for k, v in old.items())
    assert "other" in again["summary"]["gap_recovered"]["ppl"]["kl"]["all"]
    runs = {(r["method"], r["budget"]): r for r in again["runs"]}
    assert runs[("snapkv", 48)]["kv_bytes"] == {(r["method"], r["budget"]): r for r in res["runs"]}[("snapkv", 48)]["kv_bytes"]
    changed = tmp_path / "changed.json"
    changed.write_text(uniform_plan(2, "h2o", 96, window=16).to_json())
    with pytest.raises(EvalError, match="plan 'polykv'"):
        Evaluator(EvalConfig(model=str(tiny_gguf), out_dir=str(out), plans=[f"polykv={changed}"], resume=True,
                             png=False, **TINY_BASE), log=lambda m: None).setup()


def test_state_cache_replaces_the_prefill_and_changes_no_answer(tiny_run, tiny_gguf, tmp_path):
    cfg, res, _ = tiny_run
    cache = tmp_path / "states"
    base = {**TINY_BASE, "budgets": [48], "ppl": False, "png": False}
    first = Evaluator(EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path / "a"), plans=cfg.plans,
                                 state_cache=str(cache), **base), log=lambda m: None)
    first.setup()
    r1 = first.run()
    first.model.close()
    assert first.reuse["prompt_states_loaded"] == 0 and len(list(cache.glob("*.npz"))) == 3
    # a later evaluation loads every prompt state: nothing is prefilled (FullKV answers from the loaded state)
    second = Evaluator(EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path / "b"), plans=cfg.plans,
                                  state_cache=str(cache), **base), log=lambda m: None)
    second.setup()
    fed: list[tuple[str, int]] = []  # (method, tokens) of every multi-token decode
    make_context = second._context

    def recording_context(run, prefill="chunked"):
        ctx = make_context(run, prefill)
        decode = ctx.decode

        def recorded(tokens, **kw):
            if len(tokens) > 1:
                fed.append((run.method, len(tokens)))
            return decode(tokens, **kw)
        ctx.decode = recorded
        return ctx
    second._context = recording_context
    r2 = second.run()
    second.model.close()
    assert second.reuse["prompt_states_loaded"] == 3
    questions = {len(p.part2) for p in second.prompts.values()}
    assert fed and all(m != "fullkv" and n in questions for m, n in fed)  # the query-agnostic questions only
    key = lambda r: (r["task"], r["protocol"], r["method"], r["budget"])  # noqa: E731
    old = {key(r): r["prediction"] for r in res["records"] if r["kind"] == "ruler" and r["budget"] in (48, None)}
    for recs in (r1["records"], r2["records"]):
        new = {key(r): r["prediction"] for r in recs if r["kind"] == "ruler"}
        assert new and all(old[k] == v for k, v in new.items())
    # another context layout never loads these states; a damaged file is prefilled again
    third = Evaluator(EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path / "c"), plans=cfg.plans,
                                 state_cache=str(cache), **{**base, "n_ubatch": 32}), log=lambda m: None)
    third.setup()
    assert all(third.state_cache.load(p.part1, p.part2) is None for p in third.prompts.values())
    third.model.close()
    one = next(cache.glob("*.npz"))
    one.write_bytes(b"damaged")
    assert sum(second.state_cache.load(p.part1, p.part2) is None for p in second.prompts.values()) == 1
    with pytest.raises(EvalError, match="--state-cache needs --prefill exact"):
        EvalConfig(model=str(tiny_gguf), state_cache=str(cache), prefill="chunked").validate()


def test_a_plan_runs_as_written_at_its_own_budget_and_rescaled_elsewhere(tiny_gguf, tmp_path):
    from polykv_cpp.plan import Plan, uniform_plan

    # prefill 40, decode 64: room for the answer before decode evicts (not an exact-total plan)
    d = uniform_plan(2, "snapkv", 64, window=16, obs_window=16).to_dict()
    d["exact_total"] = False
    for layer in d["layers"]:
        layer["prefill"]["budget"] = 40
    path = tmp_path / "headroom.json"
    path.write_text(Plan.from_dict(d).validate(n_layer=2).to_json())
    ev = Evaluator(EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path / "out"), plans=[f"room={path}"],
                              methods=["fullkv"], **{**TINY_BASE, "budgets": [64, 128]}), log=lambda m: None)
    ev.setup()
    ev.model.close()
    runs = {r.budget: r.plan for r in ev.runs if r.method == "room"}
    assert runs[64].token_budgets("prefill") == [40, 40] and runs[64].token_budgets("decode") == [64, 64]
    assert runs[128].token_budgets("prefill") == runs[128].token_budgets("decode") == [128, 128]


def test_a_model_files_two_plans_are_two_methods(tiny_gguf, tmp_path):
    from polykv_cpp.plan import uniform_plan, write_gguf

    main, qag = uniform_plan(2, "snapkv", 64, window=16, obs_window=16), uniform_plan(2, "h2o", 48, window=16)
    both = write_gguf(tiny_gguf, tmp_path / "both.gguf", main, query_agnostic_plan=qag)
    for plan_from_gguf, want in (("auto", {"polykv": main, "polykv-query-agnostic": qag}), ("no", {})):
        ev = Evaluator(EvalConfig(model=str(both), out_dir=str(tmp_path / plan_from_gguf), methods=["fullkv"],
                                  plan_from_gguf=plan_from_gguf, **TINY_BASE), log=lambda m: None)
        ev.setup()
        ev.model.close()
        assert ev.plans == want
        assert {r.method for r in ev.runs} == {"fullkv", *want}


def test_unsupported_model_falls_back_to_fullkv(tiny_gguf, tmp_path, monkeypatch):
    reason = "PolyKV: architecture 'gemma3' is not supported yet"
    monkeypatch.setattr(Evaluator, "_probe_plan_support", lambda self, plan: reason)
    cfg = EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path), png=False, ppl=False,
                     **{**TINY_BASE, "tasks": ["niah_single"], "budgets": [48]})
    res = run_eval(cfg, log=lambda m: None)
    assert {r["method"] for r in res["records"]} == {"fullkv"}
    assert all(r["status"].startswith("unsupported") for r in res["runs"] if r["method"] != "fullkv")
    md = (tmp_path / "results.md").read_text()
    assert "does not support this model" in md and "Only FullKV is evaluated" in md


@pytest.mark.slow
def test_gemma3_runs_compressed_methods(tmp_path):
    from polykv_cpp import models

    path = models.fetch("gemma-3-270m-q4_k_m", progress=False)
    cfg = EvalConfig(model=str(path), out_dir=str(tmp_path), budgets=[128], lengths=[600], n_samples=1,
                     tasks=["niah_single"], ppl=False, png=False, progress=False)
    res = run_eval(cfg, log=lambda m: None)
    methods = {r["method"] for r in res["records"]}
    assert "fullkv" in methods and "streamingllm" in methods and "snapkv" in methods
    assert not any(r["status"].startswith("unsupported") for r in res["runs"])
    # sliding-window layers too: the shared (portable) prefill gives what each run's own prefill gives
    cfg.reuse, cfg.out_dir = False, str(tmp_path / "noreuse")
    res2 = run_eval(cfg, log=lambda m: None)
    key = lambda r: (r["task"], r["protocol"], r["method"], r["budget"])  # noqa: E731
    assert {key(r): r["prediction"] for r in res["records"]} == {key(r): r["prediction"] for r in res2["records"]}


class _FakeCtx:
    """Records what each protocol feeds, batch by batch, since the last clear (state = that history)."""

    def __init__(self):
        self.batches: list[list[int]] = []
        self.seen: list[list[list[int]]] = []
        self.probes: list[list[int] | None] = []

    def clear(self):
        self.batches = []

    def decode(self, toks, phase=None):
        assert toks, "decode() of nothing"
        assert phase == "prefill", "the evaluator feeds prompts, and says so"
        self.batches.append(list(toks))

    def state_bytes(self):
        return json.dumps(self.batches).encode()

    def compress_prompt(self):
        self.batches.append(["compress"])

    def load_state_bytes(self, b):
        self.batches = json.loads(b)

    def generate_tokens(self, toks, max_tokens, sampler=None, probe=None):
        self.batches.append(list(toks))
        self.probes.append(probe)
        self.seen.append([list(x) for x in self.batches])
        yield 7


class _FakeModel:
    def token_to_piece(self, t):
        return b"x"


P1, P2 = list(range(1, 301)), list(range(1000, 1040))


def _fed_batches(tmp_path, plan=None, **cfg_kw):
    """What one h2o run (``plan``, else uniform at 48) feeds per protocol (a fake context records the batches);
    the evaluator too."""
    from polykv_cpp.plan import uniform_plan
    from polykv_cpp.evaluation.runner import Run

    cfg = EvalConfig(model="unused", out_dir=str(tmp_path), n_ubatch=64, progress=False, **cfg_kw)
    ev = Evaluator(cfg, log=lambda m: None)
    ev.model = _FakeModel()
    ev.n_ctx = 4096
    s = T.make_ruler_sample("qa", 2000, 0, 0, 3)
    ev.prompts[s.key] = T.Prompt(P1, P2)
    ctx = _FakeCtx()
    ev._run_sample(ctx, Run("h2o", 48, plan or uniform_plan(2, "h2o", 48)), s)
    assert cfg.protocols == ["query-agnostic", "query-aware"]
    agnostic, aware = ctx.seen
    ev.fake_ctx = ctx
    return agnostic, aware, ev


@pytest.mark.parametrize("reuse", [True, False])
def test_protocols_feed_the_same_tokens_split_where_they_should(tmp_path, reuse):
    """Chunked prefill: query-aware = part 1 + part 2 in one stream; query-agnostic = part 1, then part 2 as its
    own batch. With reuse, both start from the state after the last full ubatch of part 1 (batch boundaries are
    unchanged)."""
    agnostic, aware, ev = _fed_batches(tmp_path, reuse=reuse, prefill="chunked")
    P = 256 if reuse else 0
    for fed in (aware, agnostic):
        assert sum(fed, []) == P1 + P2
    if reuse:
        assert aware == [P1[:P], P1[P:] + P2] and agnostic == [P1[:P], P1[P:], P2]
        assert ev.reuse["prefix_tokens_shared"] == P
    else:
        assert aware == [P1 + P2] and agnostic == [P1, P2]
    recs = [r for r in ev.records.values()]
    assert {r["protocol"] for r in recs} == {"query-aware", "query-agnostic"} and all(r["prediction"] == "x"
                                                                                    for r in recs)


def test_exact_prefill_without_reuse_compresses_the_context_before_the_question(tmp_path):
    agnostic, aware, ev = _fed_batches(tmp_path, reuse=False)
    assert ev.cfg.prefill == "exact"
    assert agnostic == [P1, ["compress"], P2] and aware == [P1 + P2]


def test_prefill_slack_compresses_the_context_before_the_question(tmp_path):
    """With a slack the prompt is compressed once, when it ends: query-agnostic after the context (the question
    is not there yet), query-aware at the first answer step (inside the runtime, not a call of its own)."""
    agnostic, aware, ev = _fed_batches(tmp_path, reuse=False, prefill="chunked", prefill_slack=2.0)
    assert agnostic == [P1, ["compress"], P2] and aware == [P1 + P2]
    agnostic, aware, ev = _fed_batches(tmp_path, reuse=False, prefill="chunked")
    assert agnostic == [P1, P2]


@pytest.mark.parametrize("reuse", [True, False])
def test_prompt_probe_probes_the_query_aware_prompt_with_its_last_tokens(tmp_path, reuse):
    """--prompt-probe N: the query-aware prompt streams whole with its last N tokens as the probe (so no prefix is
    shared with the query-agnostic run); the query-agnostic context has no question to probe with."""
    agnostic, aware, ev = _fed_batches(tmp_path, reuse=reuse, prefill="chunked", prompt_probe=8)
    assert aware == [P1 + P2] and agnostic == [P1, P2]
    assert ev.fake_ctx.probes == [None, (P1 + P2)[-8:]]
    assert ev.reuse["prefix_tokens_shared"] == 0
    _, _, ev = _fed_batches(tmp_path, reuse=reuse, prefill="chunked")
    assert ev.fake_ctx.probes == [None, None]
    with pytest.raises(EvalError, match="prompt-probe"):
        EvalConfig(model="unused", prompt_probe=8).validate()  # exact prefill
    with pytest.raises(EvalError, match="prompt-probe"):
        EvalConfig(model="unused", prefill="chunked", prompt_probe=512).validate()  # no room in a ubatch


def test_a_plans_own_prefill_slack_applies_unless_prefill_slack_is_given(tmp_path):
    from dataclasses import replace

    from polykv_cpp.plan import uniform_plan

    plan = replace(uniform_plan(2, "h2o", 48), prefill_slack=2)
    agnostic, _, _ = _fed_batches(tmp_path, plan, reuse=False, prefill="chunked")
    assert agnostic == [P1, ["compress"], P2]
    agnostic, _, _ = _fed_batches(tmp_path, plan, reuse=False, prefill="chunked", prefill_slack=1.0)
    assert agnostic == [P1, P2]


def test_prefill_slack_end_to_end_keeps_more_while_the_prompt_streams(tiny_gguf, tmp_path):
    """A real run: slack 4 allocates more KV than slack 1 (the peak while the prompt streams) and the results say
    which prefill ran; the slack is part of the configuration a resume checks."""
    base = {**TINY_BASE, "budgets": [48], "methods": ["fullkv", "snapkv"], "ppl": False, "tasks": ["niah_single"]}
    bytes_at = {}
    for slack in (1.0, 4.0):
        cfg = EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path / f"s{slack:g}"), prefill="chunked",
                         prefill_slack=slack, png=False, **base)
        res = run_eval(cfg, log=lambda m: None)
        bytes_at[slack] = {(r["method"], r["budget"]): r for r in res["runs"]}[("snapkv", 48)]["kv_bytes"]
        assert ("slack 4" in res["prefill"]) == (slack == 4.0)
        assert len([r for r in res["records"] if r["method"] == "snapkv"]) == 2
    assert bytes_at[1.0] < bytes_at[4.0]
    cfg = EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path / "s4"), prefill="chunked", prefill_slack=2.0,
                     resume=True, png=False, **base)
    with pytest.raises(EvalError, match="prefill_slack"):
        run_eval(cfg, log=lambda m: None)


def test_keeps_everything():
    from polykv_cpp.plan import pyramid_plan, uniform_plan

    assert keeps_everything(None, 10**6, 10**6)
    assert keeps_everything(uniform_plan(2, "h2o", 500), 500, 4096)
    assert not keeps_everything(uniform_plan(2, "h2o", 500), 501, 4096)
    assert not keeps_everything(pyramid_plan(4, 1000), 900, 4096)  # the last layer keeps far less


def test_config_errors(tiny_gguf, tmp_path):
    with pytest.raises(EvalError, match="unknown task"):
        EvalConfig(model=str(tiny_gguf), tasks=["nope"]).validate()
    with pytest.raises(EvalError, match="protocol"):
        EvalConfig(model=str(tiny_gguf), protocols=["sideways"]).validate()
    with pytest.raises(EvalError, match="needs --prefill chunked"):
        EvalConfig(model=str(tiny_gguf), prefill_slack=2.0).validate()
    with pytest.raises(EvalError, match="slack must be"):
        EvalConfig(model=str(tiny_gguf), prefill="chunked", prefill_slack=0.5).validate()
    with pytest.raises(EvalError, match="ppl-tokens"):
        EvalConfig(model=str(tiny_gguf), lengths=[100], ppl_tokens=200).validate()
    ev = Evaluator(EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path), methods=["fullkv", "magic"],
                              progress=False, **{k: v for k, v in TINY_BASE.items() if k != "progress"}),
                   log=lambda m: None)
    with pytest.raises(EvalError, match="unknown method 'magic'"):
        ev.setup()


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_eval_help(cli_exe):
    proc = run_cli(cli_exe, "eval", "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--budgets", "--lengths", "--protocol", "--plan", "--longbench", "-ngl", "--resume", "--quick"):
        assert flag in proc.stdout, flag


def test_cli_eval_runs_and_rerenders(cli_exe, tiny_gguf, tmp_path):
    out = tmp_path / "cli"
    proc = run_cli(cli_exe, "eval", tiny_gguf, "--out", out, "--lengths", "600", "--budgets", "48",
                   "--methods", "fullkv,tova", "--tasks", "qa", "--samples", "1", "--protocol", "query-agnostic",
                   "--ppl-tokens", "4", "--ppl-texts", "1", "-ub", "64", "-t", "1", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "results.json").read_text())
    assert {r["protocol"] for r in data["records"] if r["kind"] == "ruler"} == {"query-agnostic"}
    assert "protocol: query-agnostic" in (out / "results.md").read_text()
    (out / "results.md").unlink()
    proc = run_cli(cli_exe, "eval", "--report-only", out, "--no-png")
    assert proc.returncode == 0, proc.stderr
    assert (out / "results.md").is_file()


@pytest.mark.parametrize("args,needle", [
    (["eval", "/nonexistent/model.gguf"], "model not found"),
    (["eval", "{tiny}", "--tasks", "nope"], "unknown task"),
    (["eval", "{tiny}", "--budgets", "12,x"], "comma-separated integers"),
    (["eval", "{tiny}", "--plan", "/nonexistent/plan.json", "--lengths", "600"], "not found"),
    (["eval", "--report-only", "/nonexistent/dir"], "no results.json"),
])
def test_cli_eval_bad_input(cli_exe, tiny_gguf, tmp_path, args, needle):
    args = [str(tiny_gguf) if a == "{tiny}" else a for a in args]
    proc = run_cli(cli_exe, *args, "--out", tmp_path / "o")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr, proc.stderr


def test_eval_suite_script_presets():
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_suite", Path(__file__).parent.parent / "scripts" / "eval_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = mod.expand(["m.gguf", "--preset", "cpu", "--budgets", "64"])
    assert argv[:len(mod.PRESETS["cpu"])] == mod.PRESETS["cpu"] and argv[-3:] == ["m.gguf", "--budgets", "64"]
    assert mod.expand(["--preset=smoke", "x"]) == ["--quick", "x"]
    with pytest.raises(SystemExit, match="preset"):
        mod.expand(["--preset", "nope"])


def test_per_head_baselines_run_beside_the_per_layer_ones(tiny_gguf, tmp_path):
    """`snapkv-head` is a uniform per-KV-head plan served from the same shared prefill; every cell has an
    interval; kvpress-check maps it to kvpress's (per-head) SnapKVPress."""
    from polykv_cpp.evaluation import kvpress_check

    cfg = EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path / "out"), methods=["fullkv", "snapkv", "snapkv-head"],
                     **{**TINY_BASE, "budgets": [48], "tasks": ["niah_single", "niah_code"], "n_samples": 2,
                        "ppl_tokens": 8})
    res = run_eval(cfg, log=lambda m: None)
    by_m = {r["method"] for r in res["records"]}
    assert {"snapkv", "snapkv-head"} <= by_m
    ev = Evaluator(EvalConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "out2")}), log=lambda m: None)
    ev.setup()
    ev.model.close()
    plans = {r.method: r.plan for r in ev.runs}
    assert plans["snapkv-head"].layers[0].prefill.per_head and not plans["snapkv"].layers[0].prefill.per_head
    cell = res["summary"]["ruler"]["query-aware"]["600"]["snapkv-head"]["48"]
    assert cell["ci95"][0] <= cell["avg"] <= cell["ci95"][1]
    assert kvpress_check.PRESS_OF["snapkv-head"] == "SnapKVPress"


def test_pooling_variants_are_baselines_with_their_kernel(tiny_gguf, tmp_path):
    """`snapkv@15` and `snapkv-head@15` are the uniform baselines with pooling kernel 15 (the rest of the defaults
    kept), `snapkv@15+4` with its window moved 4 places; an even kernel, a shift beyond half the kernel, or a kernel
    on a pattern that does not pool, is an unknown method."""
    cfg = EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path / "out"),
                     methods=["fullkv", "snapkv", "snapkv@15", "snapkv-head@15", "pyramidkv@3", "snapkv@15+4"],
                     **{**TINY_BASE, "budgets": [48], "tasks": ["niah_single"], "n_samples": 1})
    ev = Evaluator(cfg, log=lambda m: None)
    ev.setup()
    ev.model.close()
    plans = {r.method: r.plan for r in ev.runs}
    assert plans["snapkv"].layers[0].prefill.pool_kernel == 7
    for meth, selection in (("snapkv@15", "layer"), ("snapkv-head@15", "head")):
        for lp in plans[meth].layers:
            assert (lp.prefill.pool_kernel, lp.decode.pool_kernel, lp.prefill.selection) == (15, 15, selection)
            assert lp.prefill.obs_window == 32 and lp.prefill.budget == 48
    assert plans["pyramidkv@3"].layers[0].prefill.pool_kernel == 3
    assert plans["pyramidkv@3"].layers[0].prefill.budget > plans["pyramidkv@3"].layers[-1].prefill.budget
    assert plans["snapkv"].layers[0].prefill.pool_shift is None
    for lp in plans["snapkv@15+4"].layers:
        assert (lp.prefill.pool_kernel, lp.prefill.pool_shift, lp.decode.pool_shift) == (15, 4, 4)
    for bad in ("snapkv@14", "h2o@15", "snapkv@x", "snapkv@15+8", "snapkv@15+"):
        ev = Evaluator(EvalConfig(**{**cfg.__dict__, "methods": ["fullkv", bad]}), log=lambda m: None)
        with pytest.raises(EvalError, match="unknown method"):
            ev.setup()
        ev.model.close()


def test_paired_diff_script_reports_paired_intervals(tmp_path, capsys):
    """scripts/paired_diff.py: a method that answers every prompt the base answers plus two more differs by a
    positive amount whose paired interval excludes 0; a copy of the base ties at exactly 0."""
    import importlib.util
    import json as _json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "paired_diff", Path(__file__).resolve().parent.parent / "scripts" / "paired_diff.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    records = []
    for task in ("a", "b"):
        for i in range(6):
            base = float(i % 3 == 0)
            for method, budget, score in (("fullkv", None, 1.0), ("snapkv", 64, base), ("copy", 64, base),
                                          ("better", 64, 1.0 if i < 4 else base), ("snapkv@23", 64, 1.0)):
                records.append({"kind": "ruler", "task": task, "length": 1024, "index": i,
                                "protocol": "query-aware", "method": method, "budget": budget, "score": score})
    path = tmp_path / "results.json"
    path.write_text(_json.dumps({"records": records}))
    assert mod.main([str(path), "--base", "snapkv"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "+0.0 [+0.0, +0.0]" in rows["copy"]
    better = rows["better"].split("|")[3].strip()
    lo = float(better.split("[")[1].split(",")[0])
    assert better.startswith("+33.3") and lo > 0
    assert rows["snapkv@23"].split("|")[2].strip() == "64"  # a method holding '@' (a pooling kernel) keeps its name
    assert rows["snapkv@23"].split("|")[3].strip().startswith("+66.7")
    # the score as a share of FullKV's: the base answers 4 of 12 (33%), "better" 8 of 12 (67%)
    assert rows["snapkv (base)"].split("|")[5].strip().startswith("33% [")
    assert rows["better"].split("|")[5].strip().startswith("67% [")
    lo, hi = (float(x.strip().rstrip("%]")) for x in rows["better"].split("|")[5].split("[")[1].split(","))
    assert lo < 67 < hi

    # a run stopped early: "partial" answered samples 0-2 of each task only (all right). Every method is then
    # compared on those samples, where the base scores 1/3 and "better" 1: +66.7, not the mix of both sets
    records += [{"kind": "ruler", "task": task, "length": 1024, "index": i, "protocol": "query-aware",
                 "method": "partial", "budget": 64, "score": 1.0} for task in ("a", "b") for i in range(3)]
    path.write_text(_json.dumps({"records": records}))
    assert mod.main([str(path), "--base", "snapkv", "--only", "partial,better"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("(a method lacks some samples: every method is compared on the 6 samples")
    rows = {line.split("|")[1].strip(): line for line in out[3:]}
    assert set(rows) == {"snapkv (base)", "partial", "better", "fullkv"}  # FullKV - base closes the table
    assert rows["better"].split("|")[3].strip().startswith("+66.7")
    assert rows["partial"].split("|")[3].strip().startswith("+66.7")

    # a base that scores FullKV's average leaves no gap to recover: "-" in that column, not a ZeroDivisionError
    assert mod.main([str(path), "--base", "snapkv@23"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()[3:]}
    assert rows["copy"].split("|")[3].strip().startswith("-66.7")
    assert rows["copy"].split("|")[4].strip() == "-"


def test_paired_diff_pairs_runs_on_the_same_prompts(tmp_path, capsys):
    """LABEL=PATH runs pair by (task, sample) under LABEL:method; runs whose samples differ are refused."""
    mod = _script("paired_diff")

    def rec(method, budget, i, score, answer="7"):
        return {"kind": "ruler", "task": "a", "length": 1024, "index": i, "protocol": "query-aware",
                "method": method, "budget": budget, "score": score, "answers": [answer], "n_prompt": 1000}

    exact = [rec("fullkv", None, i, 1.0) for i in range(6)] + [rec("snapkv", 64, i, float(i < 2)) for i in range(6)]
    probed = [rec("snapkv", 64, i, float(i < 5)) for i in range(6)]
    (tmp_path / "e.json").write_text(json.dumps({"records": exact}))
    (tmp_path / "p.json").write_text(json.dumps({"records": probed}))
    assert mod.main([f"exact={tmp_path / 'e.json'}", f"probed={tmp_path / 'p.json'}", "--base", "exact:snapkv"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["probed:snapkv"].split("|")[3].strip().startswith("+50.0")
    assert rows["exact:fullkv"].split("|")[3].strip().startswith("+66.7")
    (tmp_path / "x.json").write_text(json.dumps({"records": [rec("snapkv", 64, 0, 1.0, answer="8")]}))
    with pytest.raises(SystemExit, match="not the same prompts"):
        mod.main([f"exact={tmp_path / 'e.json'}", f"other={tmp_path / 'x.json'}", "--base", "exact:snapkv"])


def test_paired_diff_pools_runs_of_other_seeds(tmp_path, capsys):
    """--pool adds the samples of runs on other prompts (another seed) to one set: the methods keep their names and
    the difference is that of all samples together; runs of the same prompts under two labels are refused, under
    one label merged."""
    mod = _script("paired_diff")

    def rec(method, budget, i, score, answer):
        return {"kind": "ruler", "task": "a", "length": 1024, "index": i, "protocol": "query-aware",
                "method": method, "budget": budget, "score": score, "answers": [answer], "n_prompt": 1000}

    # seed 0: "plan" answers 3 of 4 more than snapkv does; seed 5000 (other answers): 1 of 4 more
    runs = {"s0": [(i, float(i < 3), 0.0) for i in range(4)], "s5000": [(i, float(i < 1), 0.0) for i in range(4)]}
    for label, rows in runs.items():
        records = [r for i, plan, snap in rows for r in (
            rec("fullkv", None, i, 1.0, f"{label}-{i}"), rec("plan", 64, i, plan, f"{label}-{i}"),
            rec("snapkv", 64, i, snap, f"{label}-{i}"))]
        (tmp_path / f"{label}.json").write_text(json.dumps({"records": records}))
    specs = [f"{label}={tmp_path / label}.json" for label in runs]
    assert mod.main(specs + ["--pool", "--base", "snapkv"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"snapkv (base)", "plan", "fullkv"}
    assert rows["plan"].split("|")[3].strip().startswith("+50.0 [")  # 4 of 8 prompts, not 3 of 4 or 1 of 4
    assert rows["fullkv"].split("|")[3].strip().startswith("+100.0")
    # a budget only one run has (128, in s0) is compared on that run's prompts; 64 still on both runs'
    extra = json.loads((tmp_path / "s0.json").read_text())
    extra["records"] += [rec(m, 128, i, 1.0, f"s0-{i}") for m in ("plan", "snapkv") for i in range(4)]
    (tmp_path / "s0.json").write_text(json.dumps(extra))
    assert mod.main(specs + ["--pool", "--base", "snapkv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "(a method lacks some samples: every method is compared on the 4 samples they all have at 128; " \
                     "4 results left out)"
    rows = [line.split("|") for line in out[3:]]
    assert [r[3].strip()[:5] for r in rows if r[1].strip() == "plan"] == ["+50.0", "+0.0 "]
    assert mod.main([specs[1], "--pool", "--base", "snapkv"]) == 0  # one run alone: its own 1 of 4
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["plan"].split("|")[3].strip().startswith("+25.0 [")
    assert rows["plan"].split("|")[4].strip().startswith("25% [")
    # FullKV only ties the base (3 of 4 right against 4 of 4): the gap recovered has no interval worth printing
    records = [r for i in range(4) for r in (rec("fullkv", None, i, 1.0, str(i)), rec("plan", 64, i, 1.0, str(i)),
                                             rec("snapkv", 64, i, float(i < 3), str(i)))]
    (tmp_path / "tie.json").write_text(json.dumps({"records": records}))
    assert mod.main([str(tmp_path / "tie.json"), "--base", "snapkv"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["plan"].split("|")[4].strip() == "100% (FullKV ties the base)"
    with pytest.raises(SystemExit, match="same prompts"):
        mod.main([specs[0], f"again={tmp_path / 's0.json'}", "--pool", "--base", "snapkv"])
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        mod.main([str(tmp_path / "s0.json"), specs[1], "--pool", "--base", "snapkv"])
    with pytest.raises(SystemExit, match="not the same prompts"):  # a label given again: a run of its prompts
        mod.main([specs[0], f"s0={tmp_path / 's5000.json'}", "--pool", "--base", "snapkv"])
    # s5000 split in two runs of its prompts (plan later, FullKV in both, the second's differing): merged under the
    # label, FullKV from the first given; the pooled result is that of the whole files
    whole = json.loads((tmp_path / "s5000.json").read_text())["records"]
    first = [r for r in whole if r["method"] != "plan"]
    later = [r for r in whole if r["method"] == "plan"] + [{**r, "score": 0.0} for r in whole if r["method"] == "fullkv"]
    (tmp_path / "s5000a.json").write_text(json.dumps({"records": first}))
    (tmp_path / "s5000b.json").write_text(json.dumps({"records": later}))
    assert mod.main([specs[0], f"s5000={tmp_path / 's5000a.json'}", f"s5000={tmp_path / 's5000b.json'}",
                     "--pool", "--base", "snapkv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "(s5000: fullkv is in two of its runs; the scores of the first given are used)" in out
    rows = {line.split("|")[1].strip(): line for line in out if line.split("|")[2:3] == [" 64 "]}
    assert rows["plan"].split("|")[3].strip().startswith("+50.0 [")
    assert rows["fullkv"].split("|")[3].strip().startswith("+100.0")


def test_paired_diff_pairs_teacher_forced_texts_by_metric(tmp_path, capsys):
    """--metric kl pairs the perplexity texts' KL per text (the bootstrap draws texts): a method whose KL is lower
    on every text by 0.01 differs by -0.0100 with an interval below 0; FullKV (KL 0) recovers 100%."""
    mod = _script("paired_diff")
    recs = []
    for i, text in enumerate(("email", "json", "http", "xml", "sqlite3", "urllib")):
        for method, budget, kl in (("fullkv", None, 0.0), ("e1", 256, 0.3 + 0.01 * i), ("e64", 256, 0.29 + 0.01 * i)):
            recs.append({"kind": "ppl", "task": text, "length": 2048, "index": 0, "protocol": "teacher-forced",
                         "method": method, "budget": budget, "kl": kl, "nll": 2.0, "top1": 0.8})
    recs.append({"kind": "ruler", "task": "a", "length": 2048, "index": 0, "protocol": "query-aware",
                 "method": "e1", "budget": 256, "score": 1.0})  # task records are not mixed in
    (tmp_path / "r.json").write_text(json.dumps({"records": recs}))
    assert mod.main([str(tmp_path / "r.json"), "--metric", "kl", "--base", "e1"]) == 0
    rows = {line.split("|")[1].strip(): line.split("|") for line in capsys.readouterr().out.splitlines()[2:]}
    diff = rows["e64"][3].strip()
    assert diff.startswith("-0.0100 [") and float(diff.split("[")[1].split(",")[1].rstrip("]")) < 0
    assert rows["fullkv"][3].strip().startswith("-0.3250")
    with pytest.raises(SystemExit, match="no results"):
        mod.main([str(tmp_path / "r.json"), "--metric", "kl", "--base", "snapkv"])


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prefill_table_from_real_runs(tiny_gguf, tmp_path, capsys):
    """scripts/prefill_table.py on tiny eval runs of one method in exact and chunked (slack 1 and 4) prefill: a row
    per mode with both protocols, exact's peak is the FullKV size, chunked peaks grow with the slack, a mode
    differs from exact by 0 exactly when it answers alike, and the picture is written."""
    mod = _script("prefill_table")
    base = {**TINY_BASE, "budgets": [48], "methods": ["fullkv", "snapkv"], "ppl": False, "png": False}
    dirs = {}
    for label, kw in (("exact", {"prefill": "exact"}), ("s1", {"prefill": "chunked"}),
                      ("s4", {"prefill": "chunked", "prefill_slack": 4.0}),
                      ("p8", {"prefill": "chunked", "prompt_probe": 8})):
        dirs[label] = tmp_path / label
        run_eval(EvalConfig(model=str(tiny_gguf), out_dir=str(dirs[label]), **kw, **base), log=lambda m: None)
    out = tmp_path / "table"
    assert mod.main(["--budget", "48", "--out", str(out)] + [f"{k}={v}" for k, v in dirs.items()]) == 0
    t = json.loads((out / "prefill_table.json").read_text())
    rows = t["modes"]
    assert [rows[k]["mode"] for k in dirs] == ["exact", "chunked, slack 1", "chunked, slack 4",
                                               "chunked, slack 1, probed by the last 8 tokens"]
    assert "probed by their last 8 tokens" in json.loads((dirs["p8"] / "results.json").read_text())["prefill"]
    full_bytes = {(r["method"], r["budget"]): r for r in json.loads((dirs["exact"] / "results.json").read_text())[
        "runs"]}[("snapkv", 48)]["kv_bytes_fullkv"]
    assert rows["exact"]["peak_kv_bytes"] == full_bytes
    assert rows["s1"]["peak_kv_bytes"] == rows["p8"]["peak_kv_bytes"] < rows["s4"]["peak_kv_bytes"]
    for k in ("s1", "s4", "p8"):
        for proto in ("query-aware", "query-agnostic"):
            c = rows[k][proto]
            same = c["score"] == rows["exact"][proto]["score"]
            assert (abs(c["diff"]) < 1e-9) == same and c["diff_ci"][0] <= c["diff"] <= c["diff_ci"][1]
    assert set(t["fullkv"]) == {"query-aware", "query-agnostic"} and rows["s1"]["n_prompts"] == 3
    assert (out / "prefill_table.png").read_bytes().startswith(b"\x89PNG")
    assert "| chunked, slack 4 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no results of snapkv@99"):
        mod.main(["--budget", "99", f"exact={dirs['exact']}"])


def test_one_kvzip_pass_per_sample_serves_every_kvzip_run(tiny_gguf, tmp_path):
    """Exact prefill: the first KVzip run of a sample runs the reconstruction pass, the others (other budgets,
    per-head selection) load its scored state; their answers equal those of runs that each ran the pass
    (reuse off)."""
    base = {**TINY_BASE, "budgets": [32, 48], "tasks": ["niah_single", "vt"], "n_samples": 1, "n_ppl_texts": 0}
    cfg = EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path / "shared"), methods=["fullkv", "kvzip", "kvzip-head"],
                     **base)
    res = run_eval(cfg, log=lambda m: None)
    # 2 samples x 2 protocols, 4 KVzip runs: one pass each, three loads
    assert res["reuse"]["kvzip_passes_shared"] == 2 * 2 * 3
    own = run_eval(EvalConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "own"), "reuse": False}), log=lambda m: None)
    assert own["reuse"]["kvzip_passes_shared"] == 0
    key = lambda r: (r["task"], r["protocol"], r["method"], r["budget"])  # noqa: E731
    a = {key(r): r["prediction"] for r in res["records"] if r["kind"] == "ruler"}
    b = {key(r): r["prediction"] for r in own["records"] if r["kind"] == "ruler"}
    assert a == b and len(a) == 2 * 2 * 5


def test_the_state_cache_keeps_kvzip_scored_states_for_later_evaluations(tiny_gguf, tmp_path):
    """With --state-cache the first evaluation saves each sample's state after KVzip's reconstruction pass; a later
    evaluation with another KVzip method runs no pass (it loads the scored states) and answers as one that ran its
    own passes."""
    base = {**TINY_BASE, "budgets": [32], "tasks": ["niah_single", "vt"], "n_samples": 1, "n_ppl_texts": 0,
            "ppl": False, "png": False}
    cache = tmp_path / "states"
    first = run_eval(EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path / "a"), methods=["fullkv", "kvzip"],
                                state_cache=str(cache), **base), log=lambda m: None)
    assert first["reuse"]["kvzip_passes_loaded"] == 0
    assert len(list(cache.glob("*-kvzip.npz"))) == 2 * 2  # 2 samples x 2 protocols (their prompts differ)
    later = EvalConfig(model=str(tiny_gguf), out_dir=str(tmp_path / "b"), methods=["fullkv", "kvzip-head"],
                       state_cache=str(cache), **base)
    ev = Evaluator(later, log=lambda m: None)
    ev.setup()
    passes: list[int] = []
    make_context = ev._context

    def counting_context(run, prefill="chunked"):
        ctx = make_context(run, prefill)
        score = ctx.score_prompt_kvzip
        ctx.score_prompt_kvzip = lambda *a, **kw: (passes.append(1), score(*a, **kw))[1]
        return ctx
    ev._context = counting_context
    res = ev.run()
    ev.model.close()
    assert not passes and res["reuse"]["kvzip_passes_loaded"] == 2 * 2
    own = run_eval(EvalConfig(**{**later.__dict__, "out_dir": str(tmp_path / "own"), "state_cache": None}),
                   log=lambda m: None)
    assert own["reuse"]["kvzip_passes_loaded"] == 0
    key = lambda r: (r["task"], r["protocol"], r["method"], r["budget"])  # noqa: E731
    a = {key(r): r["prediction"] for r in res["records"] if r["kind"] == "ruler"}
    b = {key(r): r["prediction"] for r in own["records"] if r["kind"] == "ruler"}
    assert a == b and len(a) == 2 * 2 * 2
    # a damaged scored state is scored again, not loaded
    for f in cache.glob("*-kvzip.npz"):
        f.write_bytes(b"damaged")
    again = run_eval(EvalConfig(**{**later.__dict__, "out_dir": str(tmp_path / "c")}), log=lambda m: None)
    assert again["reuse"]["kvzip_passes_loaded"] == 0
    assert {key(r): r["prediction"] for r in again["records"] if r["kind"] == "ruler"} == b


def test_paired_diff_compares_other_budgets_on_request(tmp_path, capsys):
    """--any-budget: a method at another budget is compared with the base (its own budget in the row); without it
    only the base's budget is; --only takes METHOD@BUDGET."""
    mod = _script("paired_diff")
    records = [{"kind": "ruler", "task": "a", "length": 1024, "index": i, "protocol": "query-aware",
                "method": method, "budget": budget, "score": score}
               for i in range(6)
               for method, budget, score in (("fullkv", None, 1.0), ("plan", 128, float(i < 2)),
                                             ("plan-w", 128, float(i < 3)), ("plan-w", 160, float(i < 5)))]
    (tmp_path / "r.json").write_text(json.dumps({"records": records}))
    assert mod.main([str(tmp_path / "r.json"), "--base", "plan"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [("plan (base)", "128"), ("plan-w", "128"),
                                                               ("fullkv", "128")]
    assert mod.main([str(tmp_path / "r.json"), "--base", "plan", "--only", "plan-w@160", "--any-budget"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [("plan (base)", "128"), ("plan-w", "160"),
                                                               ("fullkv", "128")]
    assert rows[1][3].strip().startswith("+50.0")
