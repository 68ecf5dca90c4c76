"""PolyKV plan format v1: which eviction pattern and how many tokens every layer keeps, per phase.

A plan is a versioned JSON document (see ``docs/plan-format.md``). It travels either as a sidecar ``.json``
file or inside a GGUF as two metadata keys:

* ``polykv.plan``    STRING, the plan's JSON text;
* ``polykv.version`` UINT32, the plan format version (1);
* ``polykv.plan_query_agnostic`` STRING (optional), a second plan for prompts compressed before their question
  exists (``run --question``, a chat history): the tools that know the question comes later use it, stock
  llama.cpp tools and every other path use ``polykv.plan``.

(llama.cpp's ``llama_model_meta_val_str`` does not see array-typed keys, hence one JSON string.)

Budget accounting, in short (the doc has the details):

* ``budget_avg`` is the average number of tokens per layer the plan was built for; the total of a phase is
  ``B = n_layer * budget_avg``.
* A layer gives either ``budget`` (tokens, int) or ``share`` (float); all budgeted layers of one phase use
  the same form. Shares are fractions of the pool above the floor:
  ``b[l] = b_min + (B - n_fullkv * full_charge - n_budgeted * b_min) * share[l]`` rounded by largest remainder.
* A FullKV layer keeps everything; its budget is ``"full"`` in JSON (``None`` in Python). It is charged
  ``full_charge`` tokens against the total (the context length the plan was made for); at run time it
  holds the whole context (``resolved_budgets(phase, n_ctx)`` gives ``n_ctx`` for it).
* With ``exact_total`` (the default), the budgets of a phase plus ``full_charge`` per FullKV layer sum to
  exactly ``B``. Phases in which every layer is FullKV have no budget to meet.
* ``scaled(N)`` (the runtime ``--kv-budget N``) keeps ``b_min`` and scales every layer's part above
  ``b_min`` proportionally so that the new total is exactly ``n_layer * N``.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from fractions import Fraction
from pathlib import Path
from typing import Any, Mapping, Sequence

from polykv_cpp.errors import PlanError

__all__ = [
    "PLAN_FORMAT_VERSION",
    "PLAN_FORMAT_NAME",
    "GGUF_KEY_PLAN",
    "GGUF_KEY_VERSION",
    "KNOWN_PATTERNS",
    "PREFILL_ONLY_PATTERNS",
    "RECONSTRUCTION_PATTERNS",
    "needs_whole_prompt",
    "FULLKV",
    "PHASES",
    "DEFAULT_PARAMS",
    "PhasePlan",
    "LayerPlan",
    "ModelInfo",
    "Provenance",
    "Plan",
    "allocate_budgets",
    "largest_remainder",
    "uniform_plan",
    "pyramid_plan",
    "load",
    "read_gguf",
    "gguf_plan_key",
    "embed_plans",
    "write_gguf",
    "read_gguf_metadata",
    "register_cli",
    "PLAN_SUBPARSERS",
]

PLAN_FORMAT_VERSION = 1
PLAN_FORMAT_NAME = "polykv-plan"
#: how a plan merges tokens fed after its prompt was compressed (Plan.followup)
FOLLOWUP_MODES = ("prefill", "decode", "keep")
#: where the budgets of a plan's scored layers come from (Plan.allocation): the plan, or each prompt's scores (as
#: they are, or relative to each token set's median score)
ALLOCATION_MODES = ("plan", "prompt", "prompt_median")
#: patterns a plan may stream a chunked prompt by (Plan.stream): any that scores a prompt without the whole of it
#: at once (not KVzip, whose pass needs the whole prompt) and evicts (not FullKV)
STREAM_PATTERNS = ("streamingllm", "h2o", "snapkv", "tova", "pyramidkv", "knorm", "expected_attention")
#: the largest ``prefill_slack`` a plan may name (the native parser's bound; a slack beyond the context is the
#: context)
MAX_PREFILL_SLACK = 1e6
#: the largest ``evict_every``: a layer's cache holds up to ``budget + evict_every - 1`` tokens between evictions
MAX_EVICT_EVERY = 65536
GGUF_KEY_PLAN = "polykv.plan"
#: the plan for prompts compressed before their question exists (query-agnostic), next to ``polykv.plan``
GGUF_KEY_PLAN_QUERY_AGNOSTIC = "polykv.plan_query_agnostic"
#: the GGUF key that holds the plan for each protocol of the evaluation (query-aware: the question is in the prompt)
GGUF_PLAN_KEYS = {"query-aware": GGUF_KEY_PLAN, "query-agnostic": GGUF_KEY_PLAN_QUERY_AGNOSTIC}
GGUF_KEY_VERSION = "polykv.version"
GGUF_KEY_PREFIX = "polykv."

#: Eviction patterns a plan may name (lower-case). ``polykv_cpp.patterns`` registers one class per name.
KNOWN_PATTERNS: tuple[str, ...] = ("streamingllm", "h2o", "snapkv", "tova", "pyramidkv", "fullkv", "knorm", "kvzip",
                                   "expected_attention")
FULLKV = "fullkv"
#: Patterns that score with an observation window (SnapKV scoring); they require ``obs_window``.
OBS_WINDOW_PATTERNS: tuple[str, ...] = ("snapkv", "pyramidkv")
PHASES: tuple[str, ...] = ("prefill", "decode")
#: The unit that keeps its own token set: the layer (one set shared by its KV heads), each KV head with the same
#: budget ("head"), or each KV head with the layer's budget split across its heads by score ("adaptive", Ada-KV:
#: :func:`polykv_cpp.patterns.select_adaptive`).
SELECTIONS: tuple[str, ...] = ("layer", "head", "adaptive")
#: The selections that keep one token set per KV head.
HEAD_SELECTIONS: tuple[str, ...] = ("head", "adaptive")
#: Uniform method names that stand for a pattern and selection (kvpress's AdaKVPress wraps SnapKV).
METHOD_ALIASES: dict[str, str] = {"adakv": "snapkv-adaptive"}
#: Patterns whose selection can differ per head (scored by attention or keys; positional ones are the same
#: in every head).
PER_HEAD_PATTERNS: tuple[str, ...] = ("h2o", "snapkv", "tova", "pyramidkv", "knorm", "kvzip", "expected_attention")
#: Patterns that score a prompt once, when it is compressed (KVzip by an extra pass, Expected Attention from the
#: statistics of the prompt's queries): prefill phase only.
PREFILL_ONLY_PATTERNS: tuple[str, ...] = ("kvzip", "expected_attention")
#: Prefill patterns whose scores come from a reconstruction pass run after the prompt (`compress_prompt_kvzip`).
RECONSTRUCTION_PATTERNS: tuple[str, ...] = ("kvzip",)
#: The decode pattern the plan constructors give a layer whose prefill pattern is prefill-only.
DECODE_AFTER_PREFILL_ONLY = "snapkv"

#: Parameters the plan constructors fill in when the caller gives none. ``window`` None for StreamingLLM
#: means "the rest of the budget after the sinks". Validation does not require these values.
DEFAULT_PARAMS: dict[str, dict[str, int | None]] = {
    "streamingllm": {"n_sink": 4, "window": None},
    "h2o": {"n_sink": 0, "window": 32},
    "snapkv": {"n_sink": 0, "window": 32, "obs_window": 32, "pool_kernel": 7},
    "pyramidkv": {"n_sink": 0, "window": 32, "obs_window": 32, "pool_kernel": 7},
    "tova": {"n_sink": 0, "window": 1},
    "knorm": {"n_sink": 0, "window": 1},
    "kvzip": {"n_sink": 4, "window": 0},
    "expected_attention": {"n_sink": 4, "window": 0},
    "fullkv": {},
}

#: Patterns whose scores the plan's ``pool_kernel`` max-pools over neighbouring positions before the selection.
POOLED_PATTERNS: tuple[str, ...] = ("snapkv", "pyramidkv", "kvzip", "expected_attention")

_SHARE_TOL = 1e-6
#: the native runtime keeps counts in int32: larger numbers are refused by both parsers
INT32_MAX = 2**31 - 1
_PARAM_KEYS = ("n_sink", "window", "obs_window", "pool_kernel", "pool_shift")


# --------------------------------------------------------------------------------------------- helpers


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """JSON has no infinities: a number too large for a double is an error (as for the native parser)."""
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text} is out of range")
    return x


def _is_num(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool))


def largest_remainder(weights: Sequence[float | int | Fraction], total: int) -> list[int]:
    """Split the integer ``total`` over ``weights`` proportionally, exactly, by largest remainder.

    Each part is ``floor(total * w / sum(w))``; the leftover units go to the largest fractional parts (ties:
    lower index first). Arithmetic is exact (floats are converted to fractions), so the result is
    deterministic. All-zero weights split evenly. Weights must be >= 0 and ``total`` >= 0.
    """
    if total < 0:
        raise PlanError(f"cannot split a negative total ({total})")
    if not weights:
        if total:
            raise PlanError(f"cannot split {total} tokens over zero layers")
        return []
    ws = [Fraction(w) for w in weights]
    if any(w < 0 for w in ws):
        raise PlanError("cannot split a total over negative weights")
    s = sum(ws)
    if s == 0:
        ws = [Fraction(1)] * len(ws)
        s = Fraction(len(ws))
    quotas = [total * w / s for w in ws]
    parts = [math.floor(q) for q in quotas]
    left = total - sum(parts)
    order = sorted(range(len(ws)), key=lambda i: (-(quotas[i] - parts[i]), i))
    for i in order[:left]:
        parts[i] += 1
    return parts


def budgeted_layers(phase_plans: Sequence["PhasePlan"]) -> list[int]:
    """The indices of a phase's layers that keep a budget (not FullKV)."""
    return [i for i, pp in enumerate(phase_plans) if not pp.is_full]


def layer_spans(windows: Sequence[int | None], n_ctx: int) -> list[int]:
    """What each layer attends to in a context of ``n_ctx`` tokens: a sliding-window layer its window (at most
    ``n_ctx``), any other layer the whole context (:meth:`Plan.span_split`)."""
    return [min(w, n_ctx) if w else n_ctx for w in windows]


def allocate_budgets(total: int, weights: Sequence[float | int], b_min: int,
                     caps: Sequence[int | None] | None = None) -> list[int]:
    """Budgets ``b[l] = b_min + (total - n*b_min) * w[l] / sum(w)``, rounded by largest remainder.

    The result sums to exactly ``total`` and every budget is >= ``b_min``. This is the allocation rule the
    calibration uses (weights = sensitivity signal) and the one :meth:`Plan.scaled` uses (weights = the part
    of each old budget above ``b_min``). Raises PlanError if ``total < n * b_min``.

    ``caps[l]`` (None or 0: none) is the most layer ``l`` can hold, e.g. the window of a sliding-window
    layer: a layer whose budget would pass its cap is fixed at ``max(cap, b_min)`` and what is left is split
    again over the other layers, until no budget passes its cap (the native runtime's rescaling does the
    same). The sum is then below ``total`` only if every layer is capped.
    """
    n = len(weights)
    extra = total - n * b_min
    if extra < 0:
        raise PlanError(f"a total of {total} tokens cannot give {n} layers b_min={b_min} each "
                        f"(needs at least {n * b_min})")
    caps = list(caps) if caps is not None else [None] * n
    if len(caps) != n:
        raise PlanError(f"{len(caps)} caps for {n} layers")
    budgets = [b_min] * n
    fixed = [False] * n
    while True:
        open_ = [i for i in range(n) if not fixed[i]]
        if not open_:
            return budgets
        parts = largest_remainder([weights[i] for i in open_], extra)
        over = [(i, c) for i, x in zip(open_, parts) if (c := caps[i]) and b_min + x > c]
        if not over:
            for i, x in zip(open_, parts):
                budgets[i] = b_min + x
            return budgets
        for i, c in over:
            fixed[i] = True
            budgets[i] = max(b_min, c)
            extra -= budgets[i] - b_min


# -------------------------------------------------------------------------------------------- classes


@dataclass
class PhasePlan:
    """What one layer does in one phase.

    Attributes:
        pattern: one of :data:`KNOWN_PATTERNS`.
        budget: tokens the layer keeps (int), or None for FullKV (JSON ``"full"``) and share-based plans.
        share: the layer's fraction of the phase's pool above ``b_min`` (float), instead of ``budget``.
        n_sink: first tokens always kept (attention sinks); they count inside the budget.
        window: most recent tokens always kept; inside the budget. None: not used by the pattern, or for
            StreamingLLM "the rest of the budget".
        obs_window: SnapKV/PyramidKV observation window (last queries used for scoring; kept).
        pool_kernel: 1-D max-pooling kernel over positions (odd) of SnapKV/PyramidKV/KVzip/Expected Attention
            scores, None = no pooling.
        pool_shift: the pooling window moved back by this many places (``|pool_shift| <= pool_kernel // 2``):
            a high score then reaches ``pool_kernel // 2 + pool_shift`` tokens after its own and
            ``pool_kernel // 2 - pool_shift`` before (:func:`polykv_cpp.patterns.pool1d`); None = 0.
        selection: "layer" (one token set per layer, shared by its KV heads), "head" (each KV head keeps its
            own ``budget`` tokens by its own scores) or "adaptive" (the layer's ``n_head_kv x budget`` (head, token)
            pairs go to the best-scored ones, at least ``max(1, budget // 5)`` per head; Ada-KV); :data:`PER_HEAD_PATTERNS`
            only. JSON omits "layer".
    """

    pattern: str
    budget: int | None = None
    share: float | None = None
    n_sink: int = 0
    window: int | None = None
    obs_window: int | None = None
    pool_kernel: int | None = None
    pool_shift: int | None = None
    selection: str = "layer"

    @property
    def is_full(self) -> bool:
        """True for FullKV (keeps everything)."""
        return self.pattern == FULLKV

    @property
    def reserved(self) -> int:
        """Tokens the pattern always keeps regardless of scores (sinks + recent window)."""
        recent = self.window or 0
        if self.pattern in OBS_WINDOW_PATTERNS:
            recent = max(recent, self.obs_window or 0)
        return self.n_sink + recent

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; FullKV budget is ``"full"``; None-valued parameters are omitted."""
        d: dict[str, Any] = {"pattern": self.pattern}
        if self.is_full:
            d["budget"] = "full"
        elif self.share is not None:
            d["share"] = self.share
        else:
            d["budget"] = self.budget
        if not self.is_full:
            d["n_sink"] = self.n_sink
            for k in ("window", "obs_window", "pool_kernel", "pool_shift"):
                v = getattr(self, k)
                if v is not None:
                    d[k] = v
            if self.selection != "layer":
                d["selection"] = self.selection
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "phase") -> "PhasePlan":
        """Parse and type-check one phase entry; ``where`` names it in error messages."""
        if not isinstance(d, Mapping):
            raise PlanError(f"{where}: expected an object, got {type(d).__name__}")
        unknown = set(d) - {"pattern", "budget", "share", "selection", *_PARAM_KEYS}
        if unknown:
            raise PlanError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        pattern = d.get("pattern")
        if not isinstance(pattern, str):
            raise PlanError(f"{where}: 'pattern' must be a string")
        budget = d.get("budget")
        if budget == "full" or budget is None:
            budget = None
        elif not _is_int(budget):
            raise PlanError(f"{where}: budget must be an integer number of tokens or \"full\" "
                            f"(got {budget!r}; use 'share' for fractions)")
        share = d.get("share")
        if share is not None:
            if not _is_num(share):
                raise PlanError(f"{where}: share must be a number (got {share!r})")
            try:
                share = float(share)
            except OverflowError:  # a JSON integer beyond a float's range
                raise PlanError(f"{where}: share must be a finite number (got an integer of {len(str(share))} digits)") from None
        params: dict[str, int | None] = {}
        for k in _PARAM_KEYS:
            v = d.get(k)
            if v is not None and not _is_int(v):
                raise PlanError(f"{where}: {k} must be an integer (got {v!r})")
            params[k] = v
        n_sink = params.pop("n_sink")
        selection = d.get("selection")
        if selection is None:
            selection = "layer"
        elif selection not in SELECTIONS:
            raise PlanError(f"{where}: selection must be one of {', '.join(SELECTIONS)} (got {selection!r})")
        return cls(pattern=pattern, budget=budget, share=share, n_sink=0 if n_sink is None else n_sink,
                   selection=selection, **params)

    @property
    def per_head(self) -> bool:
        """True if each KV head keeps its own tokens (``selection`` head or adaptive on a pattern that scores per
        head)."""
        return self.selection in HEAD_SELECTIONS and self.pattern in PER_HEAD_PATTERNS

    @property
    def adaptive(self) -> bool:
        """True if the layer's budget is split across its KV heads by score (``selection: adaptive``)."""
        return self.per_head and self.selection == "adaptive"


@dataclass
class LayerPlan:
    """The plan of one transformer layer: a :class:`PhasePlan` for prefill and one for decode."""

    layer: int
    prefill: PhasePlan
    decode: PhasePlan

    def phase(self, phase: str) -> PhasePlan:
        """The PhasePlan of ``phase`` ("prefill" or "decode")."""
        if phase not in PHASES:
            raise PlanError(f"unknown phase {phase!r} (expected one of {', '.join(PHASES)})")
        return getattr(self, phase)

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()}

    @classmethod
    def from_dict(cls, d: Any, where: str = "layer") -> "LayerPlan":
        if not isinstance(d, Mapping):
            raise PlanError(f"{where}: expected an object, got {type(d).__name__}")
        unknown = set(d) - {"layer", "prefill", "decode"}
        if unknown:
            raise PlanError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        idx = d.get("layer")
        if not _is_int(idx):
            raise PlanError(f"{where}: 'layer' must be an integer index")
        phases = {}
        for ph in PHASES:
            if ph not in d:
                raise PlanError(f"layer {idx}: missing '{ph}'")
            phases[ph] = PhasePlan.from_dict(d[ph], where=f"layer {idx} {ph}")
        return cls(layer=idx, **phases)


@dataclass
class ModelInfo:
    """Identity of a model, as far as a plan cares (all optional).

    ``head_dim`` is ``{arch}.attention.key_length`` or embedding_length / head_count; ``n_vocab`` the
    length of ``tokenizer.ggml.tokens`` (or ``{arch}.vocab_size``).
    """

    arch: str | None = None
    n_layer: int | None = None
    n_head: int | None = None
    n_head_kv: int | None = None
    head_dim: int | None = None
    n_vocab: int | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("name", "arch", "n_layer", "n_head", "n_head_kv", "head_dim",
                                               "n_vocab")}

    @classmethod
    def from_dict(cls, d: Any) -> "ModelInfo":
        if not isinstance(d, Mapping):
            raise PlanError("provenance.model must be an object")
        unknown = set(d) - {"name", "arch", "n_layer", "n_head", "n_head_kv", "head_dim", "n_vocab"}
        if unknown:
            raise PlanError(f"provenance.model: unknown field(s) {', '.join(sorted(unknown))}")
        for k in ("n_layer", "n_head", "n_head_kv", "head_dim", "n_vocab"):
            if d.get(k) is not None and not _is_int(d[k]):
                raise PlanError(f"provenance.model.{k} must be an integer")
        for k in ("name", "arch"):
            if d.get(k) is not None and not isinstance(d[k], str):
                raise PlanError(f"provenance.model.{k} must be a string")
        return cls(**{k: d.get(k) for k in ("arch", "n_layer", "n_head", "n_head_kv", "head_dim", "n_vocab",
                                            "name")})

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "ModelInfo":
        """Read the identity from a GGUF's metadata (fast: tensors and token strings are not loaded)."""
        kv = read_gguf_metadata(path)
        arch = kv.get("general.architecture")
        arch = arch if isinstance(arch, str) else None

        def get_int(key: str) -> int | None:
            v = kv.get(f"{arch}.{key}") if arch else None
            return v if _is_int(v) else None

        n_head = get_int("attention.head_count")
        head_dim = get_int("attention.key_length")
        emb = get_int("embedding_length")
        if head_dim is None and emb and n_head:
            head_dim = emb // n_head
        tokens = kv.get("tokenizer.ggml.tokens")
        n_vocab = tokens.length if isinstance(tokens, _Array) else get_int("vocab_size")
        name = kv.get("general.name")
        return cls(arch=arch, n_layer=get_int("block_count"), n_head=n_head,
                   n_head_kv=get_int("attention.head_count_kv") or n_head, head_dim=head_dim,
                   n_vocab=n_vocab, name=name if isinstance(name, str) else None)

    def describe(self) -> str:
        bits = [self.arch or "?", f"{self.n_layer} layers"]
        if self.n_head is not None:
            bits.append(f"{self.n_head}/{self.n_head_kv} heads")
        if self.head_dim is not None:
            bits.append(f"head_dim {self.head_dim}")
        return ", ".join(bits)


def _tool_version() -> str:
    try:
        from polykv_cpp import __version__  # type: ignore[attr-defined]
    except Exception:  # __init__ is another module's business; never fail on it
        __version__ = "unknown"
    return f"polykv-cpp {__version__}"


@dataclass
class Provenance:
    """Where a plan comes from.

    Attributes:
        model: identity of the model it was calibrated on (None for hand-made/baseline plans).
        calibration: description of the calibration data (a string, or a JSON-able dict such as
            ``{"description": ..., "dataset": ..., "n_texts": ..., "n_ctx": ...}``).
        signals: names of the signals used (e.g. ``["cosine", "entropy"]``).
        date: ISO-8601 creation time (UTC).
        tool_version: e.g. ``"polykv-cpp 0.1.0"``.
        extra: free-form JSON-able details (scaling history, notes).
    """

    model: ModelInfo | None = None
    calibration: str | dict[str, Any] | None = None
    signals: list[str] = field(default_factory=list)
    date: str | None = None
    tool_version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def now(cls, **kwargs: Any) -> "Provenance":
        """A Provenance stamped with the current UTC time and this tool's version."""
        kwargs.setdefault("date", datetime.now(timezone.utc).replace(microsecond=0).isoformat())
        kwargs.setdefault("tool_version", _tool_version())
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict() if self.model is not None else None,
            "calibration": self.calibration,
            "signals": list(self.signals),
            "date": self.date,
            "tool_version": self.tool_version,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, d: Any) -> "Provenance":
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise PlanError("provenance must be an object")
        unknown = set(d) - {"model", "calibration", "signals", "date", "tool_version", "extra"}
        if unknown:
            raise PlanError(f"provenance: unknown field(s) {', '.join(sorted(unknown))}")
        model = ModelInfo.from_dict(d["model"]) if d.get("model") is not None else None
        cal = d.get("calibration")
        if cal is not None and not isinstance(cal, (str, Mapping)):
            raise PlanError("provenance.calibration must be a string or an object")
        signals = d.get("signals")
        signals = [] if signals is None else signals
        if not isinstance(signals, list) or not all(isinstance(s, str) for s in signals):
            raise PlanError("provenance.signals must be a list of strings")
        for k in ("date", "tool_version"):
            if d.get(k) is not None and not isinstance(d[k], str):
                raise PlanError(f"provenance.{k} must be a string")
        extra = d.get("extra")
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise PlanError("provenance.extra must be an object")
        return cls(model=model, calibration=dict(cal) if isinstance(cal, Mapping) else cal, signals=list(signals),
                   date=d.get("date"), tool_version=d.get("tool_version"), extra=dict(extra))


@dataclass
class Plan:
    """A PolyKV plan (format version 1). See the module docstring and ``docs/plan-format.md``.

    Attributes:
        version: plan format version, must be 1.
        n_layer: number of transformer layers.
        budget_avg: average tokens per layer the plan was built for (phase total = n_layer * budget_avg).
        b_min: minimum budget of every non-FullKV layer.
        budget_rule: how budgets were chosen ("sensitivity", "uniform", "pyramid", "manual", ...).
        layers: one :class:`LayerPlan` per layer, in order.
        provenance: where the plan comes from.
        exact_total: budgets (+ FullKV charges) of each phase must sum to exactly n_layer * budget_avg.
        full_charge: tokens each FullKV layer is charged against the total (the context length the plan was
            made for); required when a phase mixes FullKV with budgeted layers and the total is checked.
        followup: how tokens fed after the prompt was compressed (a question after a compressed document, the
            next turn of a chat) are merged into the cache: "prefill" (the default) compresses them with the
            prefill pattern like the first prompt; "decode" with each layer's decode pattern at its prefill
            budget, so a SnapKV decode pattern chooses by what the new text (the question) attends to; "keep":
            never evicted, the caches grow by them (the budget bounds the compressed context; the question and
            the answer come on top, as kvpress's pipeline compresses the context only).
        stream: chunked prefill only: a pattern of :data:`STREAM_PATTERNS` by which every layer with a scored
            prefill pattern evicts while a prompt streams (before each new prompt ubatch, at the prefill budget
            times the slack, with the layer's sinks, windows, kernel and selection), so that the prompt's last
            ubatch (the question) reaches the layer's prefill pattern whole; that pattern compresses the prompt
            to its budget when decoding starts. None (the default): the prefill pattern evicts after every ubatch.
        prefill_slack: chunked prefill only: the slack s >= 1 the plan was measured with (each layer keeps up to
            s x its prefill budget while a prompt streams and compresses to the budget when decoding starts).
            Used when neither the caller (``Model.set_plan(prefill_slack=...)``, ``--prefill-slack``) nor
            ``LLAMA_POLYKV_PREFILL_SLACK`` gives one, so that stock tools run the plan as measured. None: 1.
        allocation: "plan" (the default): every layer keeps its plan budget. "prompt": exact prefill only; when a
            prompt is compressed, the budgets of the layers with a scored prefill pattern (not sliding-window
            ones) are re-split for that prompt by their scores across the model, KVzip's non-uniform allocation
            (:func:`polykv_cpp.patterns.allocate_prompt`: same total, at least ``b_min`` per layer), and each
            layer's cache shrinks to its share; the decode budgets follow. Chunked prefill keeps the plan's.
            "prompt_median": the same, each token set's scores divided by the set's median score before they
            compete (``allocate_prompt(relative=True)``): layers compare by how far a token stands above their
            own typical token, so that a layer whose attention is flat no longer outbids peaked ones with its
            many middling scores.
        allocation_cap: with a per-prompt ``allocation``: a layer keeps at most ``ceil(allocation_cap x its plan
            budget)`` tokens per KV head (>= 1; chunked prefill: also at most what the layer holds, its budget x
            the slack), so that at small budgets one layer whose scores are all high cannot take most of the pool
            (KVzip's raw scores at 128 of 4K: one layer took 75%; capping it lost the needles it held on the
            default model, docs/results-archive.md: a bound on memory, not a quality knob). None (the default): no cap.
        protect_tail: the prompt's last ``protect_tail`` tokens are kept in every budgeted layer on top of its
            budget (the question at the end of a prompt compressed whole): each budgeted layer's budgets (both
            phases) grow by it and its prefill window by as much (:meth:`tail_applied`, which the runtime runs after
            any rescaling). The budgets, ``budget_avg`` and :meth:`scaled` count the context without the tail.
        evict_every: decode only: a layer is brought back to its decode budget once it holds ``evict_every``
            tokens more than the budget (per KV head; an adaptive layer: in all its heads together), not after
            every generated token: selection and compaction run once per ``evict_every`` tokens, the cache holds up
            to ``budget + evict_every - 1`` tokens between them. 1 (the default): after every token. At most
            :data:`MAX_EVICT_EVERY`.
    """

    version: int
    n_layer: int
    budget_avg: int
    b_min: int
    budget_rule: str
    layers: list[LayerPlan]
    provenance: Provenance = field(default_factory=Provenance)
    exact_total: bool = True
    full_charge: int | None = None
    followup: str = "prefill"
    stream: str | None = None
    prefill_slack: float | None = None
    allocation: str = "plan"
    allocation_cap: float | None = None
    protect_tail: int = 0
    evict_every: int = 1

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the v1 schema; ``followup``, ``stream``, ``prefill_slack``, ``allocation``,
        ``allocation_cap``, ``protect_tail`` and ``evict_every`` only when they are not the default)."""
        d = {
            "format": PLAN_FORMAT_NAME,
            "version": self.version,
            "n_layer": self.n_layer,
            "budget_avg": self.budget_avg,
            "b_min": self.b_min,
            "budget_rule": self.budget_rule,
            "exact_total": self.exact_total,
            "full_charge": self.full_charge,
            "layers": [lp.to_dict() for lp in self.layers],
            "provenance": self.provenance.to_dict(),
        }
        if self.followup != "prefill":
            d["followup"] = self.followup
        if self.stream is not None:
            d["stream"] = self.stream
        if self.prefill_slack is not None:
            d["prefill_slack"] = self.prefill_slack
        if self.allocation != "plan":
            d["allocation"] = self.allocation
        if self.allocation_cap is not None:
            d["allocation_cap"] = self.allocation_cap
        if self.protect_tail:
            d["protect_tail"] = self.protect_tail
        if self.evict_every != 1:
            d["evict_every"] = self.evict_every
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Plan":
        """Parse a dict of the v1 schema (types and required keys are checked; call :meth:`validate` for
        the budget rules)."""
        if not isinstance(d, Mapping):
            raise PlanError(f"a plan must be a JSON object, got {type(d).__name__}")
        fmt = d.get("format", PLAN_FORMAT_NAME)
        if fmt != PLAN_FORMAT_NAME:
            raise PlanError(f"not a PolyKV plan (format {fmt!r}, expected {PLAN_FORMAT_NAME!r})")
        version = d.get("version")
        if not _is_int(version):
            raise PlanError("plan has no integer 'version'")
        if version != PLAN_FORMAT_VERSION:
            raise PlanError(f"unsupported plan format version {version} (this polykv-cpp reads version "
                            f"{PLAN_FORMAT_VERSION})")
        allowed = {"format", "version", "n_layer", "budget_avg", "b_min", "budget_rule", "exact_total",
                   "full_charge", "followup", "stream", "prefill_slack", "allocation", "allocation_cap", "protect_tail",
                   "evict_every", "layers", "provenance"}
        unknown = set(d) - allowed
        if unknown:
            raise PlanError(f"plan: unknown field(s) {', '.join(sorted(unknown))}")
        for k in ("n_layer", "budget_avg", "b_min"):
            if k not in d:
                raise PlanError(f"plan: missing '{k}'")
            if not _is_int(d[k]):
                raise PlanError(f"plan: '{k}' must be an integer (got {d[k]!r})")
        rule = d.get("budget_rule")
        if not isinstance(rule, str):
            raise PlanError("plan: 'budget_rule' must be a string")
        exact = d.get("exact_total", True)
        if not isinstance(exact, bool):
            raise PlanError("plan: 'exact_total' must be true or false")
        fc = d.get("full_charge")
        if fc is not None and not _is_int(fc):
            raise PlanError(f"plan: 'full_charge' must be an integer or null (got {fc!r})")
        followup = d.get("followup", "prefill")
        if followup not in FOLLOWUP_MODES:
            raise PlanError(f"plan: 'followup' must be one of {', '.join(FOLLOWUP_MODES)} (got {followup!r})")
        stream = d.get("stream")
        if "stream" in d and stream not in STREAM_PATTERNS:
            raise PlanError(f"plan: 'stream' must be a pattern that scores a prompt as it streams "
                            f"({', '.join(STREAM_PATTERNS)}; got {stream!r})")
        slack = d.get("prefill_slack")
        if "prefill_slack" in d and not _is_slack(slack):
            raise PlanError(f"plan: 'prefill_slack' must be a number from 1 to {MAX_PREFILL_SLACK:g} (got {slack!r})")
        allocation = d.get("allocation", "plan")
        if allocation not in ALLOCATION_MODES:
            raise PlanError(f"plan: 'allocation' must be one of {', '.join(ALLOCATION_MODES)} (got {allocation!r})")
        cap = d.get("allocation_cap")  # absent or null: none, as the native parser
        if cap is not None and not _is_slack(cap):
            raise PlanError(f"plan: 'allocation_cap' must be a number from 1 to {MAX_PREFILL_SLACK:g} (got {cap!r})")
        if cap is not None and allocation == "plan":
            raise PlanError("plan: 'allocation_cap' needs \"allocation\": \"prompt\" or \"prompt_median\"")
        tail = d.get("protect_tail")
        if tail is None:
            tail = 0  # absent or null, as the native parser
        elif not _is_int(tail) or not 0 <= tail <= INT32_MAX:
            raise PlanError(f"plan: 'protect_tail' must be an integer from 0 to {INT32_MAX} (got {tail!r})")
        every = d.get("evict_every")
        if every is None:
            every = 1  # absent or null, as the native parser
        elif not _is_int(every) or not 1 <= every <= MAX_EVICT_EVERY:
            raise PlanError(f"plan: 'evict_every' must be an integer from 1 to {MAX_EVICT_EVERY} (got {every!r})")
        layers = d.get("layers")
        if not isinstance(layers, list):
            raise PlanError("plan: 'layers' must be a list")
        return cls(
            version=version, n_layer=d["n_layer"], budget_avg=d["budget_avg"], b_min=d["b_min"],
            budget_rule=rule,
            layers=[LayerPlan.from_dict(x, where=f"layers[{i}]") for i, x in enumerate(layers)],
            provenance=Provenance.from_dict(d.get("provenance")),
            exact_total=exact, full_charge=fc, followup=followup, stream=stream, prefill_slack=slack,
            allocation=allocation, allocation_cap=cap, protect_tail=tail, evict_every=every,
        )

    def to_json(self, indent: int | None = 1) -> str:
        """The plan as JSON text (``indent=None`` for the compact form stored in GGUF)."""
        if indent is None:
            return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        """Parse JSON text; malformed JSON or a wrong schema raises PlanError."""
        try:
            d = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
        except (ValueError, UnicodeDecodeError) as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None
        return cls.from_dict(d)

    # ------------------------------------------------------------------ queries

    def phase_plans(self, phase: str) -> list[PhasePlan]:
        """The PhasePlan of every layer for ``phase``."""
        return [lp.phase(phase) for lp in self.layers]

    def patterns(self, phase: str) -> list[str]:
        """Pattern name per layer for ``phase``."""
        return [pp.pattern for pp in self.phase_plans(phase)]

    def _pool(self, phase: str, charge: int | None = None) -> int:
        """Tokens of a phase's total left for the budgeted (non-FullKV) layers."""
        n_full = sum(pp.is_full for pp in self.phase_plans(phase))
        charge = self.full_charge if charge is None else charge
        if n_full and charge is None:
            raise PlanError(f"{phase}: the plan has FullKV layers but no full_charge (tokens a FullKV layer is "
                            "charged against the total)")
        return self.n_layer * self.budget_avg - n_full * (charge or 0)

    def _layer_copies(self) -> list[LayerPlan]:
        return [LayerPlan(lp.layer, replace(lp.prefill), replace(lp.decode)) for lp in self.layers]

    def token_budgets(self, phase: str) -> list[int | None]:
        """Budgets in tokens per layer at the plan's own ``budget_avg`` (None for FullKV layers).

        Share-based phases are resolved: ``b_min`` + largest-remainder split of the pool above the floor.
        """
        pps = self.phase_plans(phase)
        idx = budgeted_layers(pps)
        out: list[int | None] = [None] * len(pps)
        if not idx:
            return out
        if any(pps[i].share is not None for i in idx):
            if any(pps[i].share is None for i in idx):
                raise PlanError(f"{phase}: layers mix 'budget' and 'share'")
            got = allocate_budgets(self._pool(phase), [pps[i].share for i in idx], self.b_min)
        else:
            got = [pps[i].budget for i in idx]
        for i, b in zip(idx, got):
            out[i] = b
        return out

    def resolved_budgets(self, phase: str, n_ctx: int) -> list[int]:
        """Tokens each layer keeps in ``phase`` for a context of ``n_ctx`` tokens.

        FullKV layers get ``n_ctx``; other budgets (with :attr:`protect_tail` on top) are capped at ``n_ctx`` (a
        layer cannot hold more than the context). Share-based budgets are resolved at the plan's ``budget_avg``
        first.
        """
        if not _is_int(n_ctx) or n_ctx < 1:
            raise PlanError(f"n_ctx must be a positive integer (got {n_ctx!r})")
        return [n_ctx if b is None else min(b, n_ctx) for b in self.tail_applied(n_ctx).token_budgets(phase)]

    def summary(self) -> str:
        """One line: layers, budget, rule and pattern counts per phase."""
        parts = [f"plan v{self.version}: {self.n_layer} layers, budget_avg {self.budget_avg}, b_min {self.b_min}, "
                 f"rule {self.budget_rule}"]
        for ph in PHASES:
            c = Counter(self.patterns(ph))
            pats = " ".join(f"{p}x{n}" for p, n in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))
            parts.append(f"{ph}: {pats}")
        if self.stream is not None:
            parts.append(f"streams by {self.stream}")
        if self.prefill_slack is not None:
            parts.append(f"prefill slack {self.prefill_slack:g}")
        if self.followup == "keep":
            parts.append("follow-ups kept (the cache grows by them)")
        elif self.followup != "prefill":
            parts.append(f"follow-ups by the {self.followup} pattern")
        if self.allocation != "plan":
            relative = " (relative to each set's median)" if self.allocation == "prompt_median" else ""
            parts.append("budgets re-split per prompt by its scores" + relative)
        if self.allocation_cap is not None:
            parts.append(f"a layer's per-prompt budget capped at {self.allocation_cap:g}x its own")
        if self.protect_tail:
            parts.append(f"the prompt's last {self.protect_tail} tokens kept on top")
        if self.evict_every != 1:
            parts.append(f"decode evicts every {self.evict_every} tokens")
        m = self.provenance.model
        if m is not None and (m.name or m.arch):
            parts.append(f"model: {m.name or m.arch}")
        return "; ".join(parts)

    # ------------------------------------------------------------------ validation

    def validate(self, n_layer: int | None = None) -> "Plan":
        """Check the plan; raise PlanError naming the problem (and the layer/phase). Returns self.

        Rules: version 1; ``n_layer`` >= 1 and equal to the model's (when given) and to the number of
        layers, which must be listed in order 0..n_layer-1; ``budget_avg`` >= 1; 0 <= ``b_min`` <=
        ``budget_avg``; known pattern names; FullKV has no budget/share, other layers have exactly one,
        and all budgeted layers of a phase use the same form; budgets are integers >= 1 and >= b_min;
        shares are >= 0 and sum to 1; ``n_sink`` >= 0, windows >= 0, ``obs_window`` >= 1 and required
        for snapkv/pyramidkv, ``pool_kernel`` odd >= 1; sinks + recent window fit in the budget; with
        ``exact_total``, budgets + FullKV charges sum to ``n_layer * budget_avg`` in every phase that has a
        budgeted layer.
        """
        if self.version != PLAN_FORMAT_VERSION:
            raise PlanError(f"unsupported plan format version {self.version!r} (expected {PLAN_FORMAT_VERSION})")
        if not _is_int(self.n_layer) or self.n_layer < 1:
            raise PlanError(f"n_layer must be a positive integer (got {self.n_layer!r})")
        if n_layer is not None and n_layer != self.n_layer:
            raise PlanError(f"the plan is for {self.n_layer} layers but the model has {n_layer}")
        m = self.provenance.model
        if m is not None and m.n_layer is not None and m.n_layer != self.n_layer:
            raise PlanError(f"provenance says the model has {m.n_layer} layers but the plan has {self.n_layer}")
        if len(self.layers) != self.n_layer:
            raise PlanError(f"the plan lists {len(self.layers)} layers but n_layer is {self.n_layer}")
        for i, lp in enumerate(self.layers):
            if lp.layer != i:
                raise PlanError(f"layer entry {i} has index {lp.layer}; layers must be listed in order "
                                f"0..{self.n_layer - 1}")
        for name in ("n_layer", "budget_avg", "b_min", "full_charge"):
            v = getattr(self, name)
            if _is_int(v) and v > INT32_MAX:
                raise PlanError(f"{name} {v} is too large (at most {INT32_MAX})")
        if not _is_int(self.budget_avg) or self.budget_avg < 1:
            raise PlanError(f"budget_avg must be a positive integer (got {self.budget_avg!r})")
        if not _is_int(self.b_min) or self.b_min < 0:
            raise PlanError(f"b_min must be a non-negative integer (got {self.b_min!r})")
        if self.b_min > self.budget_avg:
            raise PlanError(f"b_min {self.b_min} is larger than budget_avg {self.budget_avg}")
        if not isinstance(self.budget_rule, str) or not self.budget_rule:
            raise PlanError("budget_rule must be a non-empty string")
        if self.full_charge is not None and (not _is_int(self.full_charge) or self.full_charge < 1):
            raise PlanError(f"full_charge must be a positive integer or null (got {self.full_charge!r})")
        if self.followup not in FOLLOWUP_MODES:
            raise PlanError(f"followup must be one of {', '.join(FOLLOWUP_MODES)} (got {self.followup!r})")
        if self.stream is not None and self.stream not in STREAM_PATTERNS:
            raise PlanError(f"stream must be one of {', '.join(STREAM_PATTERNS)} or None (got {self.stream!r})")
        if self.prefill_slack is not None and not _is_slack(self.prefill_slack):
            raise PlanError(f"prefill_slack must be a number from 1 to {MAX_PREFILL_SLACK:g} or None "
                            f"(got {self.prefill_slack!r})")
        if self.allocation not in ALLOCATION_MODES:
            raise PlanError(f"allocation must be one of {', '.join(ALLOCATION_MODES)} (got {self.allocation!r})")
        if self.allocation_cap is not None and not _is_slack(self.allocation_cap):
            raise PlanError(f"allocation_cap must be a number from 1 to {MAX_PREFILL_SLACK:g} or None "
                            f"(got {self.allocation_cap!r})")
        if self.allocation_cap is not None and self.allocation == "plan":
            raise PlanError("allocation_cap needs allocation 'prompt' or 'prompt_median'")
        if not _is_int(self.protect_tail) or not 0 <= self.protect_tail <= INT32_MAX:
            raise PlanError(f"protect_tail must be an integer from 0 to {INT32_MAX} (got {self.protect_tail!r})")
        if not _is_int(self.evict_every) or not 1 <= self.evict_every <= MAX_EVICT_EVERY:
            raise PlanError(f"evict_every must be an integer from 1 to {MAX_EVICT_EVERY} (got {self.evict_every!r})")

        for lp in self.layers:
            scored = [ph for ph in PHASES if lp.phase(ph).pattern in PER_HEAD_PATTERNS]
            if len({lp.phase(ph).per_head for ph in scored}) > 1:
                raise PlanError(f"layer {lp.layer}: one phase selects per head and the other per layer; a layer "
                                "selects one way in both phases")
        for ph in PHASES:
            pps = self.phase_plans(ph)
            for i, pp in enumerate(pps):
                _check_phase_static(pp, f"layer {i} {ph}", self.b_min)
                if ph == "decode" and pp.pattern in PREFILL_ONLY_PATTERNS:
                    raise PlanError(f"layer {i} decode: {pp.pattern} scores a prompt once, when it is compressed; it is "
                                    f"a prefill pattern only (decode with e.g. {DECODE_AFTER_PREFILL_ONLY})")
            budgeted = budgeted_layers(pps)
            if not budgeted:
                continue
            by_share = [i for i in budgeted if pps[i].share is not None]
            if by_share and len(by_share) != len(budgeted):
                a = next(i for i in budgeted if pps[i].share is None)
                raise PlanError(f"layer {a} {ph}: gives a budget while other layers of the phase give a share; "
                                "use one form per phase")
            n_full = len(pps) - len(budgeted)
            if by_share:
                total = math.fsum(pps[i].share for i in by_share)
                if abs(total - 1.0) > _SHARE_TOL:
                    raise PlanError(f"{ph}: shares sum to {total:.9g}, expected 1")
                pool = self._pool(ph)
                if pool < len(budgeted) * self.b_min:
                    raise PlanError(f"{ph}: {n_full} FullKV layers charged {self.full_charge} tokens each leave "
                                    f"{pool} tokens, less than b_min={self.b_min} for {len(budgeted)} layers")
            elif self.exact_total:
                pool = self._pool(ph)
                got = sum(pps[i].budget for i in budgeted)
                if got != pool:
                    charged = f" + {n_full} FullKV layers x {self.full_charge}" if n_full else ""
                    raise PlanError(
                        f"{ph}: budgets sum to {got}{charged} = {got + self.n_layer * self.budget_avg - pool}, "
                        f"expected n_layer*budget_avg = {self.n_layer * self.budget_avg} (exact_total is set)")
            budgets = self.token_budgets(ph)
            for i in budgeted:
                pp, b = pps[i], budgets[i]
                assert b is not None
                if b < 1:
                    raise PlanError(f"layer {i} {ph}: budget {b} must be positive")
                if b < self.b_min:
                    raise PlanError(f"layer {i} {ph}: budget {b} is below b_min {self.b_min}")
                if pp.reserved > b:
                    what = "n_sink + max(window, obs_window)" if pp.pattern in OBS_WINDOW_PATTERNS else \
                        "n_sink + window"
                    raise PlanError(f"layer {i} {ph}: {what} = {pp.reserved} exceeds the budget {b}")
        return self

    def check_model(self, info: ModelInfo) -> None:
        """Raise PlanError if the plan does not fit the model ``info`` (layer count; and, where both the
        plan's provenance and ``info`` know them, arch, head counts and head_dim)."""
        if info.n_layer is not None and info.n_layer != self.n_layer:
            raise PlanError(f"the plan is for {self.n_layer} layers but the model "
                            f"({info.name or info.arch or '?'}) has {info.n_layer}")
        m = self.provenance.model
        if m is None:
            return
        for k in ("arch", "n_head", "n_head_kv", "head_dim"):
            a, b = getattr(m, k), getattr(info, k)
            if a is not None and b is not None and a != b:
                raise PlanError(f"the plan was calibrated for a different model: {k} {a!r} in the plan, {b!r} in "
                                f"the model ({m.describe()} vs {info.describe()})")

    # ------------------------------------------------------------------ scaling

    def scaled(self, kv_budget: int, *, full_charge: int | None = None,
               caps: Sequence[int | None] | None = None) -> "Plan":
        """The plan rescaled to an average of ``kv_budget`` tokens per layer (runtime ``--kv-budget N``).

        In each phase that has budgeted layers, FullKV layers stay FullKV and are charged ``full_charge``
        (default: the plan's); every other layer keeps ``b_min`` and gets a share of the rest proportional
        to its old budget above ``b_min`` (its share, for share-based plans):
        ``b'[l] = b_min + (n_layer*N - n_full*full_charge - n*b_min) * (b[l]-b_min) / sum(b-b_min)``,
        rounded by largest remainder, so each phase's total is exact. Windows and observation windows that
        no longer fit are shrunk to ``budget - n_sink``. The result has integer budgets, ``budget_avg = N``
        and ``exact_total`` set; ``provenance.extra["scaled_from_budget_avg"]`` records the original average.

        ``caps[l]`` (None/0: none; ``Model.attention_windows()``) is the most layer ``l`` can use: a sliding-window
        layer holds at most its window, so the tokens the proportional rule would give it above that go to the
        other layers (see :func:`allocate_budgets`). The native rescaling (``--kv-budget``) applies the model's
        windows the same way.
        """
        if not _is_int(kv_budget) or kv_budget < 1:
            raise PlanError(f"--kv-budget must be a positive integer (got {kv_budget!r})")
        if kv_budget < self.b_min:
            raise PlanError(f"--kv-budget {kv_budget} is below the plan's b_min {self.b_min}")
        charge = self.full_charge if full_charge is None else full_charge
        if caps is not None and len(caps) != self.n_layer:
            raise PlanError(f"{len(caps)} caps for a plan of {self.n_layer} layers")
        exact = True
        new_layers = self._layer_copies()
        for ph in PHASES:
            pps = self.phase_plans(ph)
            budgeted = budgeted_layers(pps)
            if not budgeted:
                continue
            n_full = len(pps) - len(budgeted)
            if n_full and charge is None:
                raise PlanError(f"{ph}: cannot scale a plan with FullKV layers without full_charge")
            pool = self.n_layer * kv_budget - n_full * (charge or 0)
            if pool < len(budgeted) * self.b_min:
                raise PlanError(f"--kv-budget {kv_budget} is too small for {ph}: {n_full} FullKV layers x {charge} "
                                f"tokens leave {pool}, less than b_min={self.b_min} x {len(budgeted)} layers")
            if any(pps[i].share is not None for i in budgeted):
                weights = [pps[i].share or 0.0 for i in budgeted]
            else:
                weights = [max(0, (pps[i].budget or 0) - self.b_min) for i in budgeted]
            layer_caps = [caps[i] for i in budgeted] if caps is not None else None
            budgets = allocate_budgets(pool, weights, self.b_min, layer_caps)
            for i, b in zip(budgeted, budgets):
                if b > INT32_MAX:
                    raise PlanError(f"a KV budget of {kv_budget} tokens per layer gives layer {i} {b} tokens, more than "
                                    f"a cache can index (2^31 - 1)")
            exact = exact and sum(budgets) == pool
            for i, b in zip(budgeted, budgets):
                pp = new_layers[i].phase(ph)
                pp.budget, pp.share = b, None
                if b < 1:
                    raise PlanError(f"layer {i} {ph}: a KV budget of {kv_budget} tokens per layer leaves it {b} tokens; "
                                    f"a budget must be positive")
                if pp.n_sink > b:
                    raise PlanError(f"layer {i} {ph}: n_sink {pp.n_sink} does not fit the scaled budget {b}")
                room = b - pp.n_sink
                if pp.window is not None and pp.window > room:
                    pp.window = room
                if pp.obs_window is not None and pp.obs_window > room:
                    pp.obs_window = max(1, room)
        prov = replace(self.provenance, extra=dict(self.provenance.extra))
        prov.extra.setdefault("scaled_from_budget_avg", self.budget_avg)
        return Plan(version=self.version, n_layer=self.n_layer, budget_avg=kv_budget, b_min=self.b_min,
                    budget_rule=self.budget_rule, layers=new_layers, provenance=prov, exact_total=exact,
                    full_charge=charge, followup=self.followup, stream=self.stream,
                    prefill_slack=self.prefill_slack, allocation=self.allocation,
                    allocation_cap=self.allocation_cap, protect_tail=self.protect_tail, evict_every=self.evict_every)

    def span_split(self, windows: Sequence[int | None], n_ctx: int) -> "Plan":
        """The plan with each phase's total re-split over its budgeted layers in proportion to their budgets (or
        shares) times their spans: what each layer attends to, ``min(window, n_ctx)`` for a sliding-window layer
        (``windows[l]``, ``Model.attention_windows()``) and ``n_ctx`` for the others. Every layer then keeps the same
        share of what it can see, as a compression ratio does (kvpress's presses on a model whose sliding-window
        layers cache only their window); the plain split gives a sliding-window layer as many tokens as a global one,
        its whole window once the budget reaches it, and leaves the global layers, the only ones that reach the
        start of a long prompt, with the average. The result is share-based (any :meth:`scaled` budget keeps the
        proportions); ``budget_rule`` gains ``+span`` and ``provenance.extra["span_n_ctx"]`` records ``n_ctx``.
        Limits: the shares are those of ``n_ctx`` at any context (on Gemma-3-270M the shares of 4K held at 1K and 8K
        better than or as well as each context's own). A model without sliding-window layers gets the plan
        unchanged.
        """
        if len(windows) != self.n_layer:
            raise PlanError(f"{len(windows)} windows for a plan of {self.n_layer} layers")
        if not _is_int(n_ctx) or n_ctx < 1:
            raise PlanError(f"n_ctx must be a positive integer (got {n_ctx!r})")
        if not any(windows):
            return self
        if self.full_charge is None and any(pp.is_full for lp in self.layers for pp in (lp.prefill, lp.decode)):
            raise PlanError("a plan with FullKV layers needs full_charge to be split by span")
        spans = layer_spans(windows, n_ctx)
        new_layers = self._layer_copies()
        for ph in PHASES:
            pps = self.phase_plans(ph)
            budgeted = budgeted_layers(pps)
            if not budgeted:
                continue
            if any(pps[i].share is not None for i in budgeted):
                weights = [(pps[i].share or 0.0) * spans[i] for i in budgeted]
            else:
                weights = [(pps[i].budget or 0) * spans[i] for i in budgeted]
            total = sum(weights)
            if total <= 0:
                continue
            for i, w in zip(budgeted, weights):
                pp = new_layers[i].phase(ph)
                pp.budget, pp.share = None, w / total
        prov = replace(self.provenance, extra=dict(self.provenance.extra))
        prov.extra["span_n_ctx"] = n_ctx
        rule = self.budget_rule if self.budget_rule.endswith("+span") else f"{self.budget_rule}+span"
        return replace(self, layers=new_layers, provenance=prov, budget_rule=rule, exact_total=False).validate()

    def with_floor(self, b_min: int) -> "Plan":
        """The plan with the floor ``b_min``: the same budgets at ``budget_avg`` (a share plan's resolved ones), given
        as shares of what lies above the new floor, so that :meth:`scaled` keeps their proportions down to it (with a
        floor at a quarter of the budget every layer is equal once ``--kv-budget`` falls to that quarter). A budget
        below the new floor is an error."""
        if not _is_int(b_min) or not 0 <= b_min <= self.budget_avg:
            raise PlanError(f"b_min must be an integer from 0 to budget_avg {self.budget_avg} (got {b_min!r})")
        new_layers = self._layer_copies()
        for ph in PHASES:
            budgets = self.token_budgets(ph)
            idx = budgeted_layers(self.phase_plans(ph))
            for i in idx:
                if budgets[i] < b_min:
                    raise PlanError(f"layer {i} {ph}: budget {budgets[i]} is below the new b_min {b_min}")
            above = [budgets[i] - b_min for i in idx]
            total = sum(above)
            for i, a in zip(idx, above):
                pp = new_layers[i].phase(ph)
                pp.budget, pp.share = None, (a / total if total else 1 / len(idx))
        return replace(self, layers=new_layers, b_min=b_min).validate()

    def tail_applied(self, n_ctx: int | None = None, caps: Sequence[int | None] | None = None) -> "Plan":
        """The plan the runtime runs for :attr:`protect_tail`: every budgeted layer's budget grows by the tail in
        both phases (up to ``n_ctx`` and a sliding-window layer's ``caps[l]``, but never shrinks) and its prefill
        window by what its budget grew (within ``budget - n_sink``), so that the prompt's last tokens are kept on
        top of what the pattern selects; ``protect_tail`` 0, integer budgets, ``exact_total`` off (the total
        grew). A plan without a tail is returned as it is. Rescale first (:meth:`scaled`): the runtime adds the
        tail after ``--kv-budget``."""
        if not self.protect_tail:
            return self
        if caps is not None and len(caps) != self.n_layer:
            raise PlanError(f"{len(caps)} caps for a plan of {self.n_layer} layers")
        new_layers = self._layer_copies()
        for ph in PHASES:
            for i, b in enumerate(self.token_budgets(ph)):
                if b is None:
                    continue
                grown = b + self.protect_tail
                if n_ctx is not None:
                    grown = min(grown, max(b, n_ctx))
                if caps is not None and caps[i]:
                    grown = min(grown, max(b, caps[i]))
                pp = new_layers[i].phase(ph)
                pp.budget, pp.share = grown, None
                if ph == "prefill":
                    pp.window = min((pp.window or 0) + grown - b, grown - pp.n_sink)
        return replace(self, layers=new_layers, exact_total=False, protect_tail=0)


def uses_kvzip(plan: "Plan | None") -> bool:
    """True if some layer of `plan` compresses its prompt with KVzip (a reconstruction pass must run)."""
    return plan is not None and any(lp.prefill.pattern in RECONSTRUCTION_PATTERNS for lp in plan.layers)


def needs_whole_prompt(plan: "Plan | None", prefill_slack: float | None = None) -> bool:
    """True if `plan` chooses what to keep from the whole prompt at once: a KVzip layer (its reconstruction pass
    reads the whole prompt again) or per-prompt budgets (``"allocation"`` ``"prompt"`` or ``"prompt_median"``) without
    a prefill slack > 1 (``prefill_slack``, else the plan's own: chunked prefill re-splits only what each layer holds
    when the prompt ends, its budget x the slack). `polykv-cpp run` then defaults to exact prefill."""
    if plan is None:
        return False
    return uses_kvzip(plan) or (plan.allocation != "plan" and not chunked_prefill_slack(plan, prefill_slack) > 1)


def chunked_prefill_slack(plan: "Plan | None", explicit: float | None = None) -> float:
    """The slack a chunked prefill with ``plan`` takes: ``explicit`` (the caller's), else the plan's own, else 1."""
    if explicit is not None:
        return explicit
    return (plan.prefill_slack if plan is not None else None) or 1.0


def _is_slack(v: Any) -> bool:
    """A plan's ``prefill_slack``: a finite number (not a bool) from 1 to :data:`MAX_PREFILL_SLACK`."""
    # no float() of an int: JSON integers have no size limit, and one beyond a float's range raises OverflowError
    return _is_num(v) and (isinstance(v, int) or math.isfinite(v)) and 1 <= v <= MAX_PREFILL_SLACK


def _check_phase_static(pp: PhasePlan, where: str, b_min: int) -> None:
    """Checks of one PhasePlan that need no other layer."""
    if pp.pattern not in KNOWN_PATTERNS:
        raise PlanError(f"{where}: unknown pattern {pp.pattern!r} (known: {', '.join(KNOWN_PATTERNS)})")
    if pp.is_full:
        if pp.budget is not None or pp.share is not None:
            raise PlanError(f"{where}: a fullkv layer keeps everything; its budget must be \"full\"/null and it "
                            "has no share")
        return
    for name in ("budget", *_PARAM_KEYS):
        v = getattr(pp, name)
        if _is_int(v) and v > INT32_MAX:
            raise PlanError(f"{where}: {name} {v} is too large (at most {INT32_MAX})")
    if pp.budget is None and pp.share is None:
        raise PlanError(f"{where}: {pp.pattern} needs a budget (tokens) or a share")
    if pp.budget is not None and pp.share is not None:
        raise PlanError(f"{where}: give a budget or a share, not both")
    if pp.budget is not None:
        if not _is_int(pp.budget):
            raise PlanError(f"{where}: budget must be an integer (got {pp.budget!r})")
        if pp.budget <= 0:
            raise PlanError(f"{where}: budget {pp.budget} must be positive")
        if pp.budget < b_min:
            raise PlanError(f"{where}: budget {pp.budget} is below b_min {b_min}")
    if pp.share is not None:
        if not _is_num(pp.share) or not math.isfinite(pp.share) or pp.share < 0:
            raise PlanError(f"{where}: share must be a finite number >= 0 (got {pp.share!r})")
    if not _is_int(pp.n_sink) or pp.n_sink < 0:
        raise PlanError(f"{where}: n_sink must be an integer >= 0 (got {pp.n_sink!r})")
    if pp.window is not None and (not _is_int(pp.window) or pp.window < 0):
        raise PlanError(f"{where}: window must be an integer >= 0 (got {pp.window!r})")
    if pp.obs_window is not None and (not _is_int(pp.obs_window) or pp.obs_window < 1):
        raise PlanError(f"{where}: obs_window must be an integer >= 1 (got {pp.obs_window!r})")
    if pp.pattern in OBS_WINDOW_PATTERNS and pp.obs_window is None:
        raise PlanError(f"{where}: {pp.pattern} needs obs_window (the observation window)")
    if pp.pool_kernel is not None and (not _is_int(pp.pool_kernel) or pp.pool_kernel < 1 or pp.pool_kernel % 2 == 0):
        raise PlanError(f"{where}: pool_kernel must be an odd integer >= 1 (got {pp.pool_kernel!r})")
    if pp.pool_shift is not None:
        reach = (pp.pool_kernel or 1) // 2
        if not _is_int(pp.pool_shift) or abs(pp.pool_shift) > reach:
            raise PlanError(f"{where}: pool_shift must be an integer from -{reach} to {reach} (pool_kernel // 2; "
                            f"got {pp.pool_shift!r})")
    if pp.selection not in SELECTIONS:
        raise PlanError(f"{where}: selection must be one of {', '.join(SELECTIONS)} (got {pp.selection!r})")


# ------------------------------------------------------------------------------------- constructors


def split_selection(name: str) -> tuple[str, str]:
    """A pattern name with an optional unit suffix: ``"snapkv-head"`` -> ``("snapkv", "head")``, ``"snapkv"`` ->
    ``("snapkv", "layer")``, ``"snapkv-adaptive"`` (or ``"adakv"``, :data:`METHOD_ALIASES`) -> ``("snapkv",
    "adaptive")`` (the names the evaluation and the runtime search use for per-head variants)."""
    name = METHOD_ALIASES.get(name.lower(), name)
    base, sep, unit = name.lower().partition("-")
    if not sep:
        return base, "layer"
    if unit not in SELECTIONS or base not in PER_HEAD_PATTERNS:
        raise PlanError(f"unknown pattern {name!r}: a pattern ({', '.join(KNOWN_PATTERNS)}) or a per-head variant "
                        f"({', '.join(p + '-head' for p in PER_HEAD_PATTERNS)}, or -adaptive)")
    return base, unit


def split_method(name: str) -> tuple[str, str, dict[str, int]]:
    """A uniform method's name: a pattern, an optional unit suffix and an optional pooling kernel after ``@``,
    itself with an optional shift after ``+`` or ``-``: ``"snapkv-head@23"`` -> ``("snapkv", "head",
    {"pool_kernel": 23})``, ``"snapkv@23+8"`` -> ``("snapkv", "layer", {"pool_kernel": 23, "pool_shift": 8})``,
    ``"snapkv"`` -> ``("snapkv", "layer", {})`` (the names the evaluation and the runtime search use for variants
    of the default parameters)."""
    head, at, pooling = name.partition("@")
    base, selection = split_selection(head)
    if not at:
        return base, selection, {}
    sign = "+" if "+" in pooling else "-"
    kernel, has_shift, shift = pooling.partition(sign)
    valid = (base in POOLED_PATTERNS and kernel.isdigit() and int(kernel) % 2 == 1
             and (not has_shift or (shift.isdigit() and int(shift) <= int(kernel) // 2)))
    if not valid:
        raise PlanError(f"unknown method {name!r}: '@K' sets the odd pooling kernel K of "
                        f"{', '.join(POOLED_PATTERNS)} (e.g. snapkv@23), '@K+S' also moves its window S <= K // 2 "
                        "places to the tokens after a high score (snapkv@23+8)")
    params = {"pool_kernel": int(kernel)}
    if has_shift and int(shift):
        params["pool_shift"] = int(shift) if sign == "+" else -int(shift)
    return base, selection, params


#: a uniform method's suffix for its budgets split over layers by their spans (:meth:`Plan.span_split`), on a model
#: with sliding-window layers: ``"snapkv@15+4~span"``
SPAN_SUFFIX = "~span"


def split_span(method: str) -> tuple[str, bool]:
    """A method's name without :data:`SPAN_SUFFIX` and whether it had it: ``"snapkv~span"`` -> ``("snapkv", True)``."""
    if method.endswith(SPAN_SUFFIX):
        return method[: -len(SPAN_SUFFIX)], True
    return method, False


def method_plan(n_layer: int, method: str, budget: int, **kwargs: Any) -> Plan:
    """:func:`uniform_plan` of a uniform method's name (:func:`split_method`: ``"snapkv-head@23"``, ``"adakv"``);
    ``kwargs`` go to :func:`uniform_plan` (``b_min``, ``provenance``, ...)."""
    base, selection, params = split_method(method)
    return uniform_plan(n_layer, base, budget, selection=selection, **params, **kwargs)


def _phase(pattern: str, budget: int | None, params: Mapping[str, Any], selection: str = "layer") -> PhasePlan:
    pattern = pattern.lower()
    if selection not in SELECTIONS:
        raise PlanError(f"selection must be one of {', '.join(SELECTIONS)} (got {selection!r})")
    if pattern not in KNOWN_PATTERNS:
        raise PlanError(f"unknown pattern {pattern!r} (known: {', '.join(KNOWN_PATTERNS)})")
    unknown = set(params) - set(_PARAM_KEYS)
    if unknown:
        raise PlanError(f"unknown pattern parameter(s) {', '.join(sorted(unknown))}")
    if pattern == FULLKV:
        return PhasePlan(FULLKV)
    p = {**DEFAULT_PARAMS.get(pattern, {}), **params}
    return PhasePlan(pattern, budget=budget, n_sink=p.get("n_sink") or 0, window=p.get("window"),
                     obs_window=p.get("obs_window"), pool_kernel=p.get("pool_kernel"),
                     pool_shift=p.get("pool_shift") or None, selection=selection if pattern in PER_HEAD_PATTERNS else "layer")


def uniform_plan(n_layer: int, pattern: str, budget: int, *, decode_pattern: str | None = None,
                 b_min: int | None = None, provenance: Provenance | None = None, selection: str = "layer",
                 allocation: str = "plan", protect_tail: int = 0, **params: Any) -> Plan:
    """Every layer and both phases use ``pattern`` with ``budget`` tokens (the single-pattern baselines).

    ``params`` (n_sink, window, obs_window, pool_kernel) override :data:`DEFAULT_PARAMS` of the pattern.
    ``decode_pattern`` (default: ``pattern``; :data:`DECODE_AFTER_PREFILL_ONLY` after a prefill-only pattern such
    as kvzip) lets the decode phase differ, e.g. ``"fullkv"`` for prefill-only compression as in KVCache-Factory. For ``pattern="fullkv"`` pass the context length as
    ``budget``: it becomes ``budget_avg`` and ``full_charge``. ``b_min`` defaults to the tokens the patterns
    always keep (``n_sink + window``), so that :meth:`Plan.scaled` keeps a uniform plan uniform.
    ``selection="head"``: each KV head keeps its own ``budget`` tokens (score-based patterns).
    ``allocation="prompt"``: ``budget`` is the average; each prompt's scores split the total (:attr:`Plan.allocation`).
    ``protect_tail``: the prompt's last tokens kept on top of ``budget`` (:attr:`Plan.protect_tail`).
    """
    if not _is_int(n_layer) or n_layer < 1:
        raise PlanError(f"n_layer must be a positive integer (got {n_layer!r})")
    if not _is_int(budget) or budget < 1:
        raise PlanError(f"budget must be a positive integer (got {budget!r})")
    pre = _phase(pattern, budget, params, selection)
    if not pre.is_full and pre.reserved > budget:
        raise PlanError(f"{pre.pattern}: n_sink + window = {pre.reserved} exceeds the budget {budget}")
    default_dec = DECODE_AFTER_PREFILL_ONLY if pattern.lower() in PREFILL_ONLY_PATTERNS else pattern
    dec_name = (decode_pattern or default_dec).lower()
    dec_params = params if dec_name == pattern.lower() else {}
    has_full = pre.is_full or dec_name == FULLKV
    layers = [LayerPlan(i, replace(pre), _phase(dec_name, budget, dec_params, selection)) for i in range(n_layer)]
    if b_min is None:
        b_min = max(pp.reserved for pp in (layers[0].prefill, layers[0].decode) if not pp.is_full) \
            if not (layers[0].prefill.is_full and layers[0].decode.is_full) else 0
    plan = Plan(version=PLAN_FORMAT_VERSION, n_layer=n_layer, budget_avg=budget,
                b_min=b_min, budget_rule="uniform", layers=layers,
                provenance=provenance or Provenance.now(), exact_total=True,
                full_charge=budget if has_full else None, allocation=allocation, protect_tail=protect_tail)
    return plan.validate()


def pyramid_plan(n_layer: int, budget: int, *, pattern: str = "pyramidkv", beta: int = 20,
                 window: int | None = None, decode_pattern: str | None = None,
                 provenance: Provenance | None = None, selection: str = "layer", **params: Any) -> Plan:
    """PyramidKV budgets: linear over depth, largest at layer 0, as in KVCache-Factory.

    With ``w`` the always-kept tokens (``n_sink + window``; window = the observation window for
    snapkv/pyramidkv) and ``B`` = ``budget`` (average tokens per layer, ``w`` included), KVCache-Factory
    uses ``min = (B - w) / beta`` and ``max = 2 (B - w) - min`` for the selected (non-window) tokens of the
    last and first layer, linearly in between; each layer keeps that plus ``w``. Here the same line is
    rounded by largest remainder so the total is exactly ``n_layer * B`` (KVCache-Factory floors and loses
    a few tokens), and ``b_min = w`` so that :meth:`Plan.scaled` maps a pyramid plan onto the pyramid plan
    of the new budget. KVCache-Factory's clamp of ``max`` to the prompt length is not applied (plans do not
    know the prompt); budgets above the context are capped at run time by :meth:`Plan.resolved_budgets`.
    """
    if not _is_int(n_layer) or n_layer < 1:
        raise PlanError(f"n_layer must be a positive integer (got {n_layer!r})")
    if not _is_int(beta) or beta < 1:
        raise PlanError(f"beta must be a positive integer (got {beta!r})")
    if window is not None:
        params = {**params, "window": window}
        if pattern.lower() in OBS_WINDOW_PATTERNS:
            params.setdefault("obs_window", window)
    proto = _phase(pattern, budget, params, selection)
    if proto.is_full:
        raise PlanError("pyramid_plan needs a budgeted pattern, not fullkv")
    w = proto.reserved
    if not _is_int(budget) or budget <= w:
        raise PlanError(f"budget {budget!r} must exceed the always-kept tokens n_sink + window = {w}")
    a = Fraction(budget - w)
    lo = a / beta
    hi = 2 * a - lo
    if n_layer == 1:
        weights = [a]
    else:
        weights = [hi - (hi - lo) * i / (n_layer - 1) for i in range(n_layer)]
    budgets = [w + x for x in largest_remainder(weights, n_layer * (budget - w))]
    default_dec = DECODE_AFTER_PREFILL_ONLY if pattern.lower() in PREFILL_ONLY_PATTERNS else pattern
    dec_name = (decode_pattern or default_dec).lower()
    dec_params = params if dec_name == pattern.lower() else {}
    layers = []
    for i, b in enumerate(budgets):
        pre = replace(proto, budget=b)
        dec = _phase(dec_name, b, dec_params, selection)
        layers.append(LayerPlan(i, pre, dec))
    if dec_name != pattern.lower() and dec_name != FULLKV:
        # decode uses another pattern with the same budgets; its reserved tokens must fit too
        for lp in layers:
            if lp.decode.reserved > lp.decode.budget:  # type: ignore[operator]
                raise PlanError(f"layer {lp.layer} decode: {dec_name} keeps {lp.decode.reserved} tokens always, "
                                f"more than its budget {lp.decode.budget}")
    plan = Plan(version=PLAN_FORMAT_VERSION, n_layer=n_layer, budget_avg=budget, b_min=w, budget_rule="pyramid",
                layers=layers, provenance=provenance or Provenance.now(extra={"beta": beta}), exact_total=True,
                full_charge=None)
    if dec_name == FULLKV:
        plan.full_charge = budget  # decode all-FullKV: no total to meet; keep the field meaningful
    return plan.validate()


# ----------------------------------------------------------------------------------------- GGUF I/O

_GGUF_MAGIC = b"GGUF"
# GGUF value types (gguf spec): 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array,
# 10 u64, 11 i64, 12 f64
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_T_STRING, _T_ARRAY, _T_UINT32 = 8, 9, 4


@dataclass(frozen=True)
class _Array:
    """An array-valued GGUF key as returned by :func:`read_gguf_metadata`: element type and length only."""

    item_type: int
    length: int


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a GGUF file, fast: scalars and strings are decoded, arrays are reported as an
    object with ``item_type`` and ``length`` (their items are skipped). Tensors are not read.

    Raises PlanError for a missing file or one that is not a GGUF (v2/v3).
    """
    return _read_layout(path).values


@dataclass
class _Layout:
    """What a GGUF header says: decoded values, raw value bytes per key, tensor infos, data offset."""

    version: int
    values: dict[str, Any]
    raw: dict[str, tuple[int, bytes]]  # key -> (type, raw value bytes) ; only filled with want_raw
    tensors: list[tuple[str, tuple[int, ...], int, int]]  # (name, dims, ggml type, offset in data section)
    alignment: int
    data_offset: int
    file_size: int


def _read_layout(path: str | os.PathLike, want_raw: bool = False) -> _Layout:
    p = Path(path)
    try:
        f = open(p, "rb")
    except FileNotFoundError:
        raise PlanError(f"file not found: {p}") from None
    except OSError as e:
        raise PlanError(f"cannot open {p}: {e}") from None
    with f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise PlanError(f"{p} is not a GGUF file (empty)") from None
        with mm:
            try:
                return _parse_layout(mm, p, want_raw)
            except (struct.error, IndexError, ValueError, OverflowError) as e:
                raise PlanError(f"{p} is not a readable GGUF file (truncated or corrupt header: {e})") from None


def _parse_layout(buf: mmap.mmap, path: Path, want_raw: bool) -> _Layout:
    if buf[:4] != _GGUF_MAGIC:
        raise PlanError(f"{path} is not a GGUF file (bad magic)")
    end = "<"
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:
        end = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise PlanError(f"{path}: unsupported GGUF version {version}")
    n_tensors, n_kv = struct.unpack_from(end + "QQ", buf, 8)
    off = 24
    size = len(buf)

    def read_str(o: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from(end + "Q", buf, o)
        o += 8
        if o + n > size:
            raise ValueError("string runs past the end of the file")
        return buf[o:o + n], o + n

    def skip_value(t: int, o: int) -> int:
        if t in _SCALAR_FMT:
            return o + struct.calcsize(_SCALAR_FMT[t])
        if t == _T_STRING:
            (n,) = struct.unpack_from(end + "Q", buf, o)
            return o + 8 + n
        if t == _T_ARRAY:
            it, n = struct.unpack_from(end + "IQ", buf, o)
            o += 12
            if it in _SCALAR_FMT:
                return o + n * struct.calcsize(_SCALAR_FMT[it])
            for _ in range(n):
                o = skip_value(it, o)
            return o
        raise ValueError(f"unknown value type {t}")

    values: dict[str, Any] = {}
    raw: dict[str, tuple[int, bytes]] = {}
    for _ in range(n_kv):
        kb, off = read_str(off)
        key = kb.decode("utf-8", errors="replace")
        if key in values:
            raise ValueError(f"duplicate key {key!r}")
        (t,) = struct.unpack_from(end + "I", buf, off)
        off += 4
        if t in _SCALAR_FMT:
            (values[key],) = struct.unpack_from(end + _SCALAR_FMT[t], buf, off)
        elif t == _T_STRING:
            sb, _ = read_str(off)
            values[key] = sb.decode("utf-8", errors="replace")
        elif t == _T_ARRAY:
            it, n = struct.unpack_from(end + "IQ", buf, off)
            values[key] = _Array(it, n)
        else:
            raise ValueError(f"key {key!r} has unknown value type {t}")
        nxt = skip_value(t, off)
        if nxt > size:
            raise ValueError("metadata runs past the end of the file")
        if want_raw:
            raw[key] = (t, buf[off:nxt])
        off = nxt
    tensors = []
    for _ in range(n_tensors):
        nb, off = read_str(off)
        (nd,) = struct.unpack_from(end + "I", buf, off)
        off += 4
        dims = struct.unpack_from(end + "Q" * nd, buf, off)
        off += 8 * nd
        ttype, toff = struct.unpack_from(end + "IQ", buf, off)
        off += 12
        tensors.append((nb.decode("utf-8", errors="replace"), tuple(dims), ttype, toff))
    align = values.get("general.alignment", 32)
    if not _is_int(align) or align <= 0 or align & (align - 1):
        raise ValueError(f"bad general.alignment {align!r}")
    data_offset = -(-off // align) * align
    return _Layout(version, values, raw, tensors, align, data_offset, size)


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def read_gguf(path: str | os.PathLike, *, validate: bool = True, key: str = GGUF_KEY_PLAN) -> Plan | None:
    """The plan stored in a GGUF under ``key`` (``polykv.plan``; or ``polykv.plan_query_agnostic``), or None if it
    has none.

    With ``validate`` the plan is checked against the GGUF's block count. Raises PlanError for a missing or
    non-GGUF file, a ``polykv.version`` other than 1, a non-string plan key or an invalid plan.
    """
    kv = read_gguf_metadata(path)
    if key not in kv:
        return None
    ver = kv.get(GGUF_KEY_VERSION)
    if ver is not None and ver != PLAN_FORMAT_VERSION:
        raise PlanError(f"{path}: {GGUF_KEY_VERSION} is {ver!r}; this polykv-cpp reads plan format "
                        f"{PLAN_FORMAT_VERSION}")
    text = kv[key]
    if not isinstance(text, str):
        raise PlanError(f"{path}: {key} must be a STRING key holding the plan's JSON")
    try:
        plan = Plan.from_json(text)
        if validate:
            arch = kv.get("general.architecture")
            n = kv.get(f"{arch}.block_count") if isinstance(arch, str) else None
            plan.validate(n if _is_int(n) else None)
    except PlanError as e:
        raise PlanError(f"{path}: {key}: {e}") from None
    return plan


def gguf_plan_key(meta: Mapping[str, Any], protocol: str) -> str | None:
    """The key of the plan a GGUF holds for ``protocol`` ("query-aware": the question is in the compressed prompt;
    "query-agnostic": the prompt is compressed before its question exists), None if it holds no plan. ``meta``:
    the GGUF's metadata (a mapping; only the plan keys are read). Query-agnostic prefers ``polykv.plan_query_agnostic`` and falls back to ``polykv.plan``, the plan of every
    other use."""
    if protocol not in GGUF_PLAN_KEYS:
        raise PlanError(f"protocol must be one of {', '.join(GGUF_PLAN_KEYS)} (got {protocol!r})")
    for key in dict.fromkeys((GGUF_PLAN_KEYS[protocol], GGUF_KEY_PLAN)):
        if meta.get(key):
            return key
    return None


def load(path: str | os.PathLike, *, validate: bool = True, n_layer: int | None = None) -> Plan:
    """Load a plan from a sidecar JSON file or from a GGUF (recognised by its magic bytes, whatever the
    extension). Raises PlanError for a missing file, malformed JSON, a GGUF without a plan, or (with
    ``validate``) an invalid plan; ``n_layer`` is passed to :meth:`Plan.validate`."""
    p = Path(path)
    if not p.exists():
        raise PlanError(f"plan file not found: {p}")
    if p.is_dir():
        raise PlanError(f"{p} is a directory, not a plan file")
    if _is_gguf(p):
        plan = read_gguf(p, validate=validate)
        if plan is None:
            raise PlanError(f"{p} is a GGUF without a PolyKV plan (no {GGUF_KEY_PLAN} key)")
    else:
        try:
            text = p.read_bytes()
        except OSError as e:
            raise PlanError(f"cannot read {p}: {e}") from None
        plan = Plan.from_json(text)
    if validate:
        plan.validate(n_layer)
    return plan


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def write_gguf(src_path: str | os.PathLike, dst_path: str | os.PathLike, plan: Plan, *, progress: bool = False,
               verify: bool = True, query_agnostic_plan: Plan | None = None) -> Path:
    """Write a NEW GGUF ``dst_path`` = the model ``src_path`` plus the plan; the source is never modified.

    All metadata of the source is copied with its types (existing ``polykv.*`` keys are dropped: they
    belong to the plan being replaced), then ``polykv.version`` (UINT32 1) and ``polykv.plan`` (STRING,
    compact JSON) are appended, and ``polykv.plan_query_agnostic`` with ``query_agnostic_plan``: the plan for
    prompts compressed before their question exists (:func:`gguf_plan_key`). Tensors are copied byte for byte
    (quantized blocks are not touched) with the source's alignment and byte order. The file is written under a temporary name next to ``dst_path`` and
    renamed into place. With ``verify`` the result is read back and compared with the source (every key,
    every tensor's type, shape and bytes) and checked against the layout rules of llama.cpp's GGUF reader
    (aligned data section and tensor offsets, tensors inside the file); on failure it is deleted.

    Raises PlanError: ``dst_path`` is the source, the source is missing or not a GGUF, the plan is invalid
    or does not fit the model, or a metadata value cannot be copied (empty or nested arrays).
    """
    import gguf

    src, dst = Path(src_path), Path(dst_path)
    if not src.is_file():
        raise PlanError(f"source GGUF not found: {src}")
    if _same_file(src, dst):
        raise PlanError(f"refusing to overwrite the source model {src}; write the plan into a new file")
    if not _is_gguf(src):
        raise PlanError(f"{src} is not a GGUF file")
    info = ModelInfo.from_gguf(src)
    plan.validate()
    plan.check_model(info)
    if query_agnostic_plan is not None:
        try:
            query_agnostic_plan.validate()
            query_agnostic_plan.check_model(info)
        except PlanError as e:
            raise PlanError(f"the query-agnostic plan: {e}") from None

    reader = gguf.GGUFReader(src, "r")
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise PlanError(f"{src} has no general.architecture key")
    arch = arch_field.contents()
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
        writer.data_alignment = int(reader.alignment)
        for name, fld in reader.fields.items():
            if name.startswith("GGUF.") or name == gguf.Keys.General.ARCHITECTURE or name.startswith(GGUF_KEY_PREFIX):
                continue
            value, vtype, sub = _field_value(fld, name)
            writer.add_key_value(name, value, vtype, sub_type=sub)
        writer.add_key_value(GGUF_KEY_VERSION, PLAN_FORMAT_VERSION, gguf.GGUFValueType.UINT32)
        writer.add_key_value(GGUF_KEY_PLAN, plan.to_json(indent=None), gguf.GGUFValueType.STRING)
        if query_agnostic_plan is not None:
            writer.add_key_value(GGUF_KEY_PLAN_QUERY_AGNOSTIC, query_agnostic_plan.to_json(indent=None),
                                 gguf.GGUFValueType.STRING)
        for t in reader.tensors:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(int(t.n_bytes) for t in reader.tensors), unit="B", unit_scale=True,
                       desc=f"writing {dst.name}")
        try:
            for t in reader.tensors:
                writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
                if bar is not None:
                    bar.update(int(t.n_bytes))
        finally:
            if bar is not None:
                bar.close()
        assert writer.fout is not None
        for fo in writer.fout:
            fo.flush()
            os.fsync(fo.fileno())
        writer.close()
        if verify:
            _verify_copy(src, tmp, {GGUF_KEY_PLAN: plan, GGUF_KEY_PLAN_QUERY_AGNOSTIC: query_agnostic_plan})
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        del reader
    return dst


def embed_plans(src_path: str | os.PathLike, dst_path: str | os.PathLike, *, plan: Plan | None = None,
                query_agnostic_plan: Plan | None = None, progress: bool = False) -> Path:
    """:func:`write_gguf` that replaces only the plans given: a key not given keeps the source's plan under it
    (calibrating one protocol leaves the other's plan in place). Without any ``polykv.plan`` (none given, none in
    the source) a query-agnostic plan becomes the model's only plan, ``polykv.plan``, the one stock tools read."""
    if plan is None and query_agnostic_plan is None:
        raise PlanError("nothing to write: give a plan, a query-agnostic plan or both")
    src = Path(src_path)
    if plan is None:
        plan = read_gguf(src) if src.is_file() and _is_gguf(src) else None
    if query_agnostic_plan is None and src.is_file() and _is_gguf(src):
        query_agnostic_plan = read_gguf(src, key=GGUF_KEY_PLAN_QUERY_AGNOSTIC)
    if plan is None:
        plan, query_agnostic_plan = query_agnostic_plan, None
    return write_gguf(src, dst_path, plan, query_agnostic_plan=query_agnostic_plan, progress=progress)


def _field_value(fld: Any, name: str) -> tuple[Any, Any, Any]:
    """(value, type, sub_type) of a GGUFReader field, for GGUFWriter.add_key_value, preserving bytes."""
    from gguf import GGUFValueType

    vtype = fld.types[0]
    if vtype == GGUFValueType.STRING:
        return bytes(fld.parts[-1]), vtype, None  # raw bytes: invalid UTF-8 survives
    if vtype == GGUFValueType.ARRAY:
        if len(fld.types) < 2:
            raise PlanError(f"cannot copy metadata key {name!r}: empty arrays are not supported by gguf-py's writer")
        sub = fld.types[1]
        if sub == GGUFValueType.ARRAY:
            raise PlanError(f"cannot copy metadata key {name!r}: nested arrays are not supported")
        if sub == GGUFValueType.STRING:
            return [bytes(fld.parts[i]) for i in fld.data], vtype, sub
        return [fld.parts[i].tolist()[0] for i in fld.data], vtype, sub
    return fld.parts[-1].tolist()[0], vtype, None


def _check_llama_layout(lay: _Layout, path: Path, quant_sizes: Mapping[Any, tuple[int, int]]) -> list[int]:
    """The layout rules of llama.cpp's GGUF reader (ggml/src/gguf.cpp, gguf_init_from_file_impl) that a
    copy could break; returns each tensor's size in bytes. Raises PlanError on the first violation."""
    if lay.version != 3:
        raise PlanError(f"{path}: GGUF version {lay.version}, llama.cpp writes and expects 3")
    if any(not k for k in lay.values):
        raise PlanError(f"{path}: empty metadata key")
    sizes, names, expect = [], set(), 0
    for name, dims, ttype, toff in lay.tensors:
        if not name or len(name.encode()) >= 64:  # GGML_MAX_NAME
            raise PlanError(f"{path}: tensor name {name!r} is empty or too long for llama.cpp")
        if name in names:
            raise PlanError(f"{path}: duplicate tensor {name!r}")
        names.add(name)
        if len(dims) > 4:
            raise PlanError(f"{path}: tensor {name!r} has {len(dims)} dimensions (llama.cpp allows 4)")
        try:
            bs, ts = quant_sizes[ttype]
        except KeyError:
            raise PlanError(f"{path}: tensor {name!r} has an unknown ggml type {ttype}") from None
        if dims and dims[0] % bs:
            raise PlanError(f"{path}: tensor {name!r}: row of {dims[0]} elements is not a multiple of the block "
                            f"size {bs}")
        n = math.prod(dims) // bs * ts
        if toff != expect:
            raise PlanError(f"{path}: tensor {name!r} has offset {toff}, expected {expect} (alignment "
                            f"{lay.alignment})")
        expect += -(-n // lay.alignment) * lay.alignment
        if lay.data_offset + toff + n > lay.file_size:
            raise PlanError(f"{path}: tensor {name!r} runs past the end of the file")
        sizes.append(n)
    return sizes


def _verify_copy(src: Path, out_path: Path, plans: Mapping[str, Plan | None]) -> None:
    """Compare the written file with its source: every non-polykv key's type and raw value bytes, the
    polykv keys, every tensor's name, shape, type and bytes; and llama.cpp's layout rules."""
    from gguf import GGML_QUANT_SIZES

    a = _read_layout(src, want_raw=True)
    b = _read_layout(out_path, want_raw=True)
    want = {k: v for k, v in a.raw.items() if not k.startswith(GGUF_KEY_PREFIX)}
    have = {k: v for k, v in b.raw.items() if k != GGUF_KEY_VERSION and k not in plans}
    if set(want) != set(have):
        raise PlanError(f"metadata keys differ after the copy (missing {sorted(set(want) - set(have))}, "
                        f"unexpected {sorted(set(have) - set(want))})")
    for k, v in want.items():
        if have[k] != v:
            raise PlanError(f"metadata key {k!r} changed during the copy")
    if b.raw.get(GGUF_KEY_VERSION, (None,))[0] != _T_UINT32 or b.values.get(GGUF_KEY_VERSION) != PLAN_FORMAT_VERSION:
        raise PlanError(f"{GGUF_KEY_VERSION} was not written as UINT32 {PLAN_FORMAT_VERSION}")
    for key, plan in plans.items():
        text = b.values.get(key)
        if plan is None:
            if key in b.raw:
                raise PlanError(f"{key} was written without a plan")
            continue
        if b.raw.get(key, (None,))[0] != _T_STRING or not isinstance(text, str) \
                or Plan.from_json(text).to_dict() != plan.to_dict():
            raise PlanError(f"{key} does not read back as the plan")
    if [(n, d, t) for n, d, t, _ in a.tensors] != [(n, d, t) for n, d, t, _ in b.tensors]:
        raise PlanError("tensor names, shapes or types changed during the copy")
    sizes = _check_llama_layout(b, out_path, GGML_QUANT_SIZES)
    with open(src, "rb") as fa, open(out_path, "rb") as fb, \
            mmap.mmap(fa.fileno(), 0, access=mmap.ACCESS_READ) as ma, \
            mmap.mmap(fb.fileno(), 0, access=mmap.ACCESS_READ) as mb:
        for (name, _, _, oa), (_, _, _, ob), n in zip(a.tensors, b.tensors, sizes):
            pa, pb = a.data_offset + oa, b.data_offset + ob
            for o in range(0, n, 1 << 24):
                k = min(1 << 24, n - o)
                if ma[pa + o:pa + o + k] != mb[pb + o:pb + o + k]:
                    raise PlanError(f"tensor {name!r} bytes differ after the copy")


# ----------------------------------------------------------------------------------------------- CLI

#: The ``plan`` sub-command's subparsers object, set by :func:`register_cli` so other modules can add
#: sub-commands (e.g. ``plan show``).
PLAN_SUBPARSERS: Any = None


def _cmd_validate(args: argparse.Namespace) -> int:
    p = Path(args.file)
    n_layer = args.n_layer
    if n_layer is None and p.is_file() and _is_gguf(p):
        info = ModelInfo.from_gguf(p)
        n_layer = info.n_layer
    plan = load(p, validate=True, n_layer=n_layer)
    print(f"OK: {plan.summary()}")
    if p.is_file() and _is_gguf(p):
        second = read_gguf(p, key=GGUF_KEY_PLAN_QUERY_AGNOSTIC)
        if second is not None:
            second.validate(n_layer)
            print(f"OK ({GGUF_KEY_PLAN_QUERY_AGNOSTIC}): {second.summary()}")
    return 0


def _cmd_write(args: argparse.Namespace) -> int:
    plan = load(args.plan) if args.plan else None
    qag = load(args.query_agnostic_plan) if args.query_agnostic_plan else None
    out = embed_plans(args.model, args.out, plan=plan, query_agnostic_plan=qag, progress=not args.quiet)
    print(f"wrote {out}")
    for key in (GGUF_KEY_PLAN, GGUF_KEY_PLAN_QUERY_AGNOSTIC):
        got = read_gguf(out, key=key)
        if got is not None:
            print(f"  {key}: {got.summary()}")
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``plan validate FILE [--n-layer N]`` to an argparse subparsers object and publish the ``plan``
    sub-subparsers as :data:`PLAN_SUBPARSERS`."""
    global PLAN_SUBPARSERS
    p = subparsers.add_parser("plan", help="inspect and check PolyKV plans",
                              description="Inspect and check PolyKV plans (JSON sidecar files or GGUFs with "
                                          f"{GGUF_KEY_PLAN}).")
    sub = p.add_subparsers(dest="plan_cmd", metavar="COMMAND")
    sub.required = True
    pv = sub.add_parser("validate", help="check a plan file or a GGUF's plan; print OK and a summary",
                        description="Check a plan (JSON or GGUF). For a GGUF the plan is checked against the "
                                    "model's layer count unless --n-layer is given.")
    pv.add_argument("file", metavar="FILE", help="plan .json or .gguf")
    pv.add_argument("--n-layer", type=int, default=None, metavar="N", help="expected number of layers")
    pv.set_defaults(func=_cmd_validate)
    pw = sub.add_parser("write", help="write a new GGUF: a model plus plans from JSON files (the source is kept)",
                        description=f"Copy MODEL to OUT with the plans given: --plan as {GGUF_KEY_PLAN} (what every "
                                    f"tool uses), --query-agnostic-plan as {GGUF_KEY_PLAN_QUERY_AGNOSTIC} (what "
                                    "`run --question` and examples/chat.py use: the prompt is compressed before "
                                    "its question exists). A plan not given keeps MODEL's own. MODEL is never "
                                    "modified.")
    pw.add_argument("model", metavar="MODEL", help="source GGUF")
    pw.add_argument("out", metavar="OUT", help="new GGUF to write (not MODEL)")
    pw.add_argument("--plan", metavar="FILE", help=f"plan (JSON or GGUF) for {GGUF_KEY_PLAN}")
    pw.add_argument("--query-agnostic-plan", metavar="FILE",
                    help=f"plan (JSON or GGUF) for {GGUF_KEY_PLAN_QUERY_AGNOSTIC}")
    pw.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    pw.set_defaults(func=_cmd_write)
    PLAN_SUBPARSERS = sub
