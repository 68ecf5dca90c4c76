"""Tests of the eviction-pattern registry (numpy reference of each selection rule)."""

from __future__ import annotations

import numpy as np
import pytest

from polykv_cpp import patterns as P


def one_hot_rows(n_head, rows):
    """attention [n_head, n_query, n_key] from a list of rows (same for every head)."""
    a = np.asarray(rows, dtype=np.float64)
    return np.broadcast_to(a, (n_head,) + a.shape).copy()


def test_registry_names_match_plan_known_patterns():
    assert P.PATTERN_NAMES == ("streamingllm", "h2o", "snapkv", "tova", "pyramidkv", "fullkv", "knorm", "kvzip",
                               "expected_attention")
    try:
        from polykv_cpp import plan
    except ImportError:  # plan.py not there yet
        pytest.skip("polykv_cpp.plan not available")
    assert set(P.PATTERN_NAMES) == set(plan.KNOWN_PATTERNS)


def test_get_pattern_params_and_errors():
    p = P.get_pattern("snapkv", obs_window=8, pool_kernel=3)
    assert isinstance(p, P.SnapKV) and p.obs_window == 8 and p.pool_kernel == 3
    assert P.get_pattern("h2o", window=None).window == 32          # None = default
    with pytest.raises(ValueError):
        P.get_pattern("nope")
    with pytest.raises(ValueError):
        P.get_pattern("tova", obs_window=3)
    assert isinstance(P.get_pattern("tova", ignore_unknown=True, obs_window=3), P.TOVA)
    for name, cls in P.PATTERNS.items():
        assert cls.name == name
        assert cls.__doc__ and len(cls.__doc__) > 80
    assert P.PATTERNS["snapkv"].needs_attention and not P.PATTERNS["streamingllm"].needs_attention
    assert P.PATTERNS["knorm"].needs_keys and not P.PATTERNS["knorm"].needs_attention


def test_keep_topk_ties_keep_recent_and_sorted():
    sc = np.array([1.0, 1.0, 1.0, 1.0])
    assert P.keep_topk(sc, 2).tolist() == [2, 3]
    sc = np.array([5.0, 1.0, 5.0, 0.0, 5.0])
    assert P.keep_topk(sc, 2).tolist() == [2, 4]
    assert P.keep_topk(sc, 10).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        P.keep_topk(sc, 0)
    # batched
    b = np.array([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]])
    assert P.keep_topk(b, 1).tolist() == [[0], [2]]


def test_streamingllm_sinks_and_recent():
    p = P.StreamingLLM(n_sink=2)
    assert p.select(5, n_key=10).tolist() == [0, 1, 7, 8, 9]
    assert p.select(2, n_key=10).tolist() == [0, 9]            # sinks clipped to budget-1
    assert p.select(1, n_key=10).tolist() == [9]
    assert p.select(20, n_key=10).tolist() == list(range(10))
    # attention is ignored even if given
    attn = np.random.default_rng(0).random((2, 3, 10))
    assert p.select(5, attn=attn).tolist() == [0, 1, 7, 8, 9]


def test_h2o_column_sums_plus_window():
    n = 8
    # every query puts its mass on key 1 (heavy hitter) except itself; key 3 second
    rows = []
    for q in range(n):
        r = np.zeros(n)
        r[q] = 0.1
        if q >= 1:
            r[1] += 0.6
        if q >= 3:
            r[3] += 0.3
        rows.append(r / r.sum())
    attn = one_hot_rows(2, rows)
    p = P.H2O(window=2)
    assert p.select(4, attn=attn).tolist() == [1, 3, 6, 7]
    # accumulated scores override attention (decode mode)
    acc = np.array([9, 0, 0, 0, 8, 0, 0, 0], dtype=float)
    assert p.select(4, acc=acc).tolist() == [0, 4, 6, 7]
    # window clipped to the budget
    assert P.H2O(window=10).select(3, attn=attn).tolist() == [5, 6, 7]


def test_snapkv_window_and_pooling():
    n = 12
    attn = np.zeros((1, n, n))
    # last 3 queries (window) all look at key 4
    for q in range(n - 3, n):
        attn[0, q, 4] = 0.5
        attn[0, q, q] = 0.5
    # without pooling: keep 4 + window 9,10,11
    p1 = P.SnapKV(window=None, obs_window=3, pool_kernel=1)
    assert p1.select(4, attn=attn).tolist() == [4, 9, 10, 11]
    # max pooling with kernel 3 spreads key 4's score to 3 and 5; ties keep the more recent -> 5 before 3
    p3 = P.SnapKV(window=None, obs_window=3, pool_kernel=3)
    assert p3.select(5, attn=attn).tolist() == [4, 5, 9, 10, 11]
    assert p3.select(6, attn=attn).tolist() == [3, 4, 5, 9, 10, 11]
    # queries outside the window are ignored: a heavy column from early queries does not count
    attn2 = attn.copy()
    attn2[0, 2, 0] = 1.0
    assert p1.select(4, attn=attn2).tolist() == [4, 9, 10, 11]
    # heads are averaged: key 6 gets 0.9 in head 0, key 7 gets 0.5 in both -> 0.45 vs 0.5 -> keep 7
    attn3 = np.zeros((2, n, n))
    attn3[0, -1, 6] = 0.9
    attn3[0, -1, 7] = 0.1
    attn3[1, -1, 7] = 0.9
    attn3[1, -1, 8] = 0.1
    assert P.SnapKV(window=None, obs_window=1, pool_kernel=1).select(2, attn=attn3).tolist() == [7, 11]


def test_pool1d_matches_torch_semantics():
    x = np.array([0.0, 1.0, 0.0, 0.0, 3.0])
    assert P.pool1d(x, 3, "max").tolist() == [1.0, 1.0, 1.0, 3.0, 3.0]
    np.testing.assert_allclose(P.pool1d(x, 3, "avg"), [1 / 3, 1 / 3, 1 / 3, 1.0, 1.0])
    with pytest.raises(ValueError):
        P.pool1d(x, 2)
    try:
        import torch
    except ImportError:
        return
    rng = np.random.default_rng(1)
    y = rng.random((3, 17))
    for k in (3, 5, 7):
        t = torch.tensor(y)[:, None, :]
        mx = torch.nn.functional.max_pool1d(t, k, 1, k // 2)[:, 0].numpy()
        av = torch.nn.functional.avg_pool1d(t, k, 1, k // 2)[:, 0].numpy()
        np.testing.assert_allclose(P.pool1d(y, k, "max"), mx)
        np.testing.assert_allclose(P.pool1d(y, k, "avg"), av, rtol=1e-12)


@pytest.mark.parametrize("kernel,shift", [(3, 1), (3, -1), (7, 3), (7, -2), (23, 8), (23, 11)])
def test_shifted_pooling_takes_the_window_before_each_token(kernel, shift):
    """``shift`` s: position i takes the best of ``x[i-k//2-s .. i+k//2-s]`` (clipped), so a high score reaches
    ``k//2 + s`` tokens after its own and ``k//2 - s`` before it."""
    rng = np.random.default_rng([kernel, shift + kernel])
    y = rng.random((2, 31))
    r = kernel // 2
    want = np.array([[max(row[max(0, i - r - shift):max(0, min(31, i + r - shift + 1))], default=-np.inf)
                      for i in range(31)] for row in y])
    np.testing.assert_array_equal(P.pool1d(y, kernel, "max", shift), want)
    spike = np.zeros(60)
    spike[20] = 1.0
    reached = np.flatnonzero(P.pool1d(spike, kernel, "max", shift))
    assert (reached.min(), reached.max()) == (20 - (r - shift), 20 + r + shift)
    with pytest.raises(ValueError):
        P.pool1d(y, kernel, "max", r + 1)


def test_tova_last_query_head_mean():
    n = 6
    attn = np.zeros((2, 3, n))
    attn[:, 0, 0] = 1.0                 # earlier queries are ignored
    attn[0, -1] = [0.0, 0.5, 0.0, 0.2, 0.0, 0.3]
    attn[1, -1] = [0.0, 0.0, 0.6, 0.2, 0.0, 0.2]
    # head means: [0, .25, .3, .2, 0, .25] -> top 3 = 2, then tie .25 between 1 and 5 -> 5 (recent), then 1
    assert P.TOVA().select(2, attn=attn).tolist() == [2, 5]
    assert P.TOVA().select(3, attn=attn).tolist() == [1, 2, 5]


def test_knorm_keeps_low_norm_keys():
    keys = np.zeros((2, 6, 4))
    norms = np.array([5.0, 1.0, 3.0, 0.5, 4.0, 2.0])
    keys[0, :, 0] = norms
    keys[1, :, 1] = norms * 2           # mean over kv heads keeps the same order
    assert P.KNorm().select(3, keys=keys).tolist() == [1, 3, 5]
    assert P.KNorm(n_sink=1, window=1).select(3, keys=keys).tolist() == [0, 3, 5]
    # RoPE-like rotation of pairs leaves the choice unchanged
    th = 0.7
    rot = keys.copy()
    rot[..., 0] = np.cos(th) * keys[..., 0] - np.sin(th) * keys[..., 1]
    rot[..., 1] = np.sin(th) * keys[..., 0] + np.cos(th) * keys[..., 1]
    assert P.KNorm().select(3, keys=rot).tolist() == [1, 3, 5]


def test_fullkv_keeps_everything():
    assert P.FullKV().select(2, n_key=7).tolist() == list(range(7))


def test_batched_selection_equals_per_item():
    rng = np.random.default_rng(7)
    attn = P.softmax_causal(rng.normal(size=(3, 4, 30, 30)))       # 3 "layers"
    keys = rng.normal(size=(3, 2, 30, 8))
    for name in P.PATTERN_NAMES:
        p = P.get_pattern(name)
        if p.query_rows == "statistics":
            continue  # Expected Attention takes one layer's statistics (no batch dimensions)
        batched = p.select(10, attn=attn, keys=keys)
        for i in range(3):
            assert batched[i].tolist() == p.select(10, attn=attn[i], keys=keys[i]).tolist(), name


def test_needs_inputs_errors():
    with pytest.raises(ValueError):
        P.SnapKV().select(4, n_key=10)
    with pytest.raises(ValueError):
        P.KNorm().select(4, n_key=10)


def test_softmax_causal():
    a = P.softmax_causal(np.zeros((2, 4, 4)))
    np.testing.assert_allclose(a[0], np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None])
    a = P.softmax_causal(np.zeros((1, 2, 5)))          # queries aligned to the end
    np.testing.assert_allclose(a[0, 0], [0.25] * 4 + [0])


def _sim_logits(T, n_head=2, seed=0):
    return np.random.default_rng(seed).normal(size=(n_head, T, T))


def test_simulate_streamingllm_decode_is_sinks_plus_recent():
    T, Pn = 20, 8
    r = P.simulate(_sim_logits(T), Pn, prefill="streamingllm", prefill_budget=6,
                   decode=P.StreamingLLM(n_sink=2), decode_budget=5)
    assert r.prefill_kept.tolist() == [0, 1, 2, 3, 6, 7]   # n_sink=4 in prefill
    assert len(r.decode_kept) == T - Pn
    for t, kept in zip(range(Pn, T), r.decode_kept):
        assert len(kept) == 5
        assert kept.tolist() == [0, 1, t - 2, t - 1, t]


def test_simulate_budget_bookkeeping_and_rows():
    T, Pn = 16, 10
    logits = _sim_logits(T, seed=2)
    keys = np.random.default_rng(4).normal(size=(1, T, 4))
    recon = P.softmax_causal(_sim_logits(Pn + 5, seed=3))[:, Pn:, :Pn]   # 5 reconstruction queries
    rng = np.random.default_rng(5)
    q = rng.normal(size=(2, Pn, 4))
    mean, cov = P.query_statistics(q, np.arange(Pn), 4)
    stats = P.QueryStatistics(mean, cov, P.average_rotation(4, Pn, n_future=8), rng.normal(size=(1, T, 4)), 0.5)
    for name in P.PATTERN_NAMES:
        dec = "h2o" if P.PATTERNS[name].prefill_only else name
        r = P.simulate(logits, Pn, prefill=name, prefill_budget=4, decode=dec, decode_budget=6, keys=keys,
                       recon_attn=recon, stats=stats)
        if name == "fullkv":
            assert len(r.prefill_kept) == Pn and len(r.decode_kept[-1]) == T
            continue
        assert len(r.prefill_kept) == 4
        sizes = [len(k) for k in r.decode_kept]
        assert sizes == [5, 6, 6, 6, 6, 6]                # grows to the decode budget, then stays
        for row, cand in zip(r.decode_rows, r.decode_cand):
            np.testing.assert_allclose(row.sum(axis=-1), 1.0)
            assert row.shape == (2, len(cand))
    # no compression at all
    r = P.simulate(logits, Pn, prefill=None, prefill_budget=4, decode=None, decode_budget=4)
    assert r.decode_kept[-1].tolist() == list(range(T))


def test_simulate_h2o_accumulates_over_decode_steps():
    # 1 head; prompt of 4 tokens with uniform attention; decode queries all attend to key 2 strongly
    T, Pn = 8, 4
    logits = np.zeros((1, T, T))
    logits[0, Pn:, 2] = 6.0
    r = P.simulate(logits, Pn, prefill=None, prefill_budget=4, decode=P.H2O(window=1), decode_budget=3)
    # step t=4: cand [0..4]; prefill column sums favour 0 (seen by 4 queries), then 2 gets the big decode mass
    assert r.decode_kept[0].tolist() == [0, 2, 4]
    # later: key 2 keeps winning, key 0 keeps its prefill mass; the newest token is the window
    assert r.decode_kept[-1].tolist() == [0, 2, 7]


def test_simulate_tova_follows_current_query():
    T, Pn = 7, 4
    logits = np.zeros((1, T, T))
    logits[0, 4, 1] = 5.0     # query 4 likes key 1
    logits[0, 5, 3] = 5.0     # query 5 likes key 3
    logits[0, 6, 3] = 5.0
    r = P.simulate(logits, Pn, prefill=None, prefill_budget=9, decode="tova", decode_budget=2)
    # t=4: cand 0..4, top2 by head-mean row: key 1 (big), then tie among 0,2,3,4 -> most recent 4
    assert r.decode_kept[0].tolist() == [1, 4]
    # t=5: cand [1,4,5]; query 5 cannot see key 3 (evicted): uniform -> keep most recent two
    assert r.decode_kept[1].tolist() == [4, 5]


def test_simulate_snapkv_ring_buffer():
    T, Pn = 10, 6
    logits = np.zeros((1, T, T))
    logits[0, 4:6, 0] = 8.0   # the last two prompt queries look at key 0
    r = P.simulate(logits, Pn, prefill=None, prefill_budget=99,
                   decode=P.SnapKV(window=None, obs_window=2, pool_kernel=1), decode_budget=3)
    # t=6: ring = rows of queries 5 and 6; key 0 gets ~1 from query 5 -> kept with window 5,6
    assert r.decode_kept[0].tolist() == [0, 5, 6]
    # t=7: query 5 left the ring (= queries 6,7, both uniform over what they saw): keys 0 and 5 both score
    # 1/7 + 1/4 -> tie -> the more recent key 5 is kept
    assert r.decode_kept[1].tolist() == [5, 6, 7]
    # with a 3-query ring, query 5's row is still there at t=7, so key 0 survives
    r3 = P.simulate(logits, Pn, prefill=None, prefill_budget=99,
                    decode=P.SnapKV(window=None, obs_window=3, pool_kernel=1), decode_budget=4)
    assert r3.decode_kept[1].tolist() == [0, 5, 6, 7]


def test_defaults_agree_with_plan_format_and_phase_plan_mapping():
    plan = pytest.importorskip("polykv_cpp.plan")
    for name, params in plan.DEFAULT_PARAMS.items():
        pat = P.get_pattern(name)
        for k, v in params.items():
            if hasattr(pat, k) and v is not None:
                assert getattr(pat, k) == v, (name, k)
    pp = plan.PhasePlan("snapkv", budget=64, n_sink=0, window=None, obs_window=16, pool_kernel=None)
    pat = P.pattern_from_phase_plan(pp)
    assert isinstance(pat, P.SnapKV) and pat.obs_window == 16 and pat.pool_kernel == 1 and not pat.window
    pat = P.pattern_from_phase_plan(plan.PhasePlan("streamingllm", budget=64, n_sink=4))
    assert isinstance(pat, P.StreamingLLM) and pat.n_sink == 4
    pat = P.pattern_from_phase_plan(plan.PhasePlan("tova", budget=64, window=None))
    assert pat.window == 0


def test_sinks_and_windows_inside_budget():
    rng = np.random.default_rng(5)
    attn = P.softmax_causal(rng.normal(size=(2, 50, 50)))
    keys = rng.normal(size=(1, 50, 4))
    for pat in (P.H2O(window=8, n_sink=2), P.SnapKV(obs_window=8, n_sink=2, window=12), P.TOVA(n_sink=2, window=3),
                P.KNorm(n_sink=2, window=3), P.StreamingLLM(n_sink=2)):
        kept = pat.select(20, attn=attn, keys=keys)
        assert len(kept) == 20
        assert {0, 1, 47, 48, 49} <= set(kept.tolist()), pat
    # windows larger than the budget are clipped to it
    assert P.SnapKV(window=None, obs_window=8).select(5, attn=attn).tolist() == [45, 46, 47, 48, 49]


def test_kvzip_keeps_the_tokens_reconstruction_attends_most():
    """KVzip's score is the largest head-mean attention any reconstruction query gives a token (not the sum):
    a token one query looks at hard beats a token every query looks at a little."""
    n_key = 8
    attn = np.full((2, 3, n_key), 0.05)
    attn[:, 0, 2] = 0.9            # one reconstruction query looks hard at token 2
    attn[:, :, 5] = 0.3            # every query looks a little at token 5 (sum 0.9, max 0.3)
    attn[0, 1, 6] = 0.8            # head 0 only: head mean 0.425
    kept = P.KVzip(n_sink=1).select(3, attn=attn)
    assert kept.tolist() == [0, 2, 6]          # the sink, then max 0.9 and 0.425 (token 5's 0.3 loses)
    assert P.H2O(window=0).select(2, attn=attn).tolist() == [2, 5]
    with pytest.raises(ValueError, match="recon_attn"):
        P.simulate(_sim_logits(10), 8, prefill="kvzip", prefill_budget=4, decode=None, decode_budget=4)
    with pytest.raises(ValueError, match="prefill pattern only"):
        P.simulate(_sim_logits(10), 8, prefill="snapkv", prefill_budget=4, decode="kvzip", decode_budget=4)


def test_expected_attention_reference_by_hand():
    """One query head, one KV head, d = 2, no rotation (n_rot 0): the expected logit of key k is
    scale * mu.k + scale^2 / 2 * k^T S k; a softmax beyond the sinks, times ||v||; sinks protected."""
    q = np.array([[[1.0, 0.0], [1.0, 2.0], [3.0, 2.0], [-1.0, 4.0]]])     # 4 queries; the first is a sink
    mean, cov = P.query_statistics(q, np.arange(4), 1)
    np.testing.assert_allclose(mean, [[1.0, 8.0 / 3]])
    np.testing.assert_allclose(cov[0], np.cov(q[0, 1:].T, bias=True))
    keys = np.array([[[5.0, 5.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    values = np.array([[[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 3.0]]])
    st = P.QueryStatistics(mean, cov, P.average_rotation(2, 4, n_rot=0), values, 0.5)
    logit = np.array([0.5 * mean[0] @ k + 0.125 * k @ cov[0] @ k for k in keys[0, 1:]])
    p = np.exp(logit - logit.max()) / np.exp(logit - logit.max()).sum()
    want = p * np.array([2.0, 1.0, 3.0])
    got = P.ExpectedAttention(n_sink=1).head_scores(keys, st)
    np.testing.assert_allclose(got[0], [0.0, *want])
    kept = P.ExpectedAttention(n_sink=1).select(2, keys=keys, stats=st)
    assert kept.tolist() == sorted([0, 1 + int(np.argmax(want))])


def test_average_rotation_turns_pairs_by_the_mean_angle():
    R = P.average_rotation(4, 10, n_future=3, freq_base=100.0)      # NeoX pairs (0, 2) and (1, 3)
    t = np.arange(10, 13)
    for i, (a, b) in enumerate([(0, 2), (1, 3)]):
        th = 100.0 ** (-2 * i / 4)
        c, s = np.cos(th * t).mean(), np.sin(th * t).mean()
        np.testing.assert_allclose(R[[a, a, b, b], [a, b, a, b]], [c, -s, s, c])
    R2 = P.average_rotation(4, 0, n_future=1, neox=False)              # position 0: no turn at all
    np.testing.assert_allclose(R2, np.eye(4))
