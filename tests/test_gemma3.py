"""PolyKV on the real Gemma-3-270M (gemma3: sliding-window layers with a 512-token window + global layers)."""

import re

import numpy as np
import pytest

from polykv_cpp import _native
from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.cli import kv_cache_bytes, stock_layer_cells

pytestmark = pytest.mark.slow

TEXT = ("The quick brown fox jumps over the lazy dog. " * 40) + "The secret number is 4817. " + \
       ("A journey of a thousand miles begins with a single step. " * 40)


@pytest.fixture(scope="module")
def gemma():
    from polykv_cpp import models

    return models.fetch("gemma-3-270m-q4_k_m", progress=False)


def swa_layers(model):
    """Sliding-window layers of gemma3: every layer but each 6th (global attention)."""
    return [il for il in range(model.n_layer) if (il + 1) % 6 != 0]


def phase(pattern, budget=None, **kw):
    return plan_mod.PhasePlan(pattern, budget=budget, **kw)


def make_plan(n_layer, per_layer):
    layers = [plan_mod.LayerPlan(il, *per_layer(il)) for il in range(n_layer)]
    return plan_mod.Plan(version=1, n_layer=n_layer, budget_avg=64, b_min=1, budget_rule="test", layers=layers,
                         exact_total=False)


def logits_of(model, tokens, plan, n_ctx=2048, swa_full=None):
    model.set_plan(plan)
    with model.context(n_ctx=n_ctx, n_ubatch=512, swa_full=swa_full) as ctx:
        ctx.decode(tokens)
        first = ctx.logits()
        for t in tokens[-4:]:
            ctx.decode([t])
        return first, ctx.logits(), ctx.kv_layer_stats(), ctx


def test_fullkv_plan_matches_stock_iswa(gemma):
    with Model(gemma) as model:
        toks = model.tokenize(TEXT)
        assert len(toks) > 600  # longer than the 512-token window
        base = logits_of(model, toks, None)
        full = logits_of(model, toks, make_plan(model.n_layer, lambda il: (phase("fullkv"), phase("fullkv"))))
    np.testing.assert_allclose(full[0], base[0], atol=1e-5)
    np.testing.assert_allclose(full[1], base[1], atol=1e-5)


def test_fullkv_plan_matches_llama_cpp_tools_past_the_sliding_window_cache(gemma):
    """Past window + one ubatch (1024 tokens here) the stock SWA cache of llama.cpp's tools reuses its cells as a
    ring; a FullKV plan's sliding-window layers are that cache, so the logits stay equal to it (the full-size cache
    rounds differently there: scripts/swa_layout_check.py)."""
    with Model(gemma) as model:
        toks = model.tokenize(TEXT * 2)
        assert 1024 + 256 < len(toks) < 2048 - 8
        base = logits_of(model, toks, None, swa_full=False)
        full = logits_of(model, toks, make_plan(model.n_layer, lambda il: (phase("fullkv"), phase("fullkv"))))
    np.testing.assert_allclose(full[0], base[0], atol=1e-5)
    np.testing.assert_allclose(full[1], base[1], atol=1e-5)


def stock_cache_cells(model, capsys, **kw) -> list[int]:
    """Cells per layer of a context without a plan, as llama.cpp's own log states them."""
    model.set_plan(None)
    capsys.readouterr()
    _native.set_verbose(True)
    try:
        with model.context(**kw) as ctx:
            n_ctx = ctx.n_ctx
    finally:
        _native.set_verbose(False)
    sizes = re.findall(r"llama_kv_cache: size = .*?\(\s*(\d+) cells,\s*(\d+) layers", capsys.readouterr().err)
    assert sizes, "llama.cpp logged no cache size"
    return n_ctx, sorted(int(c) for c, n in sizes for _ in range(int(n)))


def test_fullkv_memory_is_what_llama_cpp_allocates(gemma, capsys):
    """A plan's savings are measured against the cache stock llama.cpp's tools allocate: a sliding-window layer
    holds its window + one ubatch (padded to 256), not n_ctx cells; with swa_full (--swa-full) every layer n_ctx."""
    with Model(gemma) as model:
        for n_ctx, n_ubatch in ((4352, 512), (2048, 256), (700, 512)):
            real_ctx, stock = stock_cache_cells(model, capsys, n_ctx=n_ctx, n_ubatch=n_ubatch, swa_full=False)
            assert sorted(stock_layer_cells(model, real_ctx, n_ubatch)) == stock
            full_ctx, full = stock_cache_cells(model, capsys, n_ctx=n_ctx, n_ubatch=n_ubatch, swa_full=True)
            assert full == [full_ctx] * model.n_layer == stock_layer_cells(model, full_ctx, None)
            model.set_plan(plan_mod.uniform_plan(model.n_layer, "snapkv", 64))
            with model.context(n_ctx=n_ctx, n_ubatch=n_ubatch) as ctx:
                stats = ctx.kv_layer_stats()
            per_cell = stats[0].bytes / stats[0].capacity
            assert sorted(round(s.bytes_fullkv / per_cell) for s in stats) == stock
            assert sum(s.bytes_fullkv for s in stats) == pytest.approx(kv_cache_bytes(model, real_ctx, 2, 2, n_ubatch),
                                                                       rel=1e-6)
            assert sum(s.bytes for s in stats) < sum(s.bytes_fullkv for s in stats)


def test_window_and_budgets_on_gemma3(gemma):
    with Model(gemma) as model:
        toks = model.tokenize(TEXT)
        swa = set(swa_layers(model))

        def per_layer(il):
            if il in swa:
                # a sliding-window layer keeps its window; layer 0 is shrunk further
                return (phase("streamingllm", 32, n_sink=4), phase("streamingllm", 32, n_sink=4)) if il == 0 \
                    else (phase("fullkv"), phase("fullkv"))
            return (phase("h2o", 96, n_sink=4, window=16), phase("tova", 64, window=1))

        plan = make_plan(model.n_layer, per_layer)
        model.set_plan(plan)
        with model.context(n_ctx=4096, n_ubatch=256, n_batch=256) as ctx:
            ctx.decode(toks)
            n = len(toks)
            stats = {s.layer: s for s in ctx.kv_layer_stats()}
            for il, s in stats.items():
                if il == 0:
                    # the window comes first (older tokens are invisible anyway), then StreamingLLM inside it
                    kept = ctx.kept_positions(0)
                    assert s.used == 32 and kept[4:] == list(range(n - 28, n)) and kept[0] >= n - 511
                elif il in swa:
                    # FullKV in a sliding-window layer: the stock SWA cache (window + one ubatch, old cells masked)
                    assert set(range(n - 511, n)) <= set(ctx.kept_positions(il)), il
                    assert s.capacity == 512 + 256
                else:
                    assert s.used == 96 and s.pattern_prefill == "h2o", il
            ctx.decode(model.tokenize(" The", add_special=False))
            after = {s.layer: s.used for s in ctx.kv_layer_stats()}
            assert all(after[il] == 64 for il in stats if il not in swa)
            for il, s in stats.items():
                if il in swa and il != 0:
                    assert s.bytes == s.bytes_fullkv, il  # FullKV in a sliding-window layer: the stock SWA cache
                else:
                    assert s.bytes < 0.4 * s.bytes_fullkv, il
            assert np.isfinite(ctx.logits()).all()


def test_rescaled_plan_gives_sliding_window_layers_at_most_their_window(gemma):
    """--kv-budget above the window: the native rescaling and Plan.scaled(caps=...) move what sliding-window
    layers cannot hold to the global layers, and the caches are allocated that way."""
    with Model(gemma) as model:
        windows = model.attention_windows()
        swa = swa_layers(model)
        assert windows == [512 if il in swa else None for il in range(model.n_layer)]
        plan = plan_mod.uniform_plan(model.n_layer, "snapkv", 256)
        model.set_plan(plan, kv_budget=1024)
        with model.context(n_ctx=8192, n_ubatch=256) as ctx:
            stats = ctx.kv_layer_stats()
        native = [s.budget_prefill for s in stats]
        expected = plan.scaled(1024, caps=windows).token_budgets("prefill")
        assert native == expected and sum(native) == 1024 * model.n_layer
        assert all(b == 512 for il, b in enumerate(native) if il in swa)
        glob = [b for il, b in enumerate(native) if il not in swa]
        assert glob == [(1024 * 18 - 512 * 15) // 3] * 3  # 3584 each
        assert all(s.capacity >= 3584 for s in stats if s.layer not in swa)
        assert all(s.capacity <= 512 + 256 for s in stats if s.layer in swa)


def test_budgets_split_by_span_on_gemma3(gemma):
    """Plan.span_split on the real model: the native library resolves the split's shares as Plan.token_budgets and
    Plan.scaled(caps=...) do, at the plan's budget and at --kv-budget; the sliding-window layers get less than the
    average, the global layers more, and the caches are allocated that way."""
    with Model(gemma) as model:
        windows = model.attention_windows()
        swa = swa_layers(model)
        plan = plan_mod.uniform_plan(model.n_layer, "snapkv", 256).span_split(windows, 4096)
        for kv_budget, expected in ((0, plan.token_budgets("prefill")),
                                    (1024, plan.scaled(1024, caps=windows).token_budgets("prefill"))):
            model.set_plan(plan, kv_budget=kv_budget)
            with model.context(n_ctx=4096, n_ubatch=256) as ctx:
                stats = ctx.kv_layer_stats()
            native = [s.budget_prefill for s in stats]
            avg = kv_budget or 256
            assert native == expected and sum(native) == avg * model.n_layer
            assert max(native[il] for il in swa) < avg < min(b for il, b in enumerate(native) if il not in swa)
            assert max(s.capacity for s in stats if s.layer in swa) < min(s.capacity for s in stats
                                                                          if s.layer not in swa)
        model.set_plan(None)


def test_per_head_selection_with_one_kv_head_is_the_layer_selection(gemma):
    """Gemma-3-270M has one KV head: per-head selection must keep exactly the per-layer sets, and the per-head
    masks (sliding-window layers included) must give the same logits as the stock masks.

    The prompt is one ubatch: this Q4_K_M model turns any change of summation order into logit differences of
    about 1 (stock llama.cpp itself gives logits 1.1 apart for the same 513 tokens fed as 513 or as 512 + 1), and
    a repack moves cells, so only what does not move is compared bit for bit."""
    def plan_for(selection):
        def per_layer(il):
            b = 128 if (il + 1) % 6 else 96
            return tuple(phase("snapkv", b, window=16, obs_window=16, pool_kernel=7, selection=selection)
                         for _ in range(2))
        return make_plan(18, per_layer)

    with Model(gemma) as model:
        assert model.n_layer == 18
        toks = model.tokenize(TEXT)
        runs = {}
        for sel in ("layer", "head"):
            model.set_plan(plan_for(sel))
            with model.context(n_ctx=2048, n_ubatch=1024, n_batch=1024) as ctx:
                ctx.decode(toks)
                assert all(ctx.layer_per_head(il) == (sel == "head") for il in range(model.n_layer))
                kept = [ctx.kept_positions(il, 0) for il in range(model.n_layer)]
                stats = [(s.used, s.capacity, s.bytes) for s in ctx.kv_layer_stats()]
                runs[sel] = (ctx.logits(), kept, stats)
    np.testing.assert_allclose(runs["head"][0], runs["layer"][0], atol=1e-4)
    assert runs["head"][1] == runs["layer"][1]
    assert runs["head"][2] == runs["layer"][2]
    assert min(len(k) for k in runs["head"][1]) == 96 < len(toks)


def test_kvzip_on_sliding_window_layers(gemma):
    """KVzip's reconstruction pass on gemma3: per head (one KV head) keeps exactly the per-layer sets, a
    sliding-window layer keeps only tokens its next query can see, and the global layers keep the needle's tokens
    (the reconstruction queries read them back) where the same plan without a pass (chunked prefill: sinks and
    the most recent tokens) keeps none of them."""
    def plan_for(selection):
        def per_layer(il):
            b = 128 if (il + 1) % 6 else 96
            return (phase("kvzip", b, n_sink=4, window=0, selection=selection),
                    phase("snapkv", b, window=16, obs_window=16, pool_kernel=7, selection=selection))
        return make_plan(18, per_layer)

    with Model(gemma) as model:
        toks = model.tokenize(TEXT)
        needle = model.tokenize(" 4817", add_special=False)
        at = next(i for i in range(len(toks)) if toks[i:i + len(needle)] == needle)
        needle_pos = set(range(at, at + len(needle)))
        windows = model.attention_windows()
        kept = {}
        for sel in ("layer", "head"):
            model.set_plan(plan_for(sel), prefill="exact")
            with model.context(n_ctx=2048, n_ubatch=512, n_batch=512) as ctx:
                ctx.decode(toks)
                assert ctx.compress_prompt_kvzip(toks) > 0
                kept[sel] = [ctx.kept_positions(il, 0) for il in range(model.n_layer)]
                assert ctx.pos_max() == len(toks) - 1  # the reconstruction tokens are gone
        model.set_plan(plan_for("layer"))
        with model.context(n_ctx=2048, n_ubatch=512, n_batch=512) as ctx:
            ctx.decode(toks)
            unscored = [ctx.kept_positions(il) for il in range(model.n_layer)]
    assert kept["head"] == kept["layer"]
    glob = [il for il in range(18) if windows[il] is None]
    assert len(glob) == 3
    for il, k in enumerate(kept["layer"]):
        if windows[il]:
            assert min(k) > len(toks) - windows[il] - 1, f"layer {il} keeps tokens its window hides"
        else:
            assert len(k) == 96
    assert all(needle_pos & set(kept["layer"][il]) for il in glob)
    assert not any(needle_pos & set(unscored[il]) for il in glob)


def test_probing_a_streaming_prompt_on_gemma3(gemma):
    """Sliding-window and global layers both take a probe (`decode(..., probe=...)`): the prompt streams in
    ubatches of 128 with its question as the probe, the probe leaves no trace, and after the compression every
    layer keeps its budget; the probe changes what the global layers keep."""
    with Model(gemma) as model:
        toks = model.tokenize(TEXT + " What is the secret number?")
        model.set_plan(plan_mod.uniform_plan(model.n_layer, "snapkv", 64))
        kept = {}
        for probe in (toks[-16:], None):
            with model.context(n_ctx=2048, n_batch=128, n_ubatch=128) as ctx:
                ctx.decode(toks, probe=probe)
                assert ctx.pos_max() == len(toks) - 1
                ctx.compress_prompt()
                kept[probe is None] = [ctx.kept_positions(il) for il in range(model.n_layer)]
                assert all(len(k) == 64 for k in kept[probe is None])
                assert all(max(k) == len(toks) - 1 for k in kept[probe is None])
        glob = [il for il in range(model.n_layer) if il not in swa_layers(model)]
        assert any(kept[False][il] != kept[True][il] for il in glob)


def test_a_protected_tail_stops_at_a_sliding_window(gemma):
    """`"protect_tail"` comes after the rescaling; a sliding-window layer grows only up to its window, the global
    layers by the whole tail, as `Plan.tail_applied(caps=...)` says."""
    with Model(gemma) as model:
        windows = model.attention_windows()
        swa = swa_layers(model)
        plan = plan_mod.uniform_plan(model.n_layer, "snapkv", 256, protect_tail=32)
        model.set_plan(plan, kv_budget=496)
        with model.context(n_ctx=8192, n_ubatch=256) as ctx:
            native = [s.budget_prefill for s in ctx.kv_layer_stats()]
        expected = plan.scaled(496, caps=windows).tail_applied(8192, caps=windows).token_budgets("prefill")
        assert native == expected
        assert [b for il, b in enumerate(native) if il in swa] == [512] * len(swa)
        assert [b for il, b in enumerate(native) if il not in swa] == [496 + 32] * (model.n_layer - len(swa))


def test_decode_steps_of_several_sequences_share_ubatches_on_gemma3(gemma, monkeypatch):
    # sliding-window and global layers, per-head SnapKV: three sequences' decode steps in shared ubatches keep and
    # compute what they do in ubatches of their own (f32 cache, flash attention off: no f16 rounding in between)
    from polykv_cpp.plan import uniform_plan

    with Model(gemma) as model:
        base = model.tokenize(TEXT)
        prompts = [base[:700], base[40:640], base[90:800]]
        runs = {}
        for shared in ("1", "0"):
            monkeypatch.setenv("LLAMA_POLYKV_SHARED_UBATCH", shared)
            model.set_plan(uniform_plan(model.n_layer, "snapkv", 96, selection="head"))
            with model.context(n_ctx=3 * 1024, n_ubatch=256, n_seq_max=3, flash_attn="off",
                               type_k="f32", type_v="f32") as ctx:
                for s, p in enumerate(prompts):
                    ctx.decode_sequences({s: p[:-5]})
                logits = []
                for k in range(5):
                    out = ctx.decode_sequences({s: [p[len(p) - 5 + k]] for s, p in enumerate(prompts)})
                    logits.append(np.array([ctx.logits(out[s]) for s in range(3)]))
                kept = [[ctx.kept_positions(il, h, seq=s) for il in range(model.n_layer) for h in (None, 0)]
                        for s in range(3)]
                runs[shared] = (logits, kept, ctx.shared_ubatches())
    assert runs["1"][2] == (5, 15) and runs["0"][2] == (0, 0)
    assert runs["1"][1] == runs["0"][1]
    for got, want in zip(runs["1"][0], runs["0"][0]):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
