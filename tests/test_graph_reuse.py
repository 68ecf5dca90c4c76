"""Graph reuse with a plan: decode steps reuse the previous compute graph while nothing it was built from changed.

llama.cpp rebuilds a graph only when a new ubatch cannot reuse the last one (`llm_graph_result::can_reuse`). With a
plan the graph also depends on the cache's state: each group's cache tensors (replaced when exact modes shrink or
grow them, and different for every sequence), its n_kv, and its score branch (which outputs the patterns read this
step, e.g. none on the decode steps that `evict_every` leaves idle). The tests compare the same run with reuse on
and with llama.cpp's own switch `LLAMA_GRAPH_REUSE_DISABLE=1`: the logits are bit for bit the same and so are the
kept positions, and with reuse on graphs are reused. Kept sets against the independent references are tested in
test_polykv_native, test_per_head and test_evict_every, which run with reuse on.
"""

import dataclasses

import numpy as np
import pytest

from polykv_cpp.api import Model
from polykv_cpp.plan import uniform_plan
from tiny_models import TinyConfig, write_tiny_gguf

CFG = TinyConfig(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=384)
N_PROMPT, N_DECODE, BUDGET = 90, 24, 40


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("reuse") / "tiny.gguf", CFG, seed=5)


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(7)
    return [int(t) for t in rng.integers(3, CFG.n_vocab, size=N_PROMPT + N_DECODE)]


@pytest.fixture
def reuse_switch(monkeypatch):
    """set(False) turns llama.cpp's graph reuse off for the contexts created next."""
    def set_reuse(on: bool) -> None:
        if on:
            monkeypatch.delenv("LLAMA_GRAPH_REUSE_DISABLE", raising=False)
        else:
            monkeypatch.setenv("LLAMA_GRAPH_REUSE_DISABLE", "1")
    return set_reuse


def heads_of(plan):
    return [None] + (list(range(CFG.n_head_kv)) if plan.layers[0].prefill.per_head else [])


def run(path, plan, tokens, *, prefill="chunked", n_ubatch=32):
    """Logits after the prompt and after every decode step, the kept positions of every layer (and head), and
    how many graphs llama.cpp reused."""
    with Model(path) as model:
        model.set_plan(plan, prefill=prefill)
        with model.context(n_ctx=256, n_batch=n_ubatch, n_ubatch=n_ubatch, flash_attn="on", type_k="f32",
                           type_v="f32") as ctx:
            ctx.decode(tokens[:N_PROMPT])
            logits, kept = [ctx.logits()], []
            for t in tokens[N_PROMPT:]:
                ctx.decode([t])
                logits.append(ctx.logits())
                kept.append([[ctx.kept_positions(il, h) for h in heads_of(plan)] for il in range(CFG.n_layer)])
            reused = ctx.perf()["graphs_reused"]
    return np.array(logits), kept, reused


CASES = {
    "snapkv": dict(pattern="snapkv"),
    "h2o-head": dict(pattern="h2o", selection="head"),
    "tova-adaptive": dict(pattern="tova", selection="adaptive"),
    "knorm": dict(pattern="knorm"),
    "expected_attention": dict(pattern="expected_attention"),
    "streamingllm": dict(pattern="streamingllm"),
}


@pytest.mark.parametrize("evict_every", [1, 5])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reused_graphs_give_the_same_logits_and_kept_sets(path, tokens, reuse_switch, case, evict_every):
    kw = CASES[case]
    plan = uniform_plan(CFG.n_layer, kw["pattern"], BUDGET, selection=kw.get("selection", "layer"))
    plan = dataclasses.replace(plan, evict_every=evict_every).validate()
    reuse_switch(True)
    logits, kept, reused = run(path, plan, tokens)
    reuse_switch(False)
    logits_off, kept_off, reused_off = run(path, plan, tokens)
    assert reused_off == 0
    assert kept == kept_off
    assert np.array_equal(logits, logits_off)
    # every decode step but the first (after the prompt's ubatches, of another shape) reuses the step before's
    # graph; with evict_every 5 the steps whose attention rows no eviction reads have a graph without them, so the
    # graph changes at most twice per eviction
    assert reused >= (N_DECODE - 1 if evict_every == 1 else N_DECODE // 2), reused


@pytest.mark.parametrize("pattern", ["snapkv", "kvzip"])
def test_a_compression_replaces_the_caches_and_the_graph_follows(path, tokens, reuse_switch, pattern):
    """Exact prefill keeps the whole prompt in n_ctx-cell caches and moves what it keeps into smaller ones when
    the prompt is compressed. Here the prompt's last token is a one-token ubatch with logits, the compression
    comes next, and then decode steps: graphs of the same shape and the same n_kv (256, llama.cpp's padding)
    before and after, over other tensors. A graph from before must not be reused after."""
    plan = uniform_plan(CFG.n_layer, pattern, BUDGET)
    results = {}
    for on in (True, False):
        reuse_switch(on)
        with Model(path) as model:
            model.set_plan(plan, prefill="exact")
            # n_ubatch 256: the caches after the compression have budget + 256 cells, so n_kv stays 256
            with model.context(n_ctx=2048, n_batch=256, n_ubatch=256, flash_attn="on", type_k="f32",
                               type_v="f32") as ctx:
                ctx.decode(tokens[:N_PROMPT - 1])
                ctx.decode(tokens[N_PROMPT - 1:N_PROMPT], phase="prefill")
                cells = [sum(s.capacity for s in ctx.kv_layer_stats())]
                if pattern == "kvzip":
                    ctx.compress_prompt_kvzip(tokens[:N_PROMPT])
                else:
                    ctx.compress_prompt()
                cells.append(sum(s.capacity for s in ctx.kv_layer_stats()))
                logits = [ctx.logits()]
                for t in tokens[N_PROMPT:]:
                    ctx.decode([t])
                    logits.append(ctx.logits())
                kept = [ctx.kept_positions(il) for il in range(CFG.n_layer)]
                results[on] = (np.array(logits), kept, ctx.perf()["graphs_reused"])
    assert cells[1] < cells[0], cells  # the caches were replaced by smaller ones
    assert results[True][1] == results[False][1]
    assert np.array_equal(results[True][0], results[False][0])
    assert results[True][2] >= N_DECODE - 1 and results[False][2] == 0


def test_sequences_never_share_a_graph(path, tokens, reuse_switch):
    """Every sequence has caches of its own: decode steps of two sequences in one batch (a ubatch per sequence)
    give with reuse what they give without it. A graph reused across sequences would read the other sequence's
    cache; llama.cpp refuses that reuse by sequence id, and the cache's graph key (its own tensors) refuses it
    too."""
    plan = uniform_plan(CFG.n_layer, "snapkv", BUDGET)
    prompts = {0: tokens[:N_PROMPT], 1: tokens[5:N_PROMPT + 5]}
    out = {}
    for on in (True, False):
        reuse_switch(on)
        with Model(path) as model:
            model.set_plan(plan)
            with model.context(n_ctx=512, n_batch=256, n_ubatch=32, flash_attn="on", type_k="f32", type_v="f32",
                               n_seq_max=2) as ctx:
                ctx.decode_sequences(prompts)
                logits = []
                for t in tokens[N_PROMPT:N_PROMPT + 8]:
                    res = ctx.decode_sequences({0: [t], 1: [t]})
                    logits += [ctx.logits(res[0]), ctx.logits(res[1])]
                kept = [ctx.kept_positions(il, seq=s) for il in range(CFG.n_layer) for s in (0, 1)]
                out[on] = (np.array(logits), kept)
    assert out[True][1] == out[False][1]
    assert np.array_equal(out[True][0], out[False][0])
    # the two sequences' contexts differ, so their logits do
    assert not np.array_equal(out[True][0][0], out[True][0][1])

