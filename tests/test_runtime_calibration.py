"""`polykv-cpp calibrate --method runtime`: the plan search measured on the GGUF through the native cache."""

import hashlib
from dataclasses import replace

import numpy as np
import pytest

from calibration.runtime import (DEFAULT_MIN_GAIN, TASK_SEED_OFFSET, _Measure, build, move_budget, runtime_calibrate,
                                 task_items, text_items, with_allocation)
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
    # sliding-window layers (cap 100) neither grow past the window nor receive what another layer gives up
    caps = [100, None, 100, None]
    assert move_budget(b, 1, -50, 40, caps) == [100, 50, 100, 150]
    assert move_budget(b, 0, 20, 40, caps) is None
    assert move_budget(b, 1, 60, 40, caps) == [80, 160, 80, 80]
    assert move_budget([100, 100, 100], 0, -30, 40, [None, 100, 100]) is None  # nobody can receive


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
    assert res.objective == "kl" and all(v > 0 for v in res.loss_uniform.values())
    assert plan_mod.read_gguf(res.out).to_dict()["layers"] == plan.to_dict()["layers"]
    assert plan.evict_every == plan_mod.read_gguf(res.out).evict_every == 64  # calibrated plans batch decode eviction
    # the search's figures, measured again without it: fresh exact-prefill contexts, KL summed here
    kl_plan = _kl_by_hand(tiny_gguf, plan)
    assert kl_plan == pytest.approx(res.loss_plan, rel=1e-3, abs=1e-5)
    best = min(res.loss_uniform, key=res.loss_uniform.get)
    uniform = build(2, [best] * 2, [48, 48], 48, plan.b_min)
    kl_uniform = _kl_by_hand(tiny_gguf, uniform)
    assert kl_uniform == pytest.approx(res.loss_uniform[best], rel=1e-3, abs=1e-5)
    assert kl_plan <= kl_uniform * (1 + 1e-3)  # the returned plan, measured again, is no worse than the best uniform


def test_search_tries_per_prompt_budgets_last_and_measures_them(searched, tiny_gguf):
    """The last two steps measure the searched plan with its budgets re-split per prompt, by the raw scores and by
    the scores relative to each set's median; measured again by hand (fresh exact-prefill contexts), each such plan
    gives its step's loss and a loss of its own (the allocation acted), and the plan keeps the better one only if
    it lowers the loss."""
    res = searched
    raw_step, med_step = res.steps[-2], res.steps[-1]
    assert raw_step.what == "budgets re-split per prompt by its scores"
    assert med_step.what == "budgets re-split per prompt by its scores relative to each set's median"
    fixed = replace(res.plan, allocation="plan")
    fixed_kl = _kl_by_hand(tiny_gguf, fixed)
    for mode, step in (("prompt", raw_step), ("prompt_median", med_step)):
        per_prompt = with_allocation(fixed, mode)
        assert per_prompt.allocation == mode and per_prompt.b_min == max(
            max(lp.prefill.reserved, lp.decode.reserved) for lp in fixed.layers)
        assert [lp.prefill.budget for lp in per_prompt.layers] == [lp.prefill.budget for lp in fixed.layers]
        got = _kl_by_hand(tiny_gguf, per_prompt)
        assert got == pytest.approx(step.kl, rel=1e-3, abs=1e-5)
        assert got != pytest.approx(fixed_kl, rel=1e-6, abs=0)  # the budgets moved (a random model's split is mild)
    before = min(s.kl for s in res.steps[:-2] if s.accepted)
    assert raw_step.accepted is (raw_step.kl < before * (1 - 0.01))
    best = raw_step.kl if raw_step.accepted else before
    assert med_step.accepted is (med_step.kl < best * (1 - 0.01))
    want = "prompt_median" if med_step.accepted else "prompt" if raw_step.accepted else "plan"
    assert res.plan.allocation == res.plan.provenance.extra["allocation"] == want
    assert res.plan.provenance.extra["prompt_budgets"] is (want != "plan")


def _kl_by_hand(gguf, plan, ctx=384, n_cont=32) -> float:
    """KL(FullKV || plan) per continuation token, averaged over the builtin calibration samples (seed 0)."""
    from calibration.data import load_calibration_data

    def log_probs(model, item, compress: bool):
        with model.context(n_ctx=512, n_batch=512) as c:
            c.decode(item.context)
            if compress:
                c.compress_prompt()
            c.decode(item.continuation, all_logits=True)
            z = np.stack([c.logits(i) for i in range(len(item.continuation))]).astype(np.float64)
        return z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))

    kls = []
    with Model(gguf) as model:
        data = load_calibration_data("builtin", lambda t: model.tokenize(t, add_special=False, parse_special=False),
                                     ctx=ctx, n_samples=2, seed=0)
        for item in text_items(data.samples, n_cont):
            model.set_plan(None)
            ref = log_probs(model, item, compress=False)
            model.set_plan(plan, prefill="exact")
            got = log_probs(model, item, compress=True)
            kls.append(np.mean(np.sum(np.exp(ref) * (ref - got), axis=-1)))
    return float(np.mean(kls))


def test_measure_is_zero_for_fullkv_and_reproducible(tiny_gguf):
    from calibration.data import pack, generated_texts

    with Model(tiny_gguf) as model:
        samples = pack(generated_texts(0, n=8, words=400), lambda t: model.tokenize(t, add_special=False),
                       ctx=256, n_samples=2)
        m = _Measure(model, text_items(samples, 16), None, False)
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
    with pytest.raises(CalibrationError, match="evict_every must be"):
        runtime_calibrate(tiny_gguf, None, budget=48, evict_every=0, progress=False, log=lambda m: None)


def test_cli_runtime_method(cli_exe, tiny_gguf, tmp_path):
    plan_json = tmp_path / "p.json"
    r = run_cli(cli_exe, "calibrate", "--method", "runtime", "--gguf", tiny_gguf, "--budget", "48", "--samples", "1",
                "--ctx", "256", "--n-cont", "16", "--patterns", "streamingllm,tova", "--no-budget-moves",
                "--budgets-from-scores", "--plan-out", plan_json, "-q")
    assert r.returncode == 0, r.stderr
    assert "plans measured" in r.stdout and plan_json.exists()
    plan = plan_mod.load(plan_json)
    assert plan.budget_rule == "search" and plan.provenance.extra["budgets_from_scores"] is True
    r = run_cli(cli_exe, "calibrate", "--method", "runtime", "--gguf", tmp_path / "nope.gguf", "-q")
    assert r.returncode != 0 and "not found" in r.stderr


def test_task_items_continue_each_prompt_with_the_fullkv_answer(tiny_gguf):
    from polykv_cpp.evaluation import tasks as T

    with Model(tiny_gguf) as model:
        items, n_ctx = task_items(model, tasks=["niah_single", "vt"], length=500, n_per_task=1,
                                  seed=TASK_SEED_OFFSET, protocols=("query-aware", "query-agnostic"), n_threads=1,
                                  progress=False)
        assert len(items) == 4
        builder = T.PromptBuilder(lambda t, a, p: model.tokenize(t, add_special=a, parse_special=p), "none")
        samples = T.generate_ruler(["niah_single", "vt"], [500], 1, TASK_SEED_OFFSET,
                                   lambda s: builder.count(s) + s.max_new_tokens, stop_at_newline=True)
        for k, s in enumerate(samples):
            aware, agnostic = items[2 * k], items[2 * k + 1]
            p = builder.build(s, max_prompt=s.length - s.max_new_tokens)
            assert aware.context == p.tokens and aware.score_from == 0
            assert agnostic.context == p.part1 and agnostic.continuation[:len(p.part2)] == p.part2
            assert agnostic.continuation[len(p.part2):] == aware.continuation
            assert agnostic.score_from == len(p.part2) - 1
            # the continuation is what a stock FullKV context answers (greedy)
            model.set_plan(None)
            with model.context(n_ctx=1024, n_threads=1) as ctx:
                stock = list(ctx.generate_tokens(p.tokens, max_tokens=len(aware.continuation)))
            assert stock == aware.continuation
        # the measure scores only the answer: FullKV gives 0, a compressed plan more
        m = _Measure(model, items, 1, False, n_ctx=n_ctx)
        assert m.kl(plan_mod.uniform_plan(2, "fullkv", m.n_ctx)) == pytest.approx(0.0, abs=1e-6)
        assert m.measure(plan_mod.uniform_plan(2, "fullkv", m.n_ctx))["top1"] == 0
        p = build(2, ["snapkv", "h2o"], [48, 48], 48, 32)
        kl = m.kl(p)
        assert kl > 1e-4 and 0 < m.measure(p)["top1"] <= 1
        # the snapshots taken while answering equal a fresh prefill of each context
        fresh = _Measure(model, [replace(i, snapshot=None) for i in items], 1, False, n_ctx=n_ctx)
        assert fresh.kl(p) == pytest.approx(kl, rel=1e-5)


def test_runtime_calibration_on_tasks(tiny_gguf, tmp_path):
    res = runtime_calibrate(tiny_gguf, None, budget=48, samples=1, ctx=500, dataset="tasks",
                            tasks=["niah_single", "qa"], protocols=("query-aware", "query-agnostic"),
                            patterns=("streamingllm", "snapkv"), budget_moves=False, plan_out=tmp_path / "p.json",
                            progress=False, log=lambda m: None)
    cal = res.plan.provenance.calibration
    assert cal["dataset"] == "tasks" and cal["seed"] == TASK_SEED_OFFSET and cal["tasks"] == ["niah_single", "qa"]
    assert cal["n_items"] == 4 and res.objective == "top1" and res.loss_plan <= min(res.loss_uniform.values())
    assert 0 <= res.loss_plan <= 1
    assert plan_mod.load(tmp_path / "p.json").budget_rule == "search"
    with pytest.raises(CalibrationError, match="unknown task"):
        runtime_calibrate(tiny_gguf, None, budget=48, dataset="tasks", tasks=["nope"], ctx=500, progress=False,
                          log=lambda m: None)


def test_a_query_agnostic_calibration_writes_the_files_second_plan(searched, tmp_path):
    """Calibrated for the question after the compression, into a model that has a plan: the plan goes to
    polykv.plan_query_agnostic and the source's polykv.plan stays."""
    out = tmp_path / "both.gguf"
    res = runtime_calibrate(searched.out, out, budget=48, samples=1, ctx=500, dataset="tasks", tasks=["niah_single"],
                            protocols=("query-agnostic",), patterns=("streamingllm", "snapkv"), budget_moves=False,
                            prompt_budgets=False, progress=False, log=lambda m: None)
    assert plan_mod.read_gguf(out) == plan_mod.read_gguf(searched.out)
    assert plan_mod.read_gguf(out, key=plan_mod.GGUF_KEY_PLAN_QUERY_AGNOSTIC) == res.plan


def test_search_candidates_may_set_a_pooling_kernel(tiny_gguf):
    """A candidate `snapkv@3` is SnapKV with pooling kernel 3: the plan's layers that chose it carry the kernel,
    and a kernel the pattern does not take is refused."""
    res = runtime_calibrate(tiny_gguf, None, budget=48, samples=1, ctx=256, n_cont=16, patterns=("snapkv", "snapkv@3"),
                            budget_moves=False, progress=False, log=lambda m: None)
    assert set(res.loss_uniform) == {"snapkv", "snapkv@3"}
    for lp in res.plan.layers:
        assert lp.prefill.pattern == "snapkv" and lp.prefill.pool_kernel in (3, 7)
    with pytest.raises(CalibrationError, match="pooling"):
        runtime_calibrate(tiny_gguf, None, budget=48, samples=1, ctx=256, n_cont=16, patterns=("tova@3",),
                          progress=False, log=lambda m: None)


def test_cli_tasks_dataset_needs_the_runtime_method(cli_exe, tiny_gguf):
    r = run_cli(cli_exe, "calibrate", "--gguf", tiny_gguf, "--dataset", "tasks", "-q")
    assert r.returncode == 2 and "--method runtime" in r.stderr


def test_search_measures_kvzip_with_its_reconstruction_pass(tiny_gguf):
    """A kvzip candidate is measured after its reconstruction pass: its loss differs from the same plan
    compressed without one (where kvzip layers keep only sinks and recent tokens), and the search leaves room
    for the pass in every context."""
    from calibration.data import generated_texts, pack
    from polykv_cpp.evaluation.runner import KVZIP_ROOM

    with Model(tiny_gguf) as model:
        samples = pack(generated_texts(0, n=8, words=400), lambda t: model.tokenize(t, add_special=False),
                       ctx=256, n_samples=2)
        m = _Measure(model, text_items(samples, 16), None, False, room=KVZIP_ROOM)
        assert m.n_ctx >= 256 + KVZIP_ROOM
        zipped = build(2, ["kvzip", "kvzip-head"], [48, 48], 48, 32)
        assert [lp.decode.pattern for lp in zipped.layers] == [plan_mod.DECODE_AFTER_PREFILL_ONLY] * 2
        recent = build(2, ["streamingllm", "streamingllm"], [48, 48], 48, 32)
        kz, kr = m.kl(zipped), m.kl(recent)
        assert kz > 1e-4 and kz != pytest.approx(kr, rel=1e-3)


def test_score_shares_follow_one_model_wide_threshold(tiny_gguf):
    """`--budgets-from-scores`: each layer's share of the model's top-scored (head, token) pairs, from the scores
    the runtime ranks by. Checked against the same threshold applied by hand to `Context.kept_scores` of an
    independent exact-prefill context; a budget that keeps every pair gives every layer the same share."""
    from calibration.data import generated_texts, pack

    with Model(tiny_gguf) as model:
        samples = pack(generated_texts(1, n=8, words=400), lambda t: model.tokenize(t, add_special=False),
                       ctx=200, n_samples=1)
        items = text_items(samples, 16)
        m = _Measure(model, items, None, False)
        P, L, H = len(items[0].context), model.n_layer, model.n_head_kv
        shares = m.score_shares("h2o-head", 24)
        assert shares.sum() == pytest.approx(1.0) and (shares >= 0).all()
        assert m.score_shares("h2o-head", P) == pytest.approx(np.full(L, 1 / L))

        model.set_plan(build(L, ["h2o-head"] * L, [P] * L, P, 32), prefill="exact")
        with model.context(n_ctx=m.n_ctx) as ctx:
            ctx.decode(items[0].context)
            ctx.compress_prompt()
            sc = np.stack([[ctx.kept_scores(il, h) for h in range(H)] for il in range(L)])
        assert sc.shape == (L, H, P)
        thr = np.sort(sc.ravel())[-L * H * 24]
        want = (sc >= thr).sum(axis=(1, 2)) / (sc >= thr).sum()
        assert shares == pytest.approx(want, abs=1e-6)
        assert not np.allclose(want, 1 / L)  # the layers really differ: the test can tell a wrong split


def test_runtime_calibration_budgets_from_scores(tiny_gguf):
    res = runtime_calibrate(tiny_gguf, None, budget=48, samples=2, ctx=256, n_cont=16, patterns=("h2o-head",),
                            budget_moves=False, budgets_from_scores=True, progress=False, log=lambda m: None)
    assert any(s.what.startswith("budgets from h2o-head's scores") for s in res.steps)
    buds = [lp.prefill.budget for lp in res.plan.layers]
    assert sum(buds) == 2 * 48 and min(buds) >= res.plan.b_min
    assert res.plan.provenance.extra["budgets_from_scores"] is True
    assert res.loss_plan <= res.loss_uniform["h2o-head"]


def test_budgets_from_another_patterns_scores(tiny_gguf, monkeypatch):
    """`--score-pattern`: the shares come from the named scorer's scores, the plan runs the searched pattern."""
    asked = []
    real = _Measure.score_shares

    def spy(self, pattern, budget):
        asked.append(pattern)
        return real(self, pattern, budget)

    monkeypatch.setattr(_Measure, "score_shares", spy)
    res = runtime_calibrate(tiny_gguf, None, budget=48, samples=2, ctx=256, n_cont=16, patterns=("h2o-head",),
                            budget_moves=False, score_pattern="knorm-head", progress=False, log=lambda m: None)
    assert asked == ["knorm-head"]
    step = next(s for s in res.steps if s.what.startswith("budgets from knorm-head's scores"))
    assert {lp.prefill.pattern for lp in res.plan.layers} == {"h2o"}
    assert all(lp.prefill.selection == "head" for lp in res.plan.layers)
    assert res.plan.provenance.extra["score_pattern"] == "knorm-head"
    assert res.plan.provenance.extra["budgets_from_scores"] is True
    if step.accepted:
        assert str([lp.prefill.budget for lp in res.plan.layers]) in step.what
    with pytest.raises(CalibrationError, match="--score-pattern"):
        runtime_calibrate(tiny_gguf, None, budget=48, samples=1, ctx=256, n_cont=16, patterns=("h2o",),
                          score_pattern="fullkv", progress=False, log=lambda m: None)


def test_search_tries_budgets_by_span_when_the_model_has_sliding_window_layers(searched, tiny_gguf, monkeypatch):
    """On a model with sliding-window layers (layer 0's window made 40 here) the search measures, after the uniform
    start, the budgets in proportion to each layer's span (40 and the context, 384), and keeps them only if they
    lower the loss; that loss is the plan's, measured again by hand. The tiny model without windows has no such
    step."""
    assert not any("spans" in s.what for s in searched.steps)
    monkeypatch.setattr(Model, "attention_windows", lambda self: [40, None])
    res = runtime_calibrate(tiny_gguf, None, budget=48, samples=2, ctx=384, n_cont=32, patterns=("snapkv",),
                            budget_moves=False, prompt_budgets=False, progress=False, log=lambda m: None)
    assert res.plan.b_min == 32
    step = res.steps[1]
    assert step.what == "budgets in proportion to the layers' spans: [35, 61]"  # 32 + 32 x 40 / 424 -> 35
    assert step.kl == pytest.approx(_kl_by_hand(tiny_gguf, build(2, ["snapkv"] * 2, [35, 61], 48, 32)),
                                    rel=1e-3, abs=1e-5)
    assert step.accepted == (step.kl < res.loss_uniform["snapkv"] * (1 - DEFAULT_MIN_GAIN))
    assert ([lp.prefill.budget for lp in res.plan.layers] == [35, 61]) is step.accepted


def test_a_plan_split_by_span_keeps_its_proportions_down_to_what_its_patterns_always_keep(tiny_gguf, monkeypatch):
    """When the search keeps the budgets by span, the plan's floor becomes what its patterns always keep (32 for
    SnapKV here), not a quarter of the budget (40): the budgets at the plan's own budget are those searched, and
    `--kv-budget 64` keeps their proportions instead of holding layer 0 at the old floor (40). A floor the user
    gave (`b_min`) is kept."""
    monkeypatch.setattr(Model, "attention_windows", lambda self: [40, None])
    kw = dict(budget=160, samples=1, ctx=384, n_cont=32, patterns=("snapkv",), budget_moves=False,
              prompt_budgets=False, min_gain=-10.0, progress=False, log=lambda m: None)  # accept the span step
    res = runtime_calibrate(tiny_gguf, None, **kw)
    assert res.steps[1].accepted and res.steps[1].what == "budgets in proportion to the layers' spans: [40, 280]"
    assert res.plan.b_min == 32
    assert res.plan.token_budgets("prefill") == [40, 280]
    assert res.plan.scaled(64).token_budgets("prefill") == [34, 94]  # 32 + 64 x 8/256 and 32 + 64 x 248/256
    given = runtime_calibrate(tiny_gguf, None, b_min=40, **kw)
    assert given.plan.b_min == 40 and given.plan.token_budgets("prefill") == [40, 280]
    assert given.plan.scaled(64).token_budgets("prefill") == [40, 88]
