"""Several sequences in one context with a plan: every sequence has caches of its own with the plan's budgets,
is compressed exactly as it would be alone, and never evicts another sequence's tokens."""

import os

import numpy as np
import pytest

from polykv_cpp import _native
from polykv_cpp.api import Model
from polykv_cpp.errors import NativeError
from polykv_cpp.plan import uniform_plan
from tiny_models import TinyConfig, write_tiny_gguf

CFG = TinyConfig(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=384)
N_CTX, N_UB, BUDGET = 512, 32, 48
LENS = (150, 97, 121)  # prompts longer than the budget, of different lengths: ubatches of 32 and a remainder


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("seqs") / "tiny.gguf", CFG, seed=11)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(3, CFG.n_vocab, size=n + 4)] for n in LENS]


def kept(ctx, seq, heads):
    return [[ctx.kept_positions(il, h, seq=seq) for h in heads] for il in range(CFG.n_layer)]


@pytest.mark.parametrize("pattern,selection,prefill", [
    ("snapkv", "layer", "chunked"),
    ("h2o", "head", "chunked"),
    ("tova", "layer", "exact"),
    ("expected_attention", "head", "chunked"),
])
def test_each_sequence_is_compressed_as_it_would_be_alone(path, prompts, pattern, selection, prefill):
    heads = [None] + (list(range(CFG.n_head_kv)) if selection == "head" else [])
    kw = dict(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_UB, flash_attn="off")
    with Model(path) as model:
        model.set_plan(uniform_plan(CFG.n_layer, pattern, BUDGET, selection=selection), prefill=prefill)
        alone = []
        for p in prompts:
            with model.context(**kw) as ctx:
                ctx.decode(p[:-4])
                logits = [ctx.logits()]
                for tok in p[-4:]:  # decode steps evict too
                    ctx.decode([tok])
                    logits.append(ctx.logits())
                alone.append((kept(ctx, 0, heads), logits, ctx.kv_layer_stats()))

        with model.context(n_seq_max=len(prompts), **kw) as ctx:
            out = ctx.decode_sequences({s: p[:-4] for s, p in enumerate(prompts)})
            logits = {s: [ctx.logits(out[s])] for s in out}
            for k in range(4):  # one batch with a token of every sequence
                out = ctx.decode_sequences({s: [p[-4 + k]] for s, p in enumerate(prompts)})
                for s in out:
                    logits[s].append(ctx.logits(out[s]))
            stats = ctx.kv_layer_stats()
            assert ctx.shared_ubatches() == (4, 4 * len(prompts))  # the decode steps shared a ubatch
            for s in range(len(prompts)):
                assert kept(ctx, s, heads) == alone[s][0], f"sequence {s}"
                for got, want in zip(logits[s], alone[s][1]):
                    # a shared ubatch computes q and the new keys in a matrix product of 3 rows: 1e-7 apart, which
                    # now and then rounds to another f16 value in the cache's products (exact with an f32 cache:
                    # test_decode_steps_of_many_sequences_share_ubatches)
                    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
            one = alone[0][2]
            for st, st1 in zip(stats, one):  # memory: one plan-sized cache per sequence
                assert st.capacity == len(prompts) * st1.capacity
                assert st.bytes == len(prompts) * st1.bytes
                assert st.used == sum(a[2][st.layer].used for a in alone)
                assert st.bytes < st.bytes_fullkv


def test_sequences_are_removed_copied_and_saved_on_their_own(path, prompts):
    kw = dict(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_UB, flash_attn="on")
    with Model(path) as model:
        model.set_plan(uniform_plan(CFG.n_layer, "snapkv", BUDGET))
        with model.context(n_seq_max=3, **kw) as ctx:
            ctx.decode_sequences({0: prompts[0], 1: prompts[1]})
            k0, k1 = kept(ctx, 0, [None]), kept(ctx, 1, [None])
            assert len(k0[0][0]) == BUDGET and k0 != k1

            ctx.seq_cp(0, 2)  # the copy keeps what sequence 0's layers keep
            assert kept(ctx, 2, [None]) == k0 and ctx.pos_max(2) == ctx.pos_max(0)
            ctx.seq_rm(2, 100, -1)
            assert ctx.pos_max(2) == 99 and kept(ctx, 0, [None]) == k0

            ctx.seq_rm(0)  # sequence 1 keeps its tokens
            assert ctx.pos_max(0) == -1 and kept(ctx, 0, [None]) == [[[]], [[]]]
            assert kept(ctx, 1, [None]) == k1

            state = ctx.state_bytes()
            out = ctx.decode_sequences({1: [5]})
            want = ctx.logits(out[1])
        with model.context(n_seq_max=3, **kw) as ctx:
            ctx.load_state_bytes(state)
            assert kept(ctx, 1, [None]) == k1
            out = ctx.decode_sequences({1: [5]})
            # the restore packs the cells from 0 (they had holes): flash attention sums in another order
            np.testing.assert_allclose(ctx.logits(out[1]), want, atol=1e-3, rtol=0)
        with model.context(n_seq_max=2, **kw) as ctx:
            with pytest.raises(NativeError):
                ctx.load_state_bytes(state)  # saved with 3 sequences


def test_a_token_in_two_sequences_is_refused_with_a_message(path, prompts):
    with Model(path) as model:
        model.set_plan(uniform_plan(CFG.n_layer, "snapkv", BUDGET))
        with model.context(n_ctx=N_CTX, n_seq_max=2) as ctx:
            lib = ctx._lib
            batch = lib.llama_batch_init(1, 0, 2)
            try:
                batch.n_tokens = 1
                batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = prompts[0][0], 0, 2, 1
                batch.seq_id[0][0], batch.seq_id[0][1] = 0, 1
                mark = _native.log_mark()
                assert lib.llama_decode(ctx.ptr, batch) != 0
                assert "belongs to 2 sequences" in _native.log_since(mark)
            finally:
                lib.llama_batch_free(batch)


def run_steps(path, plan, prompts, shared, n_steps, **kw):
    """Prefill every prompt (all but its last n_steps tokens), then n_steps batches of one token per sequence;
    returns per step the logits of every sequence, the kept sets and shared_ubatches()."""
    old = os.environ.get("LLAMA_POLYKV_SHARED_UBATCH")
    os.environ["LLAMA_POLYKV_SHARED_UBATCH"] = "1" if shared else "0"
    try:
        with Model(path) as model:
            model.set_plan(plan)
            with model.context(n_seq_max=len(prompts), **kw) as ctx:
                for s, p in enumerate(prompts):  # prompts one at a time: n_batch is not a limit
                    ctx.decode_sequences({s: p[:-n_steps]})
                logits = []
                for k in range(n_steps):
                    out = ctx.decode_sequences({s: [p[len(p) - n_steps + k]] for s, p in enumerate(prompts)})
                    logits.append(np.array([ctx.logits(out[s]) for s in range(len(prompts))]))
                heads = [None] + list(range(CFG.n_head_kv))
                kept_sets = [kept(ctx, s, heads) for s in range(len(prompts))]
                return logits, kept_sets, ctx.shared_ubatches()
    finally:
        if old is None:
            os.environ.pop("LLAMA_POLYKV_SHARED_UBATCH")
        else:
            os.environ["LLAMA_POLYKV_SHARED_UBATCH"] = old


@pytest.mark.parametrize("pattern,selection,flash_attn", [
    ("h2o", "layer", "off"),
    ("snapkv", "head", "on"),
    ("tova", "head", "off"),
])
def test_decode_steps_of_many_sequences_share_ubatches(path, pattern, selection, flash_attn):
    # 17 sequences: ubatches of at most 16 sequences (LLAMA_POLYKV_MAX_SHARED_SEQS), so one of 16 and one of 1
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, CFG.n_vocab, size=60 + 3 * s)] for s in range(17)]
    plan = uniform_plan(CFG.n_layer, pattern, BUDGET, selection=selection)
    kw = dict(n_ctx=128 * 17, n_batch=128, n_ubatch=N_UB, flash_attn=flash_attn, type_k="f32", type_v="f32")
    n_steps = 6
    got = run_steps(path, plan, prompts, True, n_steps, **kw)
    want = run_steps(path, plan, prompts, False, n_steps, **kw)
    assert got[2] == (n_steps, n_steps * 16)
    assert want[2] == (0, 0)
    assert got[1] == want[1]
    # flash attention on the CPU rounds the queries to f16: 1e-7 apart in the inputs may round apart there
    atol = 2e-5 if flash_attn == "off" else 1e-3
    for g, w in zip(got[0], want[0]):
        np.testing.assert_allclose(g, w, atol=atol, rtol=0)


def mixed_batches(path, plan, prompts, shared, steps_first=True):
    """Sequences 0 and 1 prefilled, then two batches that mix their decode steps with pieces of sequence 2's prompt
    (the steps first, as llama-server orders them, or after the prompt); then sequence 2's first decode step.
    Returns the logits of every output, the kept sets per layer and KV head, and shared_ubatches()."""
    old = os.environ.get("LLAMA_POLYKV_SHARED_UBATCH")
    os.environ["LLAMA_POLYKV_SHARED_UBATCH"] = "1" if shared else "0"
    kw = dict(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_UB, flash_attn="off", type_k="f32", type_v="f32")
    try:
        with Model(path) as model:
            model.set_plan(plan)
            with model.context(n_seq_max=3, **kw) as ctx:
                ctx.decode_sequences({0: prompts[0][:-4], 1: prompts[1][:-4]})
                p2, half = prompts[2][:-4], len(prompts[2][:-4]) // 2
                logits = []
                for k, piece in enumerate((p2[:half], p2[half:])):
                    steps = {0: [prompts[0][-4 + k]], 1: [prompts[1][-4 + k]]}
                    batch = {**steps, 2: piece} if steps_first else {2: piece, **steps}
                    out = ctx.decode_sequences(batch, partial=(2,) if k == 0 else ())
                    logits += [ctx.logits(out[s]) for s in sorted(out)]
                out = ctx.decode_sequences({2: [prompts[2][-4]]})
                logits.append(ctx.logits(out[2]))
                heads = [None] + list(range(CFG.n_head_kv))
                return np.array(logits), [kept(ctx, s, heads) for s in range(3)], ctx.shared_ubatches()
    finally:
        if old is None:
            os.environ.pop("LLAMA_POLYKV_SHARED_UBATCH")
        else:
            os.environ["LLAMA_POLYKV_SHARED_UBATCH"] = old


@pytest.mark.parametrize("pattern,selection", [("snapkv", "layer"), ("h2o", "head")])
def test_decode_steps_share_a_ubatch_beside_a_prompt(path, prompts, pattern, selection):
    """A batch with one sequence's prompt and two sequences' decode steps, the steps first (llama-server's order):
    the steps share one ubatch, the prompt takes ubatches of its own; kept sets equal those of a ubatch per
    sequence, and of each sequence alone, and the logits agree (f32 cache)."""
    plan = uniform_plan(CFG.n_layer, pattern, BUDGET, selection=selection)
    got = mixed_batches(path, plan, prompts, shared=True)
    want = mixed_batches(path, plan, prompts, shared=False)
    assert got[2] == (2, 4) and want[2] == (0, 0)
    assert got[1] == want[1]
    np.testing.assert_allclose(got[0], want[0], atol=2e-5, rtol=0)
    heads = [None] + list(range(CFG.n_head_kv))
    with Model(path) as model:
        model.set_plan(plan)
        for s, p in enumerate(prompts):
            with model.context(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_UB, flash_attn="off", type_k="f32",
                               type_v="f32") as ctx:
                ctx.decode(p[:-4])
                if s < 2:
                    ctx.decode([p[-4]])
                    ctx.decode([p[-3]])
                else:
                    ctx.decode([p[-4]])
                assert kept(ctx, 0, heads) == got[1][s], s


def test_decode_steps_after_a_prompt_take_ubatches_of_their_own(path, prompts):
    """Decode steps that do not come first in a mixed batch are not shared (a ubatch per sequence, as before)."""
    plan = uniform_plan(CFG.n_layer, "snapkv", BUDGET)
    got = mixed_batches(path, plan, prompts, shared=True, steps_first=False)
    first = mixed_batches(path, plan, prompts, shared=True)
    assert got[2] == (0, 0)
    assert got[1] == first[1]
