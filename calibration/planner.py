"""Plan construction from calibration signals.

Per (layer, phase): the candidate pattern with the best preference signal (highest; ties: the first in
candidate order). Budgets per phase over the non-FullKV layers, total exactly ``n_layer * budget``:

* ``sensitivity`` (default): ``b[l] = b_min + (pool - n*b_min) * s[l] / sum(s)``, largest remainder;
* ``uniform``: the same with equal weights (``budget`` each when nothing is FullKV);
* ``pyramid``: KVCache-Factory's line over depth above ``b_min``: weights from ``hi = 2a - a/beta`` at layer 0
  down to ``lo = a/beta`` at the last layer (``a = budget - b_min``), largest remainder.

``pool = n_layer * budget - n_full * full_charge``: a FullKV layer is charged ``full_charge`` tokens (the
calibration context length). FullKV is chosen only when it is a candidate, for layers whose best compressed
preference is below ``fullkv_below``, worst first, while every other layer can still get ``b_min``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Mapping, Sequence

import numpy as np

from polykv_cpp import patterns as P
from polykv_cpp.errors import CalibrationError

BUDGET_RULES = ("sensitivity", "uniform", "pyramid")


def phase_plan_for(pattern: P.Pattern, budget: int | None):
    """A plan.PhasePlan carrying the pattern's parameters (windows shrunk to fit the budget)."""
    from polykv_cpp import plan as plan_mod

    name = pattern.name
    if name == "fullkv":
        return plan_mod.PhasePlan("fullkv")
    assert budget is not None
    n_sink = int(getattr(pattern, "n_sink", 0) or 0)
    window = getattr(pattern, "window", None)
    obs = getattr(pattern, "obs_window", None) if name in ("snapkv", "pyramidkv") else None
    pk = getattr(pattern, "pool_kernel", None) if name in plan_mod.POOLED_PATTERNS else None
    if name not in ("snapkv", "pyramidkv") and pk == 1:
        pk = None  # no pooling: the plan leaves the key out, as before pooling applied to them
    shift = (getattr(pattern, "pool_shift", 0) or None) if pk is not None else None
    if name == "streamingllm":
        window = None
        n_sink = min(n_sink, max(0, budget - 1))
    else:
        n_sink = min(n_sink, budget)
        room = budget - n_sink
        if window is not None:
            window = min(window, room)
        if obs is not None:
            obs = max(1, min(obs, room))
    return plan_mod.PhasePlan(name, budget=budget, n_sink=n_sink, window=window, obs_window=obs, pool_kernel=pk,
                                 pool_shift=shift)


def pyramid_weights(n: int, budget: int, b_min: int, beta: int = 20) -> list[Fraction]:
    a = Fraction(max(0, budget - b_min))
    lo = a / beta
    hi = 2 * a - lo
    if n == 1:
        return [a]
    return [hi - (hi - lo) * i / (n - 1) for i in range(n)]


def allocate(rule: str, n: int, total: int, b_min: int, sens: Sequence[float], budget: int) -> list[int]:
    from polykv_cpp import plan as plan_mod

    if rule == "sensitivity":
        w = [max(0.0, float(x)) for x in sens]
        if not np.all(np.isfinite(w)):
            raise CalibrationError("sensitivity signal has non-finite values")
    elif rule == "uniform":
        w = [1.0] * n
    elif rule == "pyramid":
        w = pyramid_weights(n, budget, b_min)
    else:
        raise CalibrationError(f"unknown budget rule {rule!r} (known: {', '.join(BUDGET_RULES)})")
    return plan_mod.allocate_budgets(total, w, b_min)


def choose_patterns(pref: np.ndarray, names: Sequence[str]) -> list[str]:
    """argmax over candidates (ties: first in order); FullKV excluded (handled by ``fullkv_below``)."""
    idx = [i for i, n in enumerate(names) if n != "fullkv"]
    if not idx:
        return ["fullkv"] * pref.shape[0]
    sub = pref[:, idx]
    return [names[idx[int(np.argmax(sub[l]))]] for l in range(pref.shape[0])]


def build_plan(*, n_layer: int, budget: int, b_min: int, names: Sequence[str],
               pref: Mapping[str, np.ndarray], sens: Mapping[str, np.ndarray], rule: str,
               patterns: Mapping[str, P.Pattern], full_charge: int, fullkv_below: float = 0.9,
               provenance: Any = None, full_score: Mapping[str, np.ndarray] | None = None):
    """The plan (``polykv_cpp.plan.Plan``). ``pref[phase]``: [L, R] (higher = better); ``sens[phase]``: [L].
    ``full_score[phase]`` ([L, R] cosine, default ``pref``) is what ``fullkv_below`` is compared with."""
    from polykv_cpp import plan as plan_mod

    phases: dict[str, list] = {}
    for ph in plan_mod.PHASES:
        pr = np.asarray(pref[ph], dtype=np.float64)
        chosen = choose_patterns(pr, names)
        if "fullkv" in names:
            fs = np.asarray((full_score or pref)[ph], dtype=np.float64)
            best = np.array([fs[l, list(names).index(c)] if c != "fullkv" else 1.0 for l, c in enumerate(chosen)])
            for l in np.argsort(best, kind="stable"):
                if best[l] >= fullkv_below:
                    break
                n_full = sum(c == "fullkv" for c in chosen) + 1
                if n_layer * budget - n_full * full_charge < (n_layer - n_full) * b_min or n_full == n_layer:
                    break
                chosen[int(l)] = "fullkv"
        budgeted = [l for l in range(n_layer) if chosen[l] != "fullkv"]
        n_full = n_layer - len(budgeted)
        total = n_layer * budget - n_full * full_charge
        s = np.asarray(sens[ph], dtype=np.float64)
        bud = allocate(rule, len(budgeted), total, b_min, [s[l] for l in budgeted], budget) if budgeted else []
        b_of = dict(zip(budgeted, bud))
        phases[ph] = [phase_plan_for(patterns[chosen[l]], b_of.get(l)) for l in range(n_layer)]
    layers = [plan_mod.LayerPlan(l, phases["prefill"][l], phases["decode"][l]) for l in range(n_layer)]
    any_full = any(pp.is_full for ph in phases.values() for pp in ph)
    plan = plan_mod.Plan(version=plan_mod.PLAN_FORMAT_VERSION, n_layer=n_layer, budget_avg=budget, b_min=b_min,
                         budget_rule=rule, layers=layers,
                         provenance=provenance if provenance is not None else plan_mod.Provenance.now(),
                         exact_total=True, full_charge=full_charge if any_full else None)
    return plan.validate()
