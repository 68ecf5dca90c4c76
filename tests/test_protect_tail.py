"""`"protect_tail"`: the prompt's last tokens kept on top of every budgeted layer's budget (the question at the end of
a prompt compressed whole). `Plan.tail_applied` says what the runtime runs (budgets + tail, prefill window + tail,
after any rescaling); the native caches hold that, keep what the numpy reference keeps at those budgets, and keep a
superset of what the plan without the tail keeps."""

import numpy as np
import pytest

from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.errors import PlanError
from polykv_cpp.patterns import allocate_prompt, pattern_from_phase_plan, simulate, softmax_causal
from test_kvzip import CHUNK, PREFIX, recon_attn  # noqa: F401
from test_polykv_native import CFG, P, hf_reference, tokens, twin  # noqa: F401

torch = pytest.importorskip("torch")

B = 12
TAIL = 6
R = CFG.n_head // CFG.n_head_kv


def kvzip_plan(selection: str = "head", allocation: str = "prompt", tail: int = TAIL) -> plan_mod.Plan:
    """Every layer: KVzip prefill (1 sink, no window), FullKV decode with the follow-ups kept (as the shipped KVzip
    plan), budgets per prompt or from the plan."""
    p = plan_mod.uniform_plan(CFG.n_layer, "kvzip", B, decode_pattern="fullkv", selection=selection,
                              allocation=allocation, n_sink=1, window=0, b_min=2, protect_tail=tail)
    return plan_mod.Plan.from_dict({**p.to_dict(), "followup": "keep"}).validate()


# ------------------------------------------------------------------------------------------------- the plan key

def test_the_plan_key_round_trips_and_survives_rescaling():
    p = kvzip_plan()
    assert p.to_dict()["protect_tail"] == TAIL
    assert plan_mod.Plan.from_json(p.to_json()).protect_tail == TAIL
    assert p.scaled(8).protect_tail == TAIL and p.scaled(8).budget_avg == 8
    assert "protect_tail" not in kvzip_plan(tail=0).to_dict()
    assert plan_mod.Plan.from_dict({**kvzip_plan(tail=0).to_dict(), "protect_tail": None}).protect_tail == 0
    assert f"last {TAIL} tokens kept on top" in p.summary()
    for bad in (-1, 1.5, True, "6", 2**31):
        with pytest.raises(PlanError, match="protect_tail"):
            plan_mod.Plan.from_dict({**p.to_dict(), "protect_tail": bad})


def test_tail_applied_grows_budgets_and_the_prefill_window_but_not_fullkv():
    p = plan_mod.Plan.from_dict({**plan_mod.uniform_plan(3, "snapkv", 40, window=8).to_dict(), "protect_tail": 10,
                                 "full_charge": 64, "exact_total": False})
    p.layers[0] = plan_mod.LayerPlan(0, plan_mod.PhasePlan("fullkv"), plan_mod.PhasePlan("fullkv"))
    p.validate()
    t = p.tail_applied()
    assert t.protect_tail == 0 and not t.exact_total
    assert t.token_budgets("prefill") == [None, 50, 50] and t.token_budgets("decode") == [None, 50, 50]
    assert [lp.prefill.window for lp in t.layers[1:]] == [18, 18]
    assert [lp.decode.window for lp in t.layers[1:]] == [8, 8]  # the decode pattern's own window
    assert p.resolved_budgets("prefill", 64) == [64, 50, 50]
    assert p.resolved_budgets("prefill", 45) == [45, 45, 45]  # a layer holds at most the context
    capped = p.tail_applied(caps=[None, 44, 0])
    assert capped.token_budgets("prefill") == [None, 44, 50] and capped.layers[1].prefill.window == 12
    assert p.tail_applied(n_ctx=46).token_budgets("decode") == [None, 46, 46]
    t.validate()
    plain = plan_mod.uniform_plan(3, "snapkv", 40)
    assert plain.tail_applied() is plain


# --------------------------------------------------------------------------------------- native = the reference

def reference_budgets_and_kept(hf_ref, recon, plan):
    """The kept positions of every layer and KV head after the compression, by the numpy reference of the plan the
    runtime runs (`tail_applied`): per-prompt budgets (`allocate_prompt`) when the plan asks for them."""
    run = plan.tail_applied()
    pres = [pattern_from_phase_plan(lp.prefill) for lp in run.layers]
    budgets = run.token_budgets("prefill")
    per_head = [lp.prefill.selection == "head" for lp in run.layers]

    def groups(il):
        rows = recon[il] if pres[il].name == "kvzip" else softmax_causal(hf_ref[il][0][:, :P, :P])
        return [rows[h * R:(h + 1) * R] for h in range(CFG.n_head_kv)] if per_head[il] else [rows]

    if run.allocation == "prompt":
        sets = [[pres[il].scores(budgets[il], P, attn=g) for g in groups(il)] for il in range(CFG.n_layer)]
        budgets = allocate_prompt(sets, budgets, [CFG.n_head_kv] * CFG.n_layer, run.b_min)
    kept = []
    for il in range(CFG.n_layer):
        logp = hf_ref[il][0]
        kw = dict(prefill=pres[il], prefill_budget=budgets[il], decode=None, decode_budget=None)
        if per_head[il]:
            kept.append([simulate(logp[h * R:(h + 1) * R], P, recon_attn=recon[il][h * R:(h + 1) * R],
                                  **kw).prefill_kept.tolist() for h in range(CFG.n_head_kv)])
        else:
            kept.append([simulate(logp, P, recon_attn=recon[il], **kw).prefill_kept.tolist()] * CFG.n_head_kv)
    return budgets, kept


def native_budgets_and_kept(path, plan, toks, *, kv_budget=0):
    with Model(path) as model:
        model.set_plan(plan, prefill="exact", kv_budget=kv_budget)
        with model.context(n_ctx=256, type_k="f32", type_v="f32", flash_attn="off") as ctx:
            ctx.decode(toks[:P])
            ctx.compress_prompt_kvzip(toks[:P], prefix=PREFIX, chunk=CHUNK)
            stats = ctx.kv_layer_stats()
            kept = [[ctx.kept_positions(il, h) for h in range(CFG.n_head_kv)] for il in range(CFG.n_layer)]
            ctx.decode([toks[P]])  # follow-ups kept: the cache grows by them, on top of budget + tail
            after = [ctx.kept_positions(il, 0) for il in range(CFG.n_layer)]
    return [s.budget_prefill for s in stats], [s.capacity for s in stats], kept, after


@pytest.mark.parametrize("allocation", ["plan", "prompt"])
@pytest.mark.parametrize("selection", ["layer", "head"])
def test_native_keeps_what_the_reference_keeps_at_budget_plus_tail(twin, tokens, hf_reference, recon_attn,
                                                                    selection, allocation):
    _, path = twin
    plan = kvzip_plan(selection, allocation)
    want_budgets, want = reference_budgets_and_kept(hf_reference, recon_attn, plan)
    budgets, capacity, kept, after = native_budgets_and_kept(path, plan, tokens)
    assert budgets == want_budgets
    assert sum(budgets) <= CFG.n_layer * (B + TAIL) and sum(budgets) > CFG.n_layer * (B + TAIL - 1)
    assert all(c >= b for c, b in zip(capacity, budgets))
    tail = list(range(P - TAIL, P))
    for il in range(CFG.n_layer):
        assert after[il] == kept[il][0] + [P]
        for h in range(CFG.n_head_kv):
            assert kept[il][h] == want[il][h], f"layer {il} head {h}"
            assert kept[il][h][-TAIL:] == tail
    # the same plan written out by tail_applied (no tail key) runs identically: the native rule is that function
    assert native_budgets_and_kept(path, plan.tail_applied(), tokens)[2] == kept


@pytest.mark.parametrize("selection", ["layer", "head"])
def test_the_tail_comes_on_top_of_what_the_plan_keeps_without_it(twin, tokens, selection):
    """With the plan's own budgets, every token the plan keeps without a tail is still kept, and the last TAIL
    prompt tokens with it, in B + TAIL cells per head; rescaled (`kv_budget`), the tail is added after."""
    _, path = twin
    _, _, base, _ = native_budgets_and_kept(path, kvzip_plan(selection, "plan", tail=0), tokens)
    budgets, capacity, kept, _ = native_budgets_and_kept(path, kvzip_plan(selection, "plan"), tokens)
    assert budgets == [B + TAIL] * CFG.n_layer
    for il in range(CFG.n_layer):
        for h in range(CFG.n_head_kv):
            assert set(base[il][h]) | set(range(P - TAIL, P)) <= set(kept[il][h])
            assert len(kept[il][h]) == B + TAIL
    budgets, _, kept, _ = native_budgets_and_kept(path, kvzip_plan(selection, "plan"), tokens, kv_budget=8)
    assert budgets == [8 + TAIL] * CFG.n_layer
    assert all(k[-TAIL:] == list(range(P - TAIL, P)) for layer in kept for k in layer)



def test_run_and_the_stock_tools_take_the_tail(cli_exe, tiny_gguf, tmp_path):
    """`run --protect-tail N` adds the tail to the plan it runs (caches of budget + N, the log says so); a plan's
    own key reaches the stock tools; a bad value or no plan is a clean error."""
    import os

    from conftest import run_cli, run_stock
    from polykv_cpp._native import bin_dir

    sidecar = tmp_path / "plan.json"
    sidecar.write_text(plan_mod.uniform_plan(2, "streamingllm", 32, n_sink=4).to_json())
    args = ["-p", "the cat and the dog " * 20, "-n", "4", "-c", "2048", "-ub", "128", "--no-echo", "-v",
            "--prefill-mode", "exact"]
    plain = run_cli(cli_exe, "run", tiny_gguf, "--plan", sidecar, *args)
    tail = run_cli(cli_exe, "run", tiny_gguf, "--plan", sidecar, "--protect-tail", "8", *args)
    assert plain.returncode == 0 and tail.returncode == 0, tail.stderr[-2000:]
    assert "budget 32/32" in plain.stderr and "used 32" in plain.stderr and "tokens on top" not in plain.stderr
    assert "budget 40/40" in tail.stderr and "used 40" in tail.stderr
    assert "the prompt's last 8 tokens on top" in tail.stderr  # llama.cpp's log (-v)
    assert "exact prefill, the prompt's last 8 tokens kept on top of the budget" in tail.stderr  # run's summary
    with_tail = tmp_path / "tail.json"
    with_tail.write_text(plan_mod.uniform_plan(2, "streamingllm", 32, n_sink=4, protect_tail=8).to_json())
    env = dict(os.environ, LLAMA_POLYKV_PLAN=str(with_tail))
    tool = run_stock([str(bin_dir() / "llama-completion"), "-m", str(tiny_gguf), "-p", "the cat", "-n", "2",
                      "-no-cnv", "--no-warmup", "-c", "2048", "-ub", "128", "-v"], timeout=120, env=env)
    assert tool.returncode == 0, tool.stderr[-2000:]
    assert "the prompt's last 8 tokens on top" in tool.stderr
    bad = run_cli(cli_exe, "run", tiny_gguf, "--plan", sidecar, "--protect-tail", "-1", *args)
    assert bad.returncode != 0 and "protect_tail must be an integer from 0" in bad.stderr
    assert "Traceback" not in bad.stderr
    none = run_cli(cli_exe, "run", tiny_gguf, "--protect-tail", "8", *args)
    assert none.returncode != 0 and "--protect-tail needs a plan" in none.stderr
