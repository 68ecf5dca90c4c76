"""The single registry of KV-cache eviction patterns, with a numpy reference of each selection rule.

This module is the *specification* the native (C++) implementation follows and the scorer calibration uses.
``docs/patterns.md`` describes the same rules in prose; the two must agree.

Conventions shared by every pattern
-----------------------------------
* A layer's cache is a list of ``n_key`` tokens in position order (oldest first). Selection returns the
  **sorted indices along that key axis** of the tokens to keep. For a fresh prompt the index is the position.
* ``budget`` is the number of tokens *stored*: sink and window tokens count inside it. When
  ``n_key <= budget`` everything is kept. ``budget`` must be >= 1.
* Attention inputs are **probabilities** after softmax with the causal mask,
  ``attn[..., n_head, n_query, n_key]`` (query heads; a key a query cannot see has probability 0).
  Keys are ``keys[..., n_head_kv, n_key, head_dim]`` (post-RoPE keys as cached; RoPE is a rotation, so
  key norms do not depend on it). Leading ``...`` batch dimensions are allowed everywhere (calibration
  batches layers); they are carried through unchanged.
* **GQA / one set per layer.** The native cache keeps ONE set of token positions per layer, shared by all KV
  heads. Every attention-based score is therefore reduced over *all query heads* of the layer, by the
  arithmetic **mean over query heads of the attention probabilities** (``attn.mean(axis=-3)``), *before*
  any sum over queries and before pooling. (A sum over heads, as in KVCache-Factory, ranks identically.)
  The key-norm score is the mean over KV heads of each head's L2 key norm.
* **Per-head selection** (a plan phase with ``selection: head``, :func:`simulate_heads`): each KV head ``g``
  keeps its own tokens, chosen by the same rule applied to the attention of ``g``'s query heads only (the
  mean over them, ``n_head / n_head_kv`` query heads each, query head ``q`` reading KV head
  ``q // (n_head / n_head_kv)``) and, for K-norm, to ``||k_g||``. Every head keeps ``budget`` tokens; a query
  head attends only to its KV head's tokens. SnapKV, H2O, TOVA and PyramidKV were published per head; the
  layer rule above is the coarser unit that lets all heads share one cache row per token.
* **Adaptive head budgets** (``selection: adaptive``, :func:`select_adaptive`, Ada-KV): the heads' scores as
  above, but the layer's ``n_head_kv x budget`` (head, token) pairs go to the best-scored pairs of the whole
  layer, each head keeping at least its best ``max(1, budget // 5)``.
* **Protected tokens** (sinks, recent windows) get score ``+inf``; they are always kept (the pattern clips
  their number so that it never exceeds the budget).
* **Ties** are broken by keeping the **more recent** token (the larger key index): selection is a stable
  ascending sort of the scores and keeps the last ``budget`` entries.

Phases (see :func:`simulate`)
-----------------------------
* prefill ("exact mode"): the whole prompt is processed with full attention, then each layer's cache is
  compressed ONCE, at the end of the prompt, to its prefill budget with its prefill pattern.
* decode: after each generated token is appended (and attended to), the layer is brought back to
  ``min(size, decode budget)`` tokens with its decode pattern. Decode-time state: the H2O accumulator and
  the SnapKV observation ring buffer, defined in :func:`simulate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

__all__ = [
    "Pattern", "StreamingLLM", "H2O", "SnapKV", "TOVA", "PyramidKV", "FullKV", "KNorm", "KVzip", "ExpectedAttention",
    "QueryStatistics", "query_statistics", "average_rotation",
    "PATTERNS", "PATTERN_NAMES", "get_pattern", "pattern_from_phase_plan", "keep_topk", "pool1d",
    "reduce_heads", "simulate", "simulate_heads", "SimResult", "softmax_causal", "select_adaptive", "adaptive_floor",
    "adaptive_cap", "allocate_prompt", "allocated_decode_budget",
]


# ----------------------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------------------

def keep_topk(scores: np.ndarray, budget: int) -> np.ndarray:
    """Indices (sorted ascending, along the last axis) of the ``budget`` highest scores.

    Ties keep the more recent token (larger index): a stable ascending argsort puts, among equal scores, the
    smaller index first, so the last ``budget`` entries hold the highest scores and, among ties, the larger
    indices. ``+inf`` marks protected tokens. If ``budget >= n`` every index is returned.
    """
    scores = np.asarray(scores)
    n = scores.shape[-1]
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if budget >= n:
        return np.broadcast_to(np.arange(n), scores.shape).copy()
    order = np.argsort(scores, axis=-1, kind="stable")
    kept = order[..., n - budget:]
    return np.sort(kept, axis=-1)


def reduce_heads(attn: np.ndarray) -> np.ndarray:
    """``[..., n_head, n_query, n_key] -> [..., n_query, n_key]``: mean over query heads."""
    attn = np.asarray(attn, dtype=np.float64)
    if attn.ndim < 3:
        raise ValueError("attention must be [..., n_head, n_query, n_key]")
    return attn.mean(axis=-3)


def pool1d(x: np.ndarray, kernel: int, mode: str = "max", shift: int = 0) -> np.ndarray:
    """1-D pooling along the last axis, stride 1, 'same' output length, odd ``kernel``.

    ``max``: maximum over ``x[i-k//2 .. i+k//2]`` clipped to the valid range (torch ``max_pool1d`` with
    ``padding=k//2``, i.e. padding never wins). ``avg``: sum over the same neighbourhood with zero padding,
    divided by ``kernel`` (torch ``avg_pool1d`` with ``count_include_pad=True``). ``kernel == 1`` is identity.
    ``shift`` s (``|s| <= k//2``) moves every window s places back: ``x[i-k//2-s .. i+k//2-s]``, so a high score
    reaches ``k//2 + s`` positions after its token and ``k//2 - s`` before it (the value that follows a key).
    """
    x = np.asarray(x, dtype=np.float64)
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pool_kernel must be a positive odd integer, got {kernel}")
    r = kernel // 2
    if abs(shift) > r:
        raise ValueError(f"pool_shift must be within +-pool_kernel // 2 = {r}, got {shift}")
    if kernel == 1 or x.shape[-1] == 0:
        return x.copy()
    n = x.shape[-1]
    pad_val = -np.inf if mode == "max" else 0.0
    if mode not in ("max", "avg"):
        raise ValueError(f"pooling must be 'max' or 'avg', got {mode!r}")
    m = r + abs(shift)
    pad = np.full(x.shape[:-1] + (m,), pad_val)
    xp = np.concatenate([pad, x, pad], axis=-1)
    start = abs(shift) - shift
    win = np.lib.stride_tricks.sliding_window_view(xp, kernel, axis=-1)[..., start:start + n, :]
    return win.max(axis=-1) if mode == "max" else win.sum(axis=-1) / kernel


def softmax_causal(logits: np.ndarray, q_pos: np.ndarray | None = None,
                   k_pos: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis of attention logits ``[..., n_query, n_key]`` with the causal mask
    ``k_pos <= q_pos`` (positions default to ``arange``, queries aligned to the END of the keys)."""
    logits = np.asarray(logits, dtype=np.float64)
    nq, nk = logits.shape[-2:]
    if k_pos is None:
        k_pos = np.arange(nk)
    if q_pos is None:
        q_pos = np.arange(nk - nq, nk)
    mask = np.asarray(k_pos)[None, :] <= np.asarray(q_pos)[:, None]
    z = np.where(mask, logits, -np.inf)
    m = z.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)
    s = e.sum(axis=-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def _protect(scores: np.ndarray, budget: int, n_sink: int | None, window: int | None) -> np.ndarray:
    """Set +inf on the last ``w = min(window, budget)`` and the first ``min(n_sink, budget - w)`` keys."""
    n = scores.shape[-1]
    w = min(window or 0, budget, n)
    s = min(n_sink or 0, budget - w, n - w)
    if w > 0:
        scores[..., n - w:] = np.inf
    if s > 0:
        scores[..., :s] = np.inf
    return scores


# ----------------------------------------------------------------------------------------------------------
# patterns
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pattern:
    """Base class. Subclasses define ``scores()``; ``select()`` is ``keep_topk(scores(), budget)``."""

    name: ClassVar[str] = ""
    needs_attention: ClassVar[bool] = False
    needs_keys: ClassVar[bool] = False
    #: which attention rows the rule reads: "none", "all" (every query), "window" (last obs_window), "last",
    #: "reconstruction" (the queries of a KVzip reconstruction pass)
    query_rows: ClassVar[str] = "none"
    #: scores only a prompt (KVzip): not usable as a decode pattern
    prefill_only: ClassVar[bool] = False

    def scores(self, budget: int, n_key: int, *, attn: np.ndarray | None = None,
               keys: np.ndarray | None = None, acc: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def select(self, budget: int, *, attn: np.ndarray | None = None, keys: np.ndarray | None = None,
               acc: np.ndarray | None = None, n_key: int | None = None, stats: Any = None) -> np.ndarray:
        """Sorted kept indices along the key axis (shape ``[..., min(budget, n_key)]``)."""
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        n_key = _infer_n_key(n_key, attn, keys, acc)
        if self.needs_attention and attn is None and acc is None:
            raise ValueError(f"pattern {self.name} needs attention probabilities")
        if self.needs_keys and keys is None:
            raise ValueError(f"pattern {self.name} needs keys")
        if n_key <= budget:
            batch = _batch_shape(attn, keys, acc, self)
            return np.broadcast_to(np.arange(n_key), batch + (n_key,)).copy()
        extra = {} if stats is None else {"stats": stats}  # Expected Attention's query statistics
        return keep_topk(self.scores(budget, n_key, attn=attn, keys=keys, acc=acc, **extra), budget)

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _infer_n_key(n_key, attn, keys, acc) -> int:
    if n_key is not None:
        return int(n_key)
    if attn is not None:
        return int(np.shape(attn)[-1])
    if keys is not None:
        return int(np.shape(keys)[-2])
    if acc is not None:
        return int(np.shape(acc)[-1])
    raise ValueError("cannot infer n_key: pass n_key, attn, keys or acc")


def _batch_shape(attn, keys, acc, pat) -> tuple:
    if acc is not None:
        return tuple(np.shape(acc)[:-1])
    if attn is not None:
        return tuple(np.shape(attn)[:-3])
    if keys is not None:
        return tuple(np.shape(keys)[:-3])
    return ()


@dataclass(frozen=True)
class StreamingLLM(Pattern):
    """StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks").

    Keep the first ``s = min(n_sink, budget - 1)`` tokens (attention sinks) and the most recent
    ``budget - s`` tokens. Positional only: needs no attention and no keys, and is the cheapest rule.
    ``window`` is accepted for symmetry with the plan format and ignored: the recent part is always the
    rest of the budget. Limits: anything in the middle of the context is lost regardless of relevance.
    """

    n_sink: int = 4
    window: int | None = None
    name: ClassVar[str] = "streamingllm"

    def scores(self, budget, n_key, *, attn=None, keys=None, acc=None):
        s = min(self.n_sink, budget - 1)
        batch = _batch_shape(attn, keys, acc, self)
        # recency as score: index order; sinks are protected
        sc = np.broadcast_to(np.arange(n_key, dtype=np.float64), batch + (n_key,)).copy()
        if s > 0:
            sc[..., :s] = np.inf
        return sc


@dataclass(frozen=True)
class H2O(Pattern):
    """H2O, heavy-hitter oracle (Zhang et al. 2023).

    Score = attention *received*, accumulated: the sum over queries of the head-mean attention probability.
    Keep the last ``w = min(window, budget)`` tokens and the first ``min(n_sink, budget - w)`` tokens plus
    the highest scores among the rest (``n_sink`` defaults to 0, as in the paper).
    Prefill (exact mode): the sum runs over all prompt queries (column sums of the causal attention).
    Decode: the accumulator ``acc`` (see :func:`simulate`) is passed instead. The paper splits the budget
    half heavy / half recent; we use a fixed window like KVCache-Factory (set ``window = budget // 2`` for
    the paper's split). Limits: column sums favour early tokens (they are seen by more queries); scores are
    query-agnostic.
    """

    window: int = 32
    n_sink: int = 0
    name: ClassVar[str] = "h2o"
    needs_attention: ClassVar[bool] = True
    query_rows: ClassVar[str] = "all"

    def scores(self, budget, n_key, *, attn=None, keys=None, acc=None):
        if acc is not None:
            sc = np.array(acc, dtype=np.float64, copy=True)
        else:
            sc = reduce_heads(attn).sum(axis=-2)
        return _protect(sc, budget, self.n_sink, self.window)


@dataclass(frozen=True)
class SnapKV(Pattern):
    """SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

    Observation window = the last ``obs_window`` queries. Score of every key = sum over the window's
    queries of the head-mean attention probability, then 1-D pooling over positions (``pool_kernel``,
    ``pooling`` max or avg, see :func:`pool1d`; ``pool_shift`` > 0 spreads a score further after its token than
    before it) computed over all keys of the cache (window keys included in the pooling input). Protected: the last ``w = min(max(window or 0, obs_window), budget)`` keys (the
    window itself; ``window`` as in the plan format, ``reserved = n_sink + max(window, obs_window)``) and the
    first ``min(n_sink, budget - w)`` keys; the best other keys fill the budget. Decode: the rows are the observation ring buffer of
    :func:`simulate`. Limits: query-aware by construction (strong when the question ends the prompt, weaker
    when it comes after compression); heads are reduced before pooling (the paper pools per head).
    """

    obs_window: int = 32
    pool_kernel: int = 7
    pool_shift: int = 0
    pooling: str = "max"
    window: int | None = 32
    n_sink: int = 0
    name: ClassVar[str] = "snapkv"
    needs_attention: ClassVar[bool] = True
    query_rows: ClassVar[str] = "window"

    def scores(self, budget, n_key, *, attn=None, keys=None, acc=None):
        rows = reduce_heads(attn)
        rows = rows[..., -self.obs_window:, :] if self.obs_window > 0 else rows[..., :0, :]
        sc = rows.sum(axis=-2)
        sc = pool1d(sc, self.pool_kernel, self.pooling, self.pool_shift)
        return _protect(sc, budget, self.n_sink, max(self.window or 0, self.obs_window))


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
    Funneling").

    Token selection is exactly SnapKV's (same parameters). What makes it PyramidKV is the budget rule: the
    total is spread linearly over depth, more in lower layers (the plan's ``pyramid`` budget rule,
    KVCache-Factory's ``min = (B - w) / beta``). At equal budget ``pyramidkv`` and ``snapkv`` keep the same
    tokens. Limits: the pyramid shape is fixed, not measured.
    """

    beta: int = 20
    name: ClassVar[str] = "pyramidkv"


@dataclass(frozen=True)
class TOVA(Pattern):
    """TOVA, token omission via attention (Oren et al. 2024, "Transformers are Multi-State RNNs").

    Score = attention probability from the current LAST query, averaged over heads; keep the ``budget``
    highest. ``window`` = 1 by default: the newest token (the current query's own key) is always kept
    (the paper has no window; it keeps the newest token almost always anyway, and the plan format's
    default is 1); ``n_sink`` = 0. Limits: one query's view, so a token irrelevant to the current step is
    dropped for good.
    """

    window: int = 1
    n_sink: int = 0
    name: ClassVar[str] = "tova"
    needs_attention: ClassVar[bool] = True
    query_rows: ClassVar[str] = "last"

    def scores(self, budget, n_key, *, attn=None, keys=None, acc=None):
        return _protect(reduce_heads(attn)[..., -1, :].copy(), budget, self.n_sink, self.window)


@dataclass(frozen=True)
class FullKV(Pattern):
    """FullKV: keep every token. The budget is ignored; the layer is charged its full size against the
    total budget (it is not free)."""

    name: ClassVar[str] = "fullkv"

    def select(self, budget, *, attn=None, keys=None, acc=None, n_key=None):
        n_key = _infer_n_key(n_key, attn, keys, acc)
        batch = _batch_shape(attn, keys, acc, self)
        return np.broadcast_to(np.arange(n_key), batch + (n_key,)).copy()

    def scores(self, budget, n_key, *, attn=None, keys=None, acc=None):
        batch = _batch_shape(attn, keys, acc, self)
        return np.full(batch + (n_key,), np.inf)


@dataclass(frozen=True)
class KNorm(Pattern):
    """K-norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression").

    Keep the ``budget`` keys with the LOWEST L2 norm; a token's norm is the mean over KV heads of
    ``||k_h||_2``. Score = ``-norm``. Free to compute (no attention needed). ``n_sink`` = 0 and ``window`` = 1
    (the newest token is kept; the plan format's default) by default. Limits: a heuristic correlation with attention; weak in layers where low-norm
    keys are not the attended ones (the paper skips the first layers).
    """

    n_sink: int = 0
    window: int = 1
    name: ClassVar[str] = "knorm"
    needs_keys: ClassVar[bool] = True

    def scores(self, budget, n_key, *, attn=None, keys=None, acc=None):
        k = np.asarray(keys, dtype=np.float64)
        sc = -np.linalg.norm(k, axis=-1).mean(axis=-2)
        return _protect(sc, budget, self.n_sink, self.window)


@dataclass(frozen=True)
class KVzip(Pattern):
    """KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction").

    Query-agnostic: after the prompt, the model reads a "repeat the previous context" instruction followed by
    the prompt's own tokens again (in chunks, each after the prompt at the same positions; a chunk after the
    first starts with the 8 tokens before it); a prompt token's score is the LARGEST probability any
    reconstruction query of any query head gives it (per KV head: of its own query heads; the paper and
    kvpress take the same max over queries and grouped heads), then the ``budget`` highest are
    kept, with ``n_sink`` (4, as kvpress's KVzipPress) and ``window`` (0) protected; ``pool_kernel`` > 1 first takes
    the maximum over neighbouring positions, as SnapKV's pooling (1, none, as the paper). ``attn`` here is the reconstruction
    queries' attention ``[..., n_head, n_recon, n_key]`` over the prompt keys (softmax over the prompt and the
    reconstruction tokens before it; :func:`simulate` takes it as ``recon_attn``). The reconstruction tokens
    never stay in the cache. Prefill only: a decode phase cannot use it. Tokens that arrive after the pass
    (a question fed after the context) are unscored and kept first. Differences from kvpress: budgets are
    the plan's, per layer, unless the plan re-splits them per prompt (``"allocation": "prompt"``,
    :func:`allocate_prompt`: kvpress's default ranks every (layer, head, token) against one threshold; ours
    keeps ``b_min`` per layer first), and the softmax spans the whole prompt, not only the chunk.
    Limits: one extra pass over the prompt (about one more prefill); without it (chunked prefill) a kvzip
    layer keeps its sinks and its most recent tokens.
    """

    n_sink: int = 4
    window: int = 0
    pool_kernel: int = 1
    pool_shift: int = 0
    name: ClassVar[str] = "kvzip"
    needs_attention: ClassVar[bool] = True
    query_rows: ClassVar[str] = "reconstruction"
    prefill_only: ClassVar[bool] = True

    def scores(self, budget, n_key, *, attn=None, keys=None, acc=None):
        attn = np.asarray(attn, dtype=np.float64)
        if attn.ndim < 3:
            raise ValueError("attention must be [..., n_head, n_query, n_key]")
        sc = pool1d(attn.max(axis=(-3, -2)), self.pool_kernel, shift=self.pool_shift)
        return _protect(sc, budget, self.n_sink, self.window)


@dataclass(frozen=True)
class QueryStatistics:
    """What Expected Attention reads besides the keys: the moments of a layer's pre-RoPE queries and the values.

    ``mean`` ``[n_head, d]`` and ``cov`` ``[n_head, d, d]`` (population covariance) of the queries at positions
    ``>= n_sink`` (:func:`query_statistics`), ``rotation`` ``[d, d]`` the RoPE rotation averaged over the future
    positions (:func:`average_rotation`), ``values`` ``[n_head_kv, n_key, dv]`` and ``scale`` the attention scale
    (``1 / sqrt(d)`` for most models)."""

    mean: np.ndarray
    cov: np.ndarray
    rotation: np.ndarray
    values: np.ndarray
    scale: float

    def head(self, g: int, n_group: int) -> "QueryStatistics":
        """The statistics KV head ``g`` reads: its ``n_group`` query heads and its values."""
        q = slice(g * n_group, (g + 1) * n_group)
        return QueryStatistics(self.mean[q], self.cov[q], self.rotation, np.asarray(self.values)[g:g + 1], self.scale)


def query_statistics(queries: np.ndarray, positions: np.ndarray, n_sink: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean ``[n_head, d]`` and population covariance ``[n_head, d, d]`` of pre-RoPE ``queries``
    ``[n_head, n_q, d]`` over the queries whose position is ``>= n_sink`` (kvpress leaves the first ``n_sink`` out)."""
    q = np.asarray(queries, dtype=np.float64)[:, np.asarray(positions) >= n_sink]
    mean = q.mean(axis=1)
    c = q - mean[:, None, :]
    return mean, np.einsum("hni,hnj->hij", c, c) / q.shape[1]


def average_rotation(d: int, start: int, *, n_future: int = 512, n_rot: int | None = None, freq_base: float = 10000.0,
                     freq_scale: float = 1.0, neox: bool = True) -> np.ndarray:
    """The RoPE rotation of a ``d``-dim head averaged over positions ``start .. start + n_future - 1``: pair ``i``
    (dims ``i, i + n_rot/2`` for NeoX/HF, ``2i, 2i+1`` for the original layout) turns by ``theta_i * t`` with
    ``theta_i = freq_scale * freq_base ** (-2i / n_rot)``; dims beyond ``n_rot`` do not turn."""
    n_rot = d if n_rot is None else n_rot
    half = n_rot // 2
    R = np.eye(d)
    t = np.arange(start, start + n_future, dtype=np.float64)
    for i in range(half):
        theta = freq_scale * freq_base ** (-2.0 * i / n_rot)
        c, s = np.cos(theta * t).mean(), np.sin(theta * t).mean()
        a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
        R[a, a], R[a, b], R[b, a], R[b, b] = c, -s, s, c
    return R


@dataclass(frozen=True)
class ExpectedAttention(Pattern):
    """Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention
    from Future Queries Distribution"; kvpress ``ExpectedAttentionPress``).

    Query-agnostic and without an extra pass: the future queries of a layer are modelled as Gaussian, with the
    mean ``mu`` and covariance ``S`` of the pre-RoPE queries seen so far (positions ``>= n_sink``), rotated by the
    RoPE rotation ``R`` averaged over the next 512 positions. A key ``k`` (as cached, after RoPE) then expects the
    logit ``scale * (R mu).k + scale^2 / 2 * k^T (R S R^T) k`` from query head ``h``; a softmax over the keys
    beyond the sinks, averaged over a KV head's query heads and multiplied by ``||v||``, is the KV head's score.
    The ``budget`` highest are kept, the first ``n_sink`` (4, as kvpress) protected. One set per layer ranks by
    the mean of the KV heads' scores; ``pool_kernel`` > 1 then takes the maximum over neighbouring positions, as
    SnapKV's pooling (1, none, as the paper and kvpress), so the tokens after a high-scored one (a value after its
    key) rank with it. ``stats`` is a :class:`QueryStatistics`; no leading batch dimensions. Prefill only (the runtime scores
    a prompt when it compresses it: after every ubatch in chunked prefill, from the statistics so far).
    Limits: models with plain RoPE only (no YaRN or frequency factors); the Gaussian model of the queries is
    weakest where attention is sharp (retrieval heads); with chunked prefill, tokens are scored by the queries
    of the prompt so far, not of the whole prompt.
    """

    n_sink: int = 4
    window: int = 0
    pool_kernel: int = 1
    pool_shift: int = 0
    name: ClassVar[str] = "expected_attention"
    needs_keys: ClassVar[bool] = True
    query_rows: ClassVar[str] = "statistics"
    prefill_only: ClassVar[bool] = True

    def head_scores(self, keys: np.ndarray, stats: QueryStatistics) -> np.ndarray:
        """``[n_head_kv, n_key]`` scores of each KV head (0 for the sinks), before protection."""
        k = np.asarray(keys, dtype=np.float64)
        n_head_kv, n_key, _ = k.shape
        n_head = stats.mean.shape[0]
        rk = n_head // n_head_kv
        R = stats.rotation
        m = stats.scale * stats.mean @ R.T                                  # [n_head, d]
        M = 0.5 * stats.scale ** 2 * np.einsum("ab,hbc,dc->had", R, stats.cov, R)
        kh = np.repeat(k, rk, axis=0)                                        # [n_head, n_key, d]
        logits = np.einsum("hd,hnd->hn", m, kh) + np.einsum("hna,hab,hnb->hn", kh, M, kh)
        s = min(self.n_sink, n_key)
        out = np.zeros((n_head_kv, n_key))
        if s < n_key:
            z = logits[:, s:] - logits[:, s:].max(axis=-1, keepdims=True)
            p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
            vnorm = np.linalg.norm(np.asarray(stats.values, dtype=np.float64), axis=-1)[:, s:]
            out[:, s:] = p.reshape(n_head_kv, rk, -1).mean(axis=1) * vnorm
        return out

    def scores(self, budget, n_key, *, attn=None, keys=None, acc=None, stats=None):
        if stats is None:
            raise ValueError("expected_attention needs stats (QueryStatistics)")
        sc = pool1d(self.head_scores(keys, stats).mean(axis=0), self.pool_kernel, shift=self.pool_shift)
        return _protect(sc, budget, self.n_sink, self.window)


#: name -> pattern class. Order is the tie-break order when two patterns score the same in calibration.
PATTERNS: dict[str, type[Pattern]] = {
    c.name: c for c in (StreamingLLM, H2O, SnapKV, TOVA, PyramidKV, FullKV, KNorm, KVzip, ExpectedAttention)
}
PATTERN_NAMES: tuple[str, ...] = tuple(PATTERNS)


def get_pattern(name: str, *, ignore_unknown: bool = False, **params: Any) -> Pattern:
    """Instantiate a pattern by registry name. ``None`` parameter values mean "the default".

    Unknown parameters raise ``ValueError`` unless ``ignore_unknown`` (used when a plan entry carries
    parameters of other patterns, e.g. ``obs_window`` for streamingllm).
    """
    if name not in PATTERNS:
        raise ValueError(f"unknown pattern {name!r}; known: {', '.join(PATTERNS)}")
    cls = PATTERNS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in params.items():
        if v is None:
            continue
        if k not in fields:
            if ignore_unknown:
                continue
            raise ValueError(f"pattern {name} has no parameter {k!r} (has: {', '.join(sorted(fields))})")
        kw[k] = v
    return cls(**kw)


def pattern_from_phase_plan(phase: Any) -> Pattern:
    """Build the pattern of a plan's ``PhasePlan`` (fields ``pattern``, ``n_sink``, ``window``,
    ``obs_window``, ``pool_kernel``, ``pool_shift``; the ones the pattern does not use are ignored).

    The plan format's ``None`` means "not used", not "default": ``window=None`` -> no recent window (0;
    StreamingLLM ignores it), ``pool_kernel=None`` -> no pooling (1). ``n_sink`` and ``obs_window`` are taken
    as given."""
    name = phase.pattern
    params: dict[str, Any] = {"n_sink": getattr(phase, "n_sink", 0) or 0,
                              "obs_window": getattr(phase, "obs_window", None)}
    w = getattr(phase, "window", None)
    if name != "streamingllm":
        params["window"] = 0 if w is None else w
    pk = getattr(phase, "pool_kernel", None)
    params["pool_kernel"] = 1 if pk is None else pk
    params["pool_shift"] = getattr(phase, "pool_shift", None) or 0
    return get_pattern(name, ignore_unknown=True, **params)


# ----------------------------------------------------------------------------------------------------------
# prefill-then-decode reference
# ----------------------------------------------------------------------------------------------------------

@dataclass
class SimResult:
    """Outcome of :func:`simulate` (positions are absolute token positions)."""

    prefill_kept: np.ndarray                 # positions kept after the prompt's compression
    decode_kept: list[np.ndarray]            # positions kept after each decode step
    decode_rows: list[np.ndarray]            # [n_head, n_cand] attention of each decode query (renormalised)
    decode_cand: list[np.ndarray]            # the positions that decode query attended to


def _as_pattern(p: Pattern | str | None) -> Pattern | None:
    if p is None or isinstance(p, Pattern):
        return p
    return get_pattern(p)


def _decode_step(logits: np.ndarray, t: int, kept: np.ndarray, acc: np.ndarray, ring: np.ndarray, w_obs: int):
    """Token ``t`` joins the cache ``kept``: its attention row over ``cand = kept + [t]`` (``[n_head, n_cand]``),
    the H2O accumulator and the SnapKV ring buffer with its head-mean added (see :func:`simulate`, step 3)."""
    cand = np.append(kept, t)
    row = softmax_causal(logits[:, t:t + 1, cand], q_pos=np.array([t]), k_pos=cand)[:, 0, :]
    m = row.mean(axis=0)
    acc = np.append(acc, 0.0) + m
    if w_obs > 0:
        ring = np.concatenate([np.concatenate([ring, np.zeros((ring.shape[0], 1))], axis=1), m[None]], axis=0)[-w_obs:]
    return cand, row, acc, ring


def _decode_inputs(dec: Pattern, cand: np.ndarray, *, row: np.ndarray, acc: np.ndarray, ring: np.ndarray,
                   keys: np.ndarray | None) -> dict[str, Any]:
    """What the decode pattern reads about the candidates ``cand`` (``keys``: ``[n_head_kv, T, d]``, for K-norm):
    keyword arguments of its ``select``/``scores``."""
    if dec.query_rows == "window":
        return {"attn": ring[None]}
    if dec.query_rows == "all":
        return {"acc": acc}
    if dec.query_rows == "last":
        return {"attn": row[:, None, :]}
    if dec.needs_keys:
        if keys is None:
            raise ValueError(f"{dec.name} needs keys")
        return {"keys": keys[:, cand]}
    return {}


def simulate(logits: np.ndarray, n_prompt: int, *, prefill: Pattern | str | None, prefill_budget: int,
             decode: Pattern | str | None, decode_budget: int,
             keys: np.ndarray | None = None, recon_attn: np.ndarray | None = None,
             stats: QueryStatistics | None = None, evict_every: int = 1) -> SimResult:
    """Reference of one layer's cache through a prompt of ``n_prompt`` tokens and then
    ``T - n_prompt`` generated tokens.

    ``logits``: attention logits ``[n_head, T, T]`` (``q.k * scale``) for the full sequence; query ``t`` only
    ever sees keys ``<= t``; attention of a decode query is the softmax of its logits over the keys it can
    still see (renormalised over the kept set). ``keys``: ``[n_head_kv, T, head_dim]`` (for ``knorm``).
    ``recon_attn``: ``[n_head, n_recon, n_prompt]``, the attention of a KVzip reconstruction pass's queries
    on the prompt keys (for a ``kvzip`` prefill). ``stats``: the prompt's :class:`QueryStatistics` (for an
    ``expected_attention`` prefill).

    1. Prefill (exact mode): full causal attention ``A = softmax_causal(logits[:, :P, :P])``. If ``prefill``
       is None or ``P <= prefill_budget`` nothing is evicted; otherwise ``prefill.select(prefill_budget,
       attn=A, keys=keys[:, :P])``.
    2. Decode state initialised from the prefill (whatever the patterns):
       * ``acc[k]`` (H2O) = sum over all prompt queries of the head-mean of ``A[:, q, k]``, for kept ``k``;
       * ring buffer (SnapKV/PyramidKV) = the head-mean rows of the last ``obs_window`` prompt queries,
         restricted to the kept keys.
    3. Decode step for token ``t``: the cache becomes ``cand = kept + [t]``; query ``t`` attends over
       ``cand`` (row ``a_t``, head-mean ``m_t``); then ``acc[cand] += m_t`` (the new token starts at 0 before
       this add); ``m_t`` is pushed into the ring buffer (older rows get 0 for the new key; the oldest row
       beyond ``obs_window`` is dropped); if ``len(cand) > decode_budget`` the decode pattern selects
       ``decode_budget`` of ``cand`` with ``attn = a_t[:, None, :]`` (TOVA), ``acc`` (H2O), the ring buffer
       (SnapKV), or the keys (K-norm); positional rules need nothing. Evicted tokens leave the accumulator and
       ring buffer. ``decode=None`` never evicts. With ``evict_every`` k > 1 (the plan key) the selection runs
       only once ``len(cand) >= decode_budget + k``; in between the cache grows and every token is scored.
    """
    logits = np.asarray(logits, dtype=np.float64)
    n_head, T, T2 = logits.shape
    if T != T2:
        raise ValueError("logits must be [n_head, T, T]")
    P = int(n_prompt)
    if not 1 <= P <= T:
        raise ValueError("n_prompt must be in [1, T]")
    pre = _as_pattern(prefill)
    dec = _as_pattern(decode)
    if keys is not None:
        keys = np.asarray(keys, dtype=np.float64)

    A = softmax_causal(logits[:, :P, :P])
    if dec is not None and dec.prefill_only:
        raise ValueError(f"{dec.name} is a prefill pattern only")
    if pre is None or P <= prefill_budget:
        kept = np.arange(P)
    elif pre.query_rows == "reconstruction":
        if recon_attn is None:
            raise ValueError(f"{pre.name} needs the reconstruction pass's attention (recon_attn)")
        kept = pre.select(prefill_budget, attn=np.asarray(recon_attn, dtype=np.float64)[:, :, :P])
    elif pre.query_rows == "statistics":
        if stats is None or keys is None:
            raise ValueError(f"{pre.name} needs the prompt's query statistics (stats) and keys")
        kept = pre.select(prefill_budget, keys=keys[:, :P], stats=dataclasses.replace(
            stats, values=np.asarray(stats.values)[:, :P]))
    else:
        kept = pre.select(prefill_budget, attn=A, keys=None if keys is None else keys[:, :P])
    m_prompt = A.mean(axis=0)                                   # [P, P]
    acc = m_prompt.sum(axis=0)[kept]
    w_obs = getattr(dec, "obs_window", 0) if dec is not None else 0
    ring = m_prompt[P - min(w_obs, P):, :][:, kept] if w_obs > 0 else np.zeros((0, len(kept)))

    res = SimResult(prefill_kept=kept.copy(), decode_kept=[], decode_rows=[], decode_cand=[])
    for t in range(P, T):
        cand, row, acc, ring = _decode_step(logits, t, kept, acc, ring, w_obs)
        res.decode_rows.append(row)
        res.decode_cand.append(cand)
        if dec is not None and len(cand) >= decode_budget + evict_every:
            idx = dec.select(decode_budget, n_key=len(cand),
                             **_decode_inputs(dec, cand, row=row, acc=acc, ring=ring, keys=keys))
            cand = cand[idx]
            acc = acc[idx]
            if w_obs > 0:
                ring = ring[:, idx]
        kept = cand
        res.decode_kept.append(kept.copy())
    return res


def simulate_heads(logits: np.ndarray, n_prompt: int, n_head_kv: int, *, prefill: Pattern | str | None,
                   prefill_budget: int, decode: Pattern | str | None, decode_budget: int,
                   keys: np.ndarray | None = None, recon_attn: np.ndarray | None = None,
                   stats: QueryStatistics | None = None, adaptive: bool = False,
                   evict_every: int = 1) -> list[SimResult]:
    """Per-head selection: :func:`simulate` for every KV head on its own, one :class:`SimResult` per KV head.

    ``logits`` are ``[n_head, T, T]`` over query heads and ``keys`` ``[n_head_kv, T, head_dim]``. KV head ``g``
    is simulated with the logits of its query heads ``g*r .. (g+1)*r - 1`` (``r = n_head // n_head_kv``, the
    GQA grouping of llama.cpp and transformers) and its own keys: its scores are the mean over those query
    heads, its decode queries attend over its own kept tokens only. Each head keeps ``budget`` tokens, unless
    ``adaptive``: then every compression splits the layer's ``n_head_kv x budget`` between the heads by
    :func:`select_adaptive` (Ada-KV), the same steps otherwise. ``evict_every``: as in :func:`simulate` per
    head; adaptive, the decode selection runs once the heads hold ``n_head_kv x (decode_budget + k)`` together.
    """
    if adaptive:
        return _simulate_adaptive(logits, n_prompt, n_head_kv, prefill=_as_pattern(prefill),
                                  prefill_budget=prefill_budget, decode=_as_pattern(decode),
                                  decode_budget=decode_budget, keys=keys, recon_attn=recon_attn, stats=stats,
                                  evict_every=evict_every)
    logits = np.asarray(logits, dtype=np.float64)
    n_head = logits.shape[0]
    if n_head_kv < 1 or n_head % n_head_kv:
        raise ValueError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    r = n_head // n_head_kv
    return [simulate(logits[g * r:(g + 1) * r], n_prompt, prefill=prefill, prefill_budget=prefill_budget,
                     decode=decode, decode_budget=decode_budget,
                     keys=None if keys is None else np.asarray(keys)[g:g + 1],
                     recon_attn=None if recon_attn is None else np.asarray(recon_attn)[g * r:(g + 1) * r],
                     stats=None if stats is None else stats.head(g, r), evict_every=evict_every)
            for g in range(n_head_kv)]


def adaptive_floor(budget: int) -> int:
    """Tokens every KV head keeps at least under adaptive selection: ``budget // 5`` (Ada-KV's safeguard of 20%,
    kvpress's ``AdaKVPress(alpha_safeguard=0.2)``), and at least one (a head without keys would attend to nothing)."""
    return max(1, budget // 5)


def adaptive_cap(budget: int, n_head_kv: int) -> int:
    """The most tokens one KV head holds under adaptive selection: what the other heads' floors leave of the
    layer's ``n_head_kv x budget``. With flash attention off the native cache allocates this many rows (plus one
    ubatch) for the layer; with it on the heads share the layer's (cell, head) slots and it allocates ``budget``."""
    return n_head_kv * budget - (n_head_kv - 1) * adaptive_floor(budget)


def select_adaptive(scores: list[np.ndarray], budget: int) -> list[np.ndarray]:
    """Ada-KV's split of a layer's budget across its KV heads (Feng et al. 2024, "Ada-KV: Optimizing KV Cache
    Eviction by Adaptive Budget Allocation for Efficient LLM Inference"; kvpress ``AdaKVPress``).

    ``scores[h]``: head ``h``'s scores of its own tokens (oldest first, protected tokens ``+inf``, as a pattern's
    ``scores(budget, ...)``). The layer keeps ``len(scores) x budget`` (head, token) pairs: each head first its own
    best :func:`adaptive_floor` (by :func:`keep_topk`'s order), then the best-scored remaining pairs of every head,
    no head holding more than :func:`adaptive_cap`. Ties: the pairs are listed head by head, oldest first, and a
    stable ascending sort is taken from the top (the later head, then the more recent token, wins). If the heads
    hold at most that many pairs (and none more than the cap) everything is kept. Returns each head's kept indices,
    sorted. Limits: scores of different heads are compared as they are (attention probabilities of that head's
    query heads, or key norms), as Ada-KV does; the floor and cap are fixed.
    """
    scores = [np.asarray(s, dtype=np.float64) for s in scores]
    nh = len(scores)
    if budget < 1 or nh < 1:
        raise ValueError("select_adaptive needs a budget >= 1 and at least one head")
    n = [len(s) for s in scores]
    left = nh * budget
    cap = adaptive_cap(budget, nh)
    if sum(n) <= left and max(n) <= cap:
        return [np.arange(k) for k in n]
    keep = [np.zeros(k, dtype=bool) for k in n]
    count = []
    for h, s in enumerate(scores):
        f = min(adaptive_floor(budget), n[h])
        keep[h][np.argsort(s, kind="stable")[n[h] - f:]] = True
        count.append(f)
    left -= sum(count)
    flat = np.concatenate(scores)
    head_of = np.repeat(np.arange(nh), n)
    index_of = np.concatenate([np.arange(k) for k in n])
    for j in np.argsort(flat, kind="stable")[::-1]:
        if left == 0:
            break
        h, i = head_of[j], index_of[j]
        if keep[h][i] or count[h] >= cap:
            continue
        keep[h][i] = True
        count[h] += 1
        left -= 1
    return [np.flatnonzero(k) for k in keep]


def relative_scores(s: np.ndarray) -> np.ndarray:
    """A token set's scores relative to its typical token (``"allocation": "prompt_median"``): the finite ones
    divided by the median of the finite ones (the mean of the two middle ones for an even count, as the runtime
    computes it); protected tokens (``+inf``) stay. Unchanged when that median is not positive (key norms,
    ``-norm``; a set of zeros). Within a set the order is the same; across layers a token counts by how far it
    stands above its own layer's typical token, not by the layer's scale."""
    s = np.asarray(s, dtype=np.float64)
    fin = np.isfinite(s)
    v = np.sort(s[fin])
    n = len(v)
    if n == 0:
        return s
    med = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
    if not med > 0:
        return s
    out = s.copy()
    out[fin] = s[fin] / med
    return out


def allocate_prompt(scores: list[list[np.ndarray]], budgets: list[int], n_head_kv: list[int], b_min: int,
                    caps: list[int] | None = None, relative: bool = False) -> list[int]:
    """A plan's ``"allocation": "prompt"``: the budgets of the scored layers re-split for one prompt by their scores
    across the whole model, KVzip's non-uniform allocation (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache
    Compression with Context Reconstruction"; kvpress ``KVzipPress(layerwise=False)``), with a floor per layer.

    ``scores[l]``: layer ``l``'s token sets as its pattern ranks them (protected tokens ``+inf``, oldest first,
    as ``Pattern.scores(budget, ...)`` at the plan's budget): one array when the layer keeps one set for all its
    ``n_head_kv[l]`` heads (each token counts ``n_head_kv[l]`` (head, token) pairs), or one per KV head (each
    token counts one pair). The pool is the layers' ``sum(budgets[l] * n_head_kv[l])`` pairs. Every set first
    keeps its best ``min(b_min, len)`` tokens; the best-scored of the other entries of every layer then fill the
    rest of the pool (an entry that no longer fits, in the pool or under the layer's ``caps[l]`` tokens per KV
    head, is passed over: chunked prefill caps a layer at what it holds when the prompt ends, its budget x the
    prefill slack; exact prefill has no cap). Ties: the entries are listed layer by layer,
    set by set, oldest first, and a stable ascending sort is taken from the top. Returns each layer's new
    budget, its pairs // ``n_head_kv[l]``: per KV head each head then keeps that many of its own (or, adaptive,
    the layer splits them by :func:`select_adaptive`). Limits: scores of different layers compare as they are
    (for KVzip the largest attention probability a reconstruction query gives a token, as the paper); a
    pattern whose scores are not comparable across layers (key norms, H2O's sums over a prompt) allocates by
    the same rule without that meaning. One pool: in a plan whose scored layers use several prefill patterns, the
    runtime calls it once per pattern, on that pattern's layers (scores of different patterns are not on one scale).
    ``relative=True`` (``"allocation": "prompt_median"``): every set's scores are first divided by the set's median
    (:func:`relative_scores`), so that a layer whose attention is flat (query-aware SnapKV's first layers) no
    longer takes the pool with its many middling scores from the peaked layers that hold the needles
    (docs/results.md, "Per-prompt budgets relative to each layer's median"). Not in the KVzip paper.
    """
    if not (len(scores) == len(budgets) == len(n_head_kv)):
        raise ValueError("allocate_prompt needs one score list, budget and head count per layer")
    pool = sum(int(b) * int(h) for b, h in zip(budgets, n_head_kv))
    taken = [0] * len(scores)
    rest_score, rest_layer = [], []
    for l, sets in enumerate(scores):
        if len(sets) not in (1, n_head_kv[l]):
            raise ValueError(f"layer {l}: one token set or one per KV head ({n_head_kv[l]}), got {len(sets)}")
        unit = n_head_kv[l] if len(sets) == 1 else 1
        for s in sets:
            s = relative_scores(s) if relative else np.asarray(s, dtype=np.float64)
            f = min(b_min, len(s))
            top = np.zeros(len(s), dtype=bool)
            top[np.argsort(s, kind="stable")[len(s) - f:]] = True
            taken[l] += f * unit
            rest_score.append(s[~top])
            rest_layer.append(np.full(int((~top).sum()), l))
    left = pool - sum(taken)
    flat = np.concatenate(rest_score) if rest_score else np.zeros(0)
    layer_of = np.concatenate(rest_layer) if rest_layer else np.zeros(0, dtype=int)
    for j in np.argsort(flat, kind="stable")[::-1]:
        if left <= 0:
            break
        l = int(layer_of[j])
        unit = n_head_kv[l] if len(scores[l]) == 1 else 1
        if unit > left or (caps is not None and taken[l] + unit > caps[l] * n_head_kv[l]):
            continue
        taken[l] += unit
        left -= unit
    return [t // h for t, h in zip(taken, n_head_kv)]


def allocated_decode_budget(plan_prefill: int, plan_decode: int | None, prefill: int) -> int | None:
    """A layer's decode budget after :func:`allocate_prompt` gave its prefill ``prefill`` tokens instead of the
    plan's ``plan_prefill``: the same when the plan gives both phases one budget, else scaled (at least 1); None
    (FullKV decode) stays None."""
    if plan_decode is None:
        return None
    if plan_decode == plan_prefill:
        return prefill
    return max(1, plan_decode * prefill // plan_prefill)


def _simulate_adaptive(logits, n_prompt, n_head_kv, *, prefill, prefill_budget, decode, decode_budget, keys,
                       recon_attn, stats, evict_every: int = 1) -> list[SimResult]:
    """:func:`simulate_heads` with ``adaptive``: :func:`simulate`'s steps per KV head, every compression by
    :func:`select_adaptive` over all heads at once."""
    logits = np.asarray(logits, dtype=np.float64)
    n_head, T, _ = logits.shape
    if n_head_kv < 1 or n_head % n_head_kv:
        raise ValueError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    if decode is not None and decode.prefill_only:
        raise ValueError(f"{decode.name} is a prefill pattern only")
    r = n_head // n_head_kv
    P = int(n_prompt)
    heads = range(n_head_kv)
    q_of = [slice(g * r, (g + 1) * r) for g in heads]
    keys = None if keys is None else np.asarray(keys, dtype=np.float64)
    A = [softmax_causal(logits[q_of[g], :P, :P]) for g in heads]

    def prefill_scores(g: int) -> np.ndarray:
        if prefill.query_rows == "reconstruction":
            if recon_attn is None:
                raise ValueError(f"{prefill.name} needs the reconstruction pass's attention (recon_attn)")
            return prefill.scores(prefill_budget, P, attn=np.asarray(recon_attn, dtype=np.float64)[q_of[g], :, :P])
        if prefill.query_rows == "statistics":
            if stats is None or keys is None:
                raise ValueError(f"{prefill.name} needs the prompt's query statistics (stats) and keys")
            sg = stats.head(g, r)
            return prefill.scores(prefill_budget, P, keys=keys[g:g + 1, :P],
                                  stats=dataclasses.replace(sg, values=np.asarray(sg.values)[:, :P]))
        return prefill.scores(prefill_budget, P, attn=A[g], keys=None if keys is None else keys[g:g + 1, :P])

    if prefill is None or prefill.name == "fullkv":
        kept = [np.arange(P) for _ in heads]
    else:
        kept = select_adaptive([prefill_scores(g) for g in heads], prefill_budget)
    m_prompt = [a.mean(axis=0) for a in A]
    acc = [m_prompt[g].sum(axis=0)[kept[g]] for g in heads]
    w_obs = getattr(decode, "obs_window", 0) if decode is not None else 0
    ring = [m_prompt[g][P - min(w_obs, P):, :][:, kept[g]] if w_obs > 0 else np.zeros((0, len(kept[g])))
            for g in heads]
    res = [SimResult(prefill_kept=kept[g].copy(), decode_kept=[], decode_rows=[], decode_cand=[]) for g in heads]
    for t in range(P, T):
        cand, rows = [], []
        for g in heads:
            c, row, acc[g], ring[g] = _decode_step(logits[q_of[g]], t, kept[g], acc[g], ring[g], w_obs)
            res[g].decode_rows.append(row)
            res[g].decode_cand.append(c)
            cand.append(c)
            rows.append(row)
        due = evict_every <= 1 or sum(len(c) for c in cand) >= n_head_kv * (decode_budget + evict_every)
        if decode is not None and decode.name != "fullkv" and due:
            if decode.query_rows == "none" and not decode.needs_keys:
                raise ValueError(f"{decode.name} selects the same tokens in every head: not adaptive")
            sc = [decode.scores(decode_budget, len(cand[g]), **_decode_inputs(
                decode, cand[g], row=rows[g], acc=acc[g], ring=ring[g], keys=None if keys is None else keys[g:g + 1]))
                for g in heads]
            idx = select_adaptive(sc, decode_budget)
            for g in heads:
                cand[g] = cand[g][idx[g]]
                acc[g] = acc[g][idx[g]]
                if w_obs > 0:
                    ring[g] = ring[g][:, idx[g]]
        for g in heads:
            kept[g] = cand[g]
            res[g].decode_kept.append(kept[g].copy())
    return res
