"""Kept positions against kvpress, an implementation we did not write.

The other kept-set tests compare the native cache with our own numpy reference (`polykv_cpp.patterns`). Here the
reference is kvpress 0.5.5: its presses compress the prompt of the tiny fp32 Qwen2 of test_polykv_native (4 query
heads over 2 KV heads) in transformers, and the positions of the keys each press keeps, per layer and KV head, must
equal what the native runtime keeps after compressing the same prompt (exact prefill, f32 cache), for every rule
where the two definitions agree, and, for the rules whose decode eviction kvpress has in the same form
(``DecodingPress`` compressing back to the budget after every generated token), after each decode step too:

* StreamingLLM (``StreamingLLMPress``): the first ``n_sink`` and the newest tokens, every head;
* SnapKV per head (``SnapKVPress``): ours with ``window = obs_window`` (kvpress always keeps its observation window)
  and ``pool_kernel`` 1, because kvpress average-pools where we max-pool (the same order only for kernel 1);
* TOVA (``TOVAPress``): kvpress averages the last query's attention over all query heads and keeps one set for
  every KV head: our per-layer TOVA (window 1 = kvpress's newest token);
* K-norm per head (``KnormPress``): ours with ``window`` 0 (kvpress keeps no recent token).

Decode steps are compared for K-norm per head and TOVA: kvpress's SnapKV scores a decode step by a window of
buffered decode queries (ours: the last prompt queries and then each new one), and its StreamingLLM prunes by
position in the cache, which kvpress's top-k reorders after the first compression.

Per-layer SnapKV and K-norm have no kvpress press: their reference is kvpress's scores averaged over the KV heads
(our per-layer rule) with kvpress's top-k. Not compared (definitions differ, see
`polykv_cpp.evaluation.kvpress_check.DIFFERENCES`): H2O (ObservedAttentionPress averages over the queries that
see a key and protects no window), PyramidKV (PyramidKVPress sizes layers differently), pooling kernels above 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from test_polykv_native import CFG, N, P, twin  # noqa: F401

torch = pytest.importorskip("torch")
kvpress = pytest.importorskip("kvpress")

from polykv_cpp.evaluation import kvpress_check as K  # noqa: E402

BUDGET = 17
OBS_WINDOW = 6

#: case -> (our pattern, selection, our parameters, the kvpress press that keeps the same tokens)
CASES = {
    "streamingllm": ("streamingllm", "layer", dict(n_sink=3),
                     lambda r: kvpress.StreamingLLMPress(compression_ratio=r, n_sink=3)),
    "snapkv-head": ("snapkv", "head", dict(n_sink=0, window=OBS_WINDOW, obs_window=OBS_WINDOW, pool_kernel=1),
                    lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=OBS_WINDOW, kernel_size=1)),
    "tova": ("tova", "layer", dict(window=1), lambda r: kvpress.TOVAPress(compression_ratio=r)),
    "knorm-head": ("knorm", "head", dict(window=0), lambda r: kvpress.KnormPress(compression_ratio=r)),
    "snapkv": ("snapkv", "layer", dict(n_sink=0, window=OBS_WINDOW, obs_window=OBS_WINDOW, pool_kernel=1),
               lambda r: HeadMean(compression_ratio=r, inner=kvpress.SnapKVPress(window_size=OBS_WINDOW,
                                                                                 kernel_size=1))),
    "knorm": ("knorm", "layer", dict(window=0), lambda r: HeadMean(compression_ratio=r, inner=kvpress.KnormPress())),
}


@dataclass
class HeadMean(kvpress.ScorerPress):
    """kvpress's scores of ``inner`` averaged over the KV heads: one token set per layer, kept by kvpress's own
    top-k (`ScorerPress.compress`)."""

    inner: kvpress.ScorerPress = field(default_factory=kvpress.KnormPress)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        s = self.inner.score(module, hidden_states, keys, values, attentions, kwargs)
        return s.mean(dim=1, keepdim=True).expand_as(s)


def _match_rows(rows, known_rows, known_positions, new_position) -> list[int]:
    """Position of each of ``rows`` [n, d]: the position of the equal row of ``known_rows``, else ``new_position``
    (at most one row is new)."""
    eq = (rows[:, None, :] == known_rows[None, :, :]).all(dim=-1)
    assert (eq.sum(dim=1) <= 1).all() and (eq.sum(dim=1) == 0).sum() <= 1
    return [known_positions[int(e.float().argmax())] if e.any() else new_position for e in eq]


def kvpress_kept(hf, press, ids) -> list[list[list[int]]]:
    """[layer][KV head] -> sorted positions of the keys ``press`` keeps of prompt ``ids`` (found by matching the
    kept key rows against the full cache's rows: kvpress returns them in score order)."""
    shared = K.SharedPrefill(hf, {"press": press})
    _, full = shared.run(ids)
    out = []
    for (full_k, _), (kept_k, _) in zip(K.full_layers(full), shared.kept["press"]):
        heads = [_match_rows(kept_k[0, h], full_k[0, h], range(len(ids)), None) for h in range(full_k.shape[1])]
        assert all(None not in pos for pos in heads), "every kept key is one position's key"
        out.append([sorted(pos) for pos in heads])
    return out


def kvpress_decode_kept(hf, prefill_press, decode_scorer, ids, steps) -> list[list[list[list[int]]]]:
    """[step][layer][KV head] -> sorted positions kvpress keeps after compressing prompt ``ids`` (step 0) and after
    each teacher-forced token of ``steps``, with its own hooks: ``PrefillDecodingPress`` of ``prefill_press`` and a
    ``DecodingPress`` that compresses ``decode_scorer`` back to ``BUDGET`` after every token."""
    from transformers import DynamicCache

    with torch.no_grad():
        full = DynamicCache()
        hf(input_ids=torch.tensor([ids]), past_key_values=full)
    press = kvpress.PrefillDecodingPress(
        prefilling_press=prefill_press,
        decoding_press=kvpress.DecodingPress(base_press=decode_scorer, compression_interval=1, target_size=BUDGET))
    cache = DynamicCache()
    n_layer, n_kv = len(full.layers), full.layers[0].keys.shape[1]
    with torch.no_grad(), press(hf):
        hf(input_ids=torch.tensor([ids]), past_key_values=cache)
        positions = [[_match_rows(cache.layers[il].keys[0, h], full.layers[il].keys[0, h], range(len(ids)), None)
                      for h in range(n_kv)] for il in range(n_layer)]
        out = [[[sorted(p) for p in layer] for layer in positions]]
        for t, tok in enumerate(steps):
            before = [layer.keys.clone() for layer in cache.layers]
            pos = len(ids) + t
            hf(input_ids=torch.tensor([[tok]]), past_key_values=cache, position_ids=torch.tensor([[pos]]))
            positions = [[_match_rows(cache.layers[il].keys[0, h], before[il][0, h], positions[il][h], pos)
                          for h in range(n_kv)] for il in range(n_layer)]
            out.append([[sorted(p) for p in layer] for layer in positions])
    return out


def native_kept(path, plan, ids, *, flash_attn, steps=()) -> list[list[list[list[int]]]]:
    """[step][layer][KV head] -> positions the native cache keeps after compressing prompt ``ids`` (exact
    prefill; step 0) and after each teacher-forced token of ``steps``."""
    with Model(path) as model:
        model.set_plan(plan, prefill="exact")
        with model.context(n_ctx=128, n_batch=128, n_ubatch=128, flash_attn=flash_attn, type_k="f32",
                           type_v="f32") as ctx:
            ctx.decode(ids)
            ctx.compress_prompt()
            kept = []
            for tok in [None, *steps]:
                if tok is not None:
                    ctx.decode([tok])
                kept.append([[ctx.kept_positions(il, h) for h in range(CFG.n_head_kv)] for il in range(CFG.n_layer)])
            return kept


@pytest.fixture(scope="module")
def tokens():
    """A prompt and decode tokens with no token twice: a repeated token has the same key norm in layer 0 (RoPE
    keeps norms), a tie the two engines break differently."""
    rng = np.random.default_rng(11)
    return [int(t) for t in rng.permutation(np.arange(3, CFG.n_vocab))[:P + N]]


@pytest.fixture(scope="module")
def hf_sdpa(twin):
    hf, _ = twin
    hf.config._attn_implementation = "sdpa"   # test_polykv_native's reference may have switched it to eager
    return hf


@pytest.mark.parametrize("flash_attn", ["off", "on"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kept_positions_equal_kvpress(twin, hf_sdpa, tokens, case, flash_attn):
    pattern, selection, params, make = CASES[case]
    _, path = twin
    ids = tokens[:P]
    plan = plan_mod.uniform_plan(CFG.n_layer, pattern, BUDGET, selection=selection, **params)
    theirs = kvpress_kept(hf_sdpa, make(K.ratio_for(BUDGET, len(ids))), ids)
    ours = native_kept(path, plan, ids, flash_attn=flash_attn)[0]
    for il in range(CFG.n_layer):
        for h in range(CFG.n_head_kv):
            assert len(theirs[il][h]) == BUDGET
            assert ours[il][h] == theirs[il][h], f"layer {il} head {h}"


@pytest.mark.parametrize("flash_attn", ["off", "on"])
@pytest.mark.parametrize("case", ["knorm-head", "tova"])
def test_kept_positions_after_decode_steps_equal_kvpress(twin, hf_sdpa, tokens, case, flash_attn):
    """The cache is evicted for real on both sides: from the second step on, every layer above 0 attends over
    what the layers below kept, so equal sets say the engines evict the same cells, not only score alike."""
    pattern, selection, params, make = CASES[case]
    _, path = twin
    ids, steps = tokens[:P], tokens[P:]
    plan = plan_mod.uniform_plan(CFG.n_layer, pattern, BUDGET, selection=selection, **params)
    theirs = kvpress_decode_kept(hf_sdpa, make(K.ratio_for(BUDGET, len(ids))), make(0.0), ids, steps)
    ours = native_kept(path, plan, ids, flash_attn=flash_attn, steps=steps)
    assert len(ours) == len(theirs) == len(steps) + 1
    for step, (o, t) in enumerate(zip(ours, theirs)):
        for il in range(CFG.n_layer):
            for h in range(CFG.n_head_kv):
                assert len(t[il][h]) == BUDGET
                assert o[il][h] == t[il][h], f"step {step} layer {il} head {h}"
    assert any(P + i in theirs[-1][il][h] for i in range(len(steps)) for il in range(CFG.n_layer)
               for h in range(CFG.n_head_kv)), "some decoded token is kept"
    assert any(P + i not in theirs[i + 1][il][h] for i in range(len(steps)) for il in range(CFG.n_layer)
               for h in range(CFG.n_head_kv)) or case == "tova", "knorm evicts some new token at once"


def test_the_reference_tells_the_rules_apart(hf_sdpa, tokens):
    """kvpress's own sets differ between the rules and, for the per-head presses, between heads: the equalities
    above check selection, not a shared window or a set copied into every head."""
    ids = tokens[:P]
    r = K.ratio_for(BUDGET, len(ids))
    sets = {case: kvpress_kept(hf_sdpa, CASES[case][3](r), ids) for case in ("snapkv-head", "knorm-head", "tova")}
    assert sets["snapkv-head"] != sets["knorm-head"] != sets["tova"]
    for case in ("snapkv-head", "knorm-head"):
        assert any(layer[0] != layer[1] for layer in sets[case]), case
