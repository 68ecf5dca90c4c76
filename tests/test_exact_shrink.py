"""Exact prefill keeps the whole prompt in n_ctx cells only until its compression: then every layer's cache shrinks
to the plan's size (budget + one ubatch) and grows back for a later prompt that needs the room."""

import numpy as np
import pytest

from polykv_cpp.api import Model
from polykv_cpp.plan import uniform_plan
from tiny_models import TinyConfig, write_tiny_gguf

CFG = TinyConfig(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=384)
N_CTX, N_UB = 1024, 64
BUDGET = 512  # holds the first prompt whole: until the second prompt, compression moves cells and evicts nothing


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("shrink") / "tiny.gguf", CFG, seed=5)


@pytest.fixture(scope="module")
def toks():
    rng = np.random.default_rng(7)
    return [int(t) for t in rng.integers(3, CFG.n_vocab, size=800)]


def caps(ctx):
    return [s.capacity for s in ctx.kv_layer_stats()]


@pytest.mark.parametrize("flash_attn", ["on", "off"])  # off: V transposed in the cache
@pytest.mark.parametrize("selection", ["layer", "head"])
def test_exact_caches_shrink_after_compression_and_grow_for_the_next_prompt(path, toks, flash_attn, selection):
    a, b = toks[:100], toks[101:701]
    kw = dict(n_ctx=N_CTX, n_batch=N_UB, n_ubatch=N_UB, flash_attn=flash_attn)
    with Model(path) as model:
        with model.context(**kw) as ctx:
            ctx.decode(a)
            base = [ctx.logits()]
            ctx.decode([toks[100]])
            base.append(ctx.logits())
            ctx.decode(b)
            base.append(ctx.logits())
            ctx.decode([toks[701]])
            base_evicted = ctx.logits()

        model.set_plan(uniform_plan(CFG.n_layer, "snapkv", BUDGET, selection=selection), prefill="exact")
        with model.context(**kw) as ctx:
            full_bytes = ctx.kv_layer_stats()[0].bytes_fullkv
            assert caps(ctx) == [N_CTX] * CFG.n_layer
            ctx.decode(a)
            assert caps(ctx) == [N_CTX] * CFG.n_layer  # the prompt is kept whole until decoding starts
            np.testing.assert_allclose(ctx.logits(), base[0], atol=1e-5, rtol=0)

            ctx.decode([toks[100]])  # compresses (nothing to evict at this budget) and shrinks
            small = caps(ctx)
            assert BUDGET + N_UB <= small[0] < min(N_CTX, BUDGET + N_UB + 256)  # padded to 32 (CPU) or 256 cells
            assert all(c == small[0] for c in small)
            for s in ctx.kv_layer_stats():
                assert s.bytes * N_CTX == s.bytes_fullkv * s.capacity and s.bytes < full_bytes
                assert s.used == 101 and s.n_evicted == 0
            assert ctx.kept_positions(0) == list(range(101))
            # the cells moved with their keys and values: the model sees exactly what FullKV sees
            np.testing.assert_allclose(ctx.logits(), base[1], atol=1e-5, rtol=0)

            state = ctx.state_bytes()
            ctx.decode(b)  # 701 tokens do not fit in the shrunk caches: they grow back for the new prompt
            assert caps(ctx) == [N_CTX] * CFG.n_layer
            np.testing.assert_allclose(ctx.logits(), base[2], atol=1e-5, rtol=0)

            ctx.decode([toks[701]])  # compresses the 701 tokens to the budget, then shrinks again
            assert caps(ctx) == small
            assert [s.used for s in ctx.kv_layer_stats()] == [BUDGET] * CFG.n_layer
            assert np.abs(ctx.logits() - base_evicted).max() > 1e-4  # evicted now

            ctx.clear()
            assert caps(ctx) == [N_CTX] * CFG.n_layer

        # a state saved from the shrunk caches loads into a fresh exact context and goes on identically
        with model.context(**kw) as ctx:
            ctx.load_state_bytes(state)
            assert caps(ctx) == small
            ctx.decode(b)
            np.testing.assert_allclose(ctx.logits(), base[2], atol=1e-5, rtol=0)


def test_state_of_other_cache_sizes_is_still_refused(path, toks):
    with Model(path) as model:
        model.set_plan(uniform_plan(CFG.n_layer, "snapkv", 128), prefill="exact")
        with model.context(n_ctx=N_CTX, n_batch=N_UB, n_ubatch=N_UB) as ctx:
            ctx.decode(toks[:300])
            ctx.decode([toks[300]])
            state = ctx.state_bytes()
        model.set_plan(uniform_plan(CFG.n_layer, "snapkv", 256), prefill="exact")
        with model.context(n_ctx=N_CTX, n_batch=N_UB, n_ubatch=N_UB) as ctx:
            with pytest.raises(Exception, match="different cache sizes"):
                ctx.load_state_bytes(state)
