"""A plan's `followup`: how tokens fed after its prompt was compressed (the question after a compressed document,
the next turn of a chat) are merged into the cache."""

import json
from dataclasses import replace

import numpy as np
import pytest

from polykv_cpp.api import Model
from polykv_cpp.errors import PlanError
from polykv_cpp.plan import Plan, uniform_plan
from tiny_models import TinyConfig, write_tiny_gguf

CFG = TinyConfig(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=384)
BUDGET = 48


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("followup") / "tiny.gguf", CFG, seed=21)


def plan(prefill: str, followup: str, selection: str) -> Plan:
    p = uniform_plan(CFG.n_layer, prefill, BUDGET, selection=selection, decode_pattern="snapkv")
    for lp in p.layers:  # the decode SnapKV: an observation window of 8 queries
        lp.decode = replace(lp.decode, window=8, obs_window=8)
    return replace(p, followup=followup)


def kept(ctx, heads):
    return [[ctx.kept_positions(il, h) for h in heads] for il in range(CFG.n_layer)]


def test_followup_key_round_trips_and_is_checked_by_both_parsers(path):
    p = plan("tova", "decode", "layer")
    assert json.loads(p.to_json())["followup"] == "decode"
    assert Plan.from_json(p.to_json()).followup == "decode"
    assert "followup" not in json.loads(replace(p, followup="prefill").to_json())  # plans without it are unchanged
    bad = json.loads(p.to_json())
    bad["followup"] = "question"
    with pytest.raises(PlanError, match="followup"):
        Plan.from_dict(bad)
    with Model(path) as model:
        with pytest.raises(PlanError, match="followup"):
            model._set_native_plan(json.dumps(bad), 0)


@pytest.mark.parametrize("selection", ["layer", "head"])
def test_a_question_after_the_compression_is_merged_by_the_decode_pattern(path, selection):
    """followup "decode": the question is merged in as a plan whose prefill pattern is the decode SnapKV would merge
    it, from the same compressed document (a portable state moves the cache between the two plans)."""
    rng = np.random.default_rng(5)
    doc = [int(t) for t in rng.integers(3, CFG.n_vocab, size=200)]
    question = [int(t) for t in rng.integers(3, CFG.n_vocab, size=30)]
    heads = [None] + (list(range(CFG.n_head_kv)) if selection == "head" else [])
    kw = dict(n_ctx=512, n_batch=512, n_ubatch=64)
    with Model(path) as model:
        model.set_plan(plan("tova", "decode", selection), prefill="portable")
        with model.context(**kw) as ctx:
            ctx.decode(doc)
            ctx.compress_prompt()  # the document, by TOVA
            compressed = ctx.state_bytes()
            after_doc = kept(ctx, heads)
            ctx.decode(question)
            ctx.decode([7])  # the answer starts: the question is merged in
            got = kept(ctx, heads)

        snap_plan = plan("tova", "prefill", selection)
        for lp in snap_plan.layers:  # prefill = the decode SnapKV above
            lp.prefill = replace(lp.decode)
        model.set_plan(snap_plan, prefill="portable")
        with model.context(**kw) as ctx:
            ctx.load_state_bytes(compressed)
            assert kept(ctx, heads) == after_doc
            ctx.decode(question)
            ctx.decode([7])
            want = kept(ctx, heads)

        model.set_plan(plan("tova", "prefill", selection), prefill="portable")
        with model.context(**kw) as ctx:  # the default: TOVA merges the question too
            ctx.load_state_bytes(compressed)
            ctx.decode(question)
            ctx.decode([7])
            default = kept(ctx, heads)
    assert got == want
    assert got != default
    for layer in got:  # every head (or the layer) keeps its budget
        for k in layer[1:] if selection == "head" else layer:
            assert len(k) == BUDGET


@pytest.mark.parametrize("prefill_mode", ["exact", "chunked"])
@pytest.mark.parametrize("selection", ["layer", "head"])
def test_keep_never_evicts_what_comes_after_the_compression_and_grows_the_cache(path, prefill_mode, selection):
    """followup "keep": the compressed document stays as it was compressed; the question and every generated token
    are kept, the caches growing one ubatch of room at a time (as kvpress's pipeline: the budget bounds the
    context). Exact prefill: the logits equal those of a plan whose decode phase is FullKV with follow-ups merged by
    it (the same kept sets in caches of n_ctx cells)."""
    rng = np.random.default_rng(6)
    doc = [int(t) for t in rng.integers(3, CFG.n_vocab, size=200)]
    question = [int(t) for t in rng.integers(3, CFG.n_vocab, size=30)]
    answer = [int(t) for t in rng.integers(3, CFG.n_vocab, size=70)]
    heads = [None] + (list(range(CFG.n_head_kv)) if selection == "head" else [])
    kw = dict(n_ctx=512, n_batch=512, n_ubatch=32)
    with Model(path) as model:
        model.set_plan(plan("snapkv", "keep", selection), prefill=prefill_mode)
        assert "follow-ups kept" in plan("snapkv", "keep", selection).summary()
        with model.context(**kw) as ctx:
            ctx.decode(doc)
            ctx.compress_prompt()
            after_doc = kept(ctx, heads)
            cap0 = [s.capacity for s in ctx.kv_layer_stats()]
            ctx.decode(question)
            for t in answer:  # longer than the room of one ubatch: the caches grow
                ctx.decode([t])
            got = kept(ctx, heads)
            stats = ctx.kv_layer_stats()
            logits = ctx.logits()
        if prefill_mode == "exact":
            full_decode = plan("snapkv", "decode", selection)
            for lp in full_decode.layers:
                lp.decode = replace(lp.decode, pattern="fullkv", budget=None, n_sink=0, window=None, obs_window=None,
                                    pool_kernel=None, selection="layer")
            model.set_plan(replace(full_decode, exact_total=False, full_charge=512), prefill="exact")
            with model.context(**kw) as ctx:
                ctx.decode(doc)
                ctx.compress_prompt()
                ctx.decode(question)
                for t in answer:
                    ctx.decode([t])
                assert kept(ctx, heads) == got
                np.testing.assert_allclose(ctx.logits(), logits, rtol=1e-5, atol=1e-5)
                assert all(s.capacity == 512 for s in ctx.kv_layer_stats())
    new = list(range(len(doc), len(doc) + len(question) + len(answer)))
    for before, after in zip(after_doc, got):
        for h, b, a in zip(heads, before, after):
            assert a == b + new
            if h is not None or selection == "layer":  # (per head, None is the union of the heads' sets)
                assert len(b) == BUDGET
    for s, c0 in zip(stats, cap0):  # (per head: cells hold one row of every head)
        assert s.used == BUDGET + len(new) and c0 < s.capacity < 512  # grown by a ubatch of room, not to n_ctx
    p = plan("snapkv", "prefill", selection)
    bad = json.loads(p.to_json())
    bad["followup"] = "forever"
    with pytest.raises(PlanError, match="prefill, decode, keep"):
        Plan.from_dict(bad)


@pytest.mark.parametrize("prefill_mode", ["exact", "chunked"])
def test_a_state_saved_from_grown_caches_loads_at_their_sizes_and_goes_on_identically(path, prefill_mode):
    """followup "keep": a state saved after the caches grew by the question and part of the answer loads into a
    fresh context of the same plan at those sizes and continues as the saved one would have; a plan that does not
    keep follow-ups refuses it."""
    rng = np.random.default_rng(8)
    doc = [int(t) for t in rng.integers(3, CFG.n_vocab, size=200)]
    question = [int(t) for t in rng.integers(3, CFG.n_vocab, size=30)]
    answer = [int(t) for t in rng.integers(3, CFG.n_vocab, size=60)]
    kw = dict(n_ctx=512, n_batch=512, n_ubatch=32)
    heads = [None, 0, 1]

    def steps(ctx, toks):
        out = []
        for t in toks:
            ctx.decode([t])
            out.append((kept(ctx, heads), ctx.logits().copy()))
        return out

    with Model(path) as model:
        model.set_plan(plan("snapkv", "keep", "head"), prefill=prefill_mode)
        with model.context(**kw) as ctx:
            ctx.decode(doc)
            ctx.compress_prompt()
            ctx.decode(question)
            steps(ctx, answer[:40])  # past the first ubatch of room: grown
            caps = [s.capacity for s in ctx.kv_layer_stats()]
            state = ctx.state_bytes()
            want = steps(ctx, answer[40:])
        with model.context(**kw) as ctx:
            ctx.load_state_bytes(state)
            assert [s.capacity for s in ctx.kv_layer_stats()] == caps
            got = steps(ctx, answer[40:])
        assert all(BUDGET + len(question) + 40 <= c < 512 for c in caps)
        for (k_want, l_want), (k_got, l_got) in zip(want, got):
            assert k_got == k_want
            np.testing.assert_allclose(l_got, l_want, rtol=0, atol=1e-6)
        model.set_plan(plan("snapkv", "prefill", "head"), prefill=prefill_mode)
        with model.context(**kw) as ctx:
            with pytest.raises(Exception, match="different cache sizes"):
                ctx.load_state_bytes(state)
