"""The phase of a ubatch made explicit (`llama_polykv_set_phase`, `Context.decode(..., phase=)`): a prompt whose last
ubatch is one token stays a prompt, and several generated tokens decoded at once (speculative decoding) are one
decode step, not a new prompt. Without it the runtime guesses from the ubatch's size and logits, as the stock tools
get it."""

import numpy as np
import pytest

from polykv_cpp._native import ffi
from polykv_cpp.api import Model, NativeError
from polykv_cpp.plan import uniform_plan
from tiny_models import TinyConfig, write_tiny_gguf

CFG = TinyConfig(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=384)
N_CTX, N_UB = 512, 32
BUDGET = 24


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("phase") / "tiny.gguf", CFG, seed=11)


@pytest.fixture(scope="module")
def toks():
    rng = np.random.default_rng(3)
    return [int(t) for t in rng.integers(3, CFG.n_vocab, size=200)]


def kept(ctx, per_head: bool) -> list[list[int]]:
    heads = range(CFG.n_head_kv) if per_head else [None]
    return [ctx.kept_positions(il, h) for il in range(CFG.n_layer) for h in heads]


@pytest.mark.parametrize("selection", ["layer", "head"])
def test_a_prompt_whose_last_ubatch_is_one_token_stays_a_prompt(path, toks, selection):
    prompt = toks[:2 * N_UB + 1]  # two full ubatches and one token
    plan = uniform_plan(CFG.n_layer, "snapkv", BUDGET, decode_pattern="fullkv", selection=selection, window=8,
                        obs_window=8)
    per_head = selection == "head"
    with Model(path) as model:
        model.set_plan(plan, prefill="exact")
        # the reference: the whole prompt in one ubatch, compressed once
        with model.context(n_ctx=N_CTX, n_batch=128, n_ubatch=128) as ctx:
            ctx.decode(prompt)
            ctx.compress_prompt()
            want = kept(ctx, per_head)
        assert all(len(k) == BUDGET for k in want)

        kw = dict(n_ctx=N_CTX, n_batch=N_UB, n_ubatch=N_UB)
        with model.context(**kw) as ctx:  # guessed: the one token follows prompt ubatches without logits: prompt
            ctx.decode(prompt)
            assert [(s.used, s.n_evicted) for s in ctx.kv_layer_stats()] == [(len(prompt), 0)] * CFG.n_layer
            ctx.compress_prompt()
            assert kept(ctx, per_head) == want

        with model.context(**kw) as ctx:  # the guess fails when the caller took logits before the token
            ctx.decode(prompt[:-1])
            ctx.decode(prompt[-1:])  # taken for the first decode step: compressed before the prompt's last token
            assert all(s.n_evicted > 0 for s in ctx.kv_layer_stats())
            assert all(len(k) == BUDGET + 1 and k[-1] == len(prompt) - 1 for k in kept(ctx, per_head))

        with model.context(**kw) as ctx:
            ctx.decode(prompt, phase="prefill")
            assert [(s.used, s.n_evicted) for s in ctx.kv_layer_stats()] == [(len(prompt), 0)] * CFG.n_layer
            ctx.compress_prompt()
            assert kept(ctx, per_head) == want

        with model.context(**kw) as ctx:  # generate_tokens says which tokens are the prompt
            out = list(ctx.generate_tokens(prompt, max_tokens=2))
            assert len(out) == 2
            assert kept(ctx, per_head) == [k + [len(prompt)] for k in want]  # the first answer token on top


def test_several_generated_tokens_at_once_are_one_decode_step(path, toks):
    plan = uniform_plan(CFG.n_layer, "streamingllm", BUDGET)
    n_sink = plan.layers[0].prefill.n_sink
    prompt, drafts = toks[:100], toks[100:104]
    n = len(prompt) + len(drafts)
    kw = dict(n_ctx=N_CTX, n_batch=N_UB, n_ubatch=N_UB)
    with Model(path) as model:
        model.set_plan(plan, prefill="exact")
        with model.context(**kw) as ctx:
            ctx.decode(prompt, phase="prefill")
            ctx.compress_prompt()
            small = [s.capacity for s in ctx.kv_layer_stats()]
            assert all(c < N_CTX for c in small)
            ctx.decode(drafts, phase="decode")  # four tokens verified at once: evicted to the decode budget
            assert [s.capacity for s in ctx.kv_layer_stats()] == small
            want = list(range(n_sink)) + list(range(n - (BUDGET - n_sink), n))
            assert [ctx.kept_positions(il) for il in range(CFG.n_layer)] == [want] * CFG.n_layer
            logits_decode = ctx.logits()

        with model.context(**kw) as ctx:  # guessed: four tokens are a next prompt, kept whole until it is compressed
            ctx.decode(prompt, phase="prefill")
            ctx.compress_prompt()
            ctx.decode(drafts)
            assert [s.used for s in ctx.kv_layer_stats()] == [BUDGET + len(drafts)] * CFG.n_layer
            # the drafts' logits see the same cache either way: eviction comes after the step
            np.testing.assert_allclose(ctx.logits(), logits_decode, atol=1e-5, rtol=0)


def test_phase_errors(path):
    with Model(path) as model:
        with model.context(n_ctx=64) as ctx:
            with pytest.raises(NativeError, match="no PolyKV plan"):
                ctx.set_phase("decode")
            ctx.decode([5, 6, 7], phase="decode")  # without a plan the phase means nothing and is not set
        model.set_plan(uniform_plan(CFG.n_layer, "snapkv", BUDGET, window=8, obs_window=8))
        with model.context(n_ctx=64) as ctx:
            with pytest.raises(ValueError, match="expected 'prefill', 'decode' or None"):
                ctx.set_phase("prompt")
            assert ctx._lib.llama_polykv_set_phase(ctx.ptr, 2) == -1
            assert "expected -1 (auto), 0 (prefill) or 1 (decode)" in ffi.string(ctx._lib.llama_polykv_last_error()).decode()
