"""Runtime calibration: measure plans on the GGUF itself, through the native PolyKV cache.

``polykv-cpp calibrate --method runtime`` needs no Hugging Face checkpoint and no torch. The signal is the one
the evaluation reports: the KL divergence of the model's next-token distributions from FullKV's, on the
continuation of calibration texts whose context was compressed (``docs/calibration.md``):

* every calibration sample (``ctx`` tokens) is split into a context (``ctx - n_cont`` tokens) and a
  continuation (``n_cont`` tokens). The context is prefilled ONCE in a portable FullKV context (native
  portable prefill: the cache and the attention statistics of every pattern), the continuation gives the
  FullKV reference distributions;
* measuring a plan = load each context into a portable context with that plan, compress it (exactly as the
  runtime does after a prompt), feed the continuation as one batch and average KL(FullKV || plan) over its
  tokens. That costs one continuation forward per sample, no prefill;
* construction (a greedy coordinate search, offline, once): start from the best uniform single-pattern plan
  at ``budget``; per layer, the pattern with the lowest joint KL given the other layers (the pattern
  preference, measured with every layer compressed, not one layer alone); then move budget between layers
  (a layer gets ``budget/2`` more or less, the others pay or receive in proportion to what they hold above
  ``b_min``) where the KL drops. A change is kept when it lowers the KL by more than ``min_gain`` (relative).

Limits: the search measures the prefill phase (the decode phase uses each layer's prefill pattern and budget);
the plan fits the calibration texts and the budget it was searched at (other budgets rescale it with
``Plan.scaled``); every measured plan costs ``samples x n_cont`` tokens of forward, so the search is about
``(1 + n_pattern) x n_layer`` plan measurements (Qwen2.5-0.5B, 4 samples: ~10 minutes on 2 CPU cores).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from polykv_cpp.errors import CalibrationError

DEFAULT_SAMPLES = 4
DEFAULT_MIN_GAIN = 0.01


@dataclass
class SearchStep:
    what: str
    kl: float
    accepted: bool


@dataclass
class RuntimeCalibration:
    plan: Any
    out: Path | None
    kl_uniform: dict[str, float]
    kl_plan: float
    steps: list[SearchStep] = field(default_factory=list)
    n_measured: int = 0
    wall_s: float = 0.0


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def move_budget(budgets: Sequence[int], layer: int, delta: int, b_min: int) -> list[int] | None:
    """Give ``layer`` ``delta`` more tokens (negative: fewer), the other layers paying or receiving in
    proportion to what they hold above ``b_min``; the total stays exact. None if it cannot be done."""
    from polykv_cpp.plan import largest_remainder

    b = list(budgets)
    if b[layer] + delta < b_min:
        return None
    others = [j for j in range(len(b)) if j != layer]
    if delta > 0:
        weights = [b[j] - b_min for j in others]
        if sum(weights) < delta:
            return None
    else:
        weights = [1] * len(others)
    shares = largest_remainder(weights, abs(delta))
    for j, s in zip(others, shares):
        b[j] += -s if delta > 0 else s
    b[layer] += delta
    if min(b) < b_min:
        return None
    return b


class _Measure:
    """Contexts prefilled once (portable) and the FullKV reference of their continuations."""

    def __init__(self, model, samples: list[list[int]], n_cont: int, n_threads: int | None, progress: bool):
        from polykv_cpp import plan as plan_mod

        self.model = model
        self.n_layer = model.n_layer
        T = max(len(s) for s in samples)
        self.n_ctx = int(np.ceil((T + 1) / 256) * 256)
        self.n_cont = n_cont
        self.n_threads = n_threads
        self.n_measured = 0
        self.items: list[tuple[Any, list[int], np.ndarray]] = []
        full = plan_mod.uniform_plan(self.n_layer, plan_mod.FULLKV, self.n_ctx)
        model.set_plan(full, prefill="portable")
        it = samples
        if progress:
            from tqdm import tqdm
            it = tqdm(samples, desc="prefill (once)", unit="sample", file=sys.stderr)
        with self._context() as ctx:
            for s in it:
                ctx.clear()
                ctx.decode(s[:-n_cont])
                snap = ctx.snapshot()
                ctx.decode(s[-n_cont:], all_logits=True)
                ref = _log_softmax(np.stack([ctx.logits(i) for i in range(n_cont)]))
                self.items.append((snap, s[-n_cont:], ref))

    def _context(self):
        return self.model.context(n_ctx=self.n_ctx, n_batch=max(512, self.n_cont), n_ubatch=512,
                                  n_threads=self.n_threads)

    def kl(self, plan) -> float:
        """Mean KL(FullKV || plan) in nats per continuation token, over all samples."""
        self.model.set_plan(plan, prefill="portable")
        total = 0.0
        with self._context() as ctx:
            for snap, cont, ref in self.items:
                ctx.restore(snap)
                ctx.compress_prompt()
                ctx.decode(cont, all_logits=True)
                lp = _log_softmax(np.stack([ctx.logits(i) for i in range(len(cont))]))
                total += float(np.mean(np.sum(np.exp(ref) * (ref - lp), axis=-1, dtype=np.float64)))
        self.n_measured += 1
        return total / len(self.items)


def build(n_layer: int, patterns: Sequence[str], budgets: Sequence[int], budget: int, b_min: int,
          provenance=None, rule: str = "search"):
    """A plan with `patterns[l]` at `budgets[l]` in both phases (each pattern's default parameters)."""
    from polykv_cpp import plan as plan_mod

    layers = []
    for il, (name, b) in enumerate(zip(patterns, budgets)):
        one = plan_mod.uniform_plan(1, name, int(b), b_min=min(b_min, int(b)))
        layers.append(plan_mod.LayerPlan(il, one.layers[0].prefill, one.layers[0].decode))
    return plan_mod.Plan(version=plan_mod.PLAN_FORMAT_VERSION, n_layer=n_layer, budget_avg=budget, b_min=b_min,
                         budget_rule=rule, layers=layers, provenance=provenance or plan_mod.Provenance.now(),
                         exact_total=True).validate()


def runtime_calibrate(gguf: str | Path, out: str | Path | None, *, budget: int, samples: int = DEFAULT_SAMPLES,
                      ctx: int = 2048, n_cont: int = 128, patterns: Sequence[str] = ("streamingllm", "h2o",
                      "snapkv", "tova", "knorm"), b_min: int | None = None, dataset: str = "builtin",
                      seed: int = 0, text_field: str = "text", split: str = "train", budget_moves: bool = True,
                      min_gain: float = DEFAULT_MIN_GAIN, plan_out: str | Path | None = None,
                      n_threads: int | None = None, progress: bool = True,
                      log: Callable[[str], None] | None = None) -> RuntimeCalibration:
    from polykv_cpp import plan as plan_mod
    from polykv_cpp.api import Model

    from calibration.data import load_calibration_data

    log = log or (lambda m: print(m, file=sys.stderr))
    t0 = time.time()
    gguf = Path(gguf)
    if not gguf.is_file():
        raise CalibrationError(f"model file not found: {gguf}")
    if out is not None and Path(out).resolve() == gguf.resolve():
        raise CalibrationError("--out must be a new file: the model file is never modified in place")
    bad = [p for p in patterns if p not in plan_mod.KNOWN_PATTERNS or p == plan_mod.FULLKV]
    if bad or not patterns:
        raise CalibrationError(f"runtime calibration patterns must be budgeted patterns (got {bad or 'none'})")
    if n_cont < 2 or n_cont >= ctx // 2:
        raise CalibrationError(f"--n-cont must be in [2, ctx/2) (got {n_cont})")
    reserved = max(plan_mod.uniform_plan(1, p, budget).layers[0].prefill.reserved for p in patterns)
    b_min = b_min if b_min is not None else min(budget, max(budget // 4, reserved))
    if not reserved <= b_min <= budget:
        raise CalibrationError(f"b_min {b_min} must be within [{reserved}, {budget}] (sinks + windows of the "
                               "patterns, and the budget)")
    if budget >= ctx - n_cont:
        raise CalibrationError(f"budget {budget} keeps the whole context of {ctx - n_cont} tokens: nothing to "
                               "measure; use a larger --ctx")

    with Model(gguf) as model:
        n_layer = model.n_layer
        data = load_calibration_data(dataset, lambda t: model.tokenize(t, add_special=False, parse_special=False),
                                     ctx=ctx,
                                     n_samples=samples, seed=seed, text_field=text_field, split=split,
                                     tokenizer_desc="the GGUF's own")
        log(f"runtime calibration of {gguf.name}: {n_layer} layers, budget {budget}, b_min {b_min}, "
            f"{samples} samples x {ctx} tokens (continuation {n_cont}), patterns {', '.join(patterns)}")
        m = _Measure(model, data.samples, n_cont, n_threads, progress)
        n_total = len(patterns) + n_layer * (len(patterns) - 1) + (2 * n_layer if budget_moves else 0)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=n_total, desc="search", unit="plan", file=sys.stderr)

        def measure(pats, buds, what) -> float:
            kl = m.kl(build(n_layer, pats, buds, budget, b_min))
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{what}: KL {kl:.4f}")
            return kl

        steps: list[SearchStep] = []
        uniform = {p: measure([p] * n_layer, [budget] * n_layer, f"uniform {p}") for p in patterns}
        best = min(uniform, key=uniform.get)  # type: ignore[arg-type]
        pats, buds, cur = [best] * n_layer, [budget] * n_layer, uniform[best]
        steps.append(SearchStep(f"start: uniform {best}", cur, True))
        for il in range(n_layer):
            for p in patterns:
                if p == pats[il]:
                    continue
                cand = pats[:il] + [p] + pats[il + 1:]
                kl = measure(cand, buds, f"layer {il} {p}")
                ok = kl < cur * (1 - min_gain)
                steps.append(SearchStep(f"layer {il}: {pats[il]} -> {p}", kl, ok))
                if ok:
                    pats, cur = cand, kl
        if budget_moves:
            for il in range(n_layer):
                for delta in (budget // 2, -(budget // 2)):
                    cand_b = move_budget(buds, il, delta, b_min)
                    if cand_b is None:
                        if bar is not None:
                            bar.update(1)
                        continue
                    kl = measure(pats, cand_b, f"layer {il} budget {cand_b[il]}")
                    ok = kl < cur * (1 - min_gain)
                    steps.append(SearchStep(f"layer {il}: budget {buds[il]} -> {cand_b[il]}", kl, ok))
                    if ok:
                        buds, cur = cand_b, kl
                        break
        if bar is not None:
            bar.close()

        info = plan_mod.ModelInfo.from_gguf(gguf)
        prov = plan_mod.Provenance.now(
            model=info, calibration={**data.description, "method": "runtime", "n_cont": n_cont},
            signals=["kl_runtime"],
            extra={"kl_uniform": uniform, "kl_plan": cur, "plans_measured": m.n_measured,
                   "accepted": [s.what for s in steps if s.accepted]})
        plan = build(n_layer, pats, buds, budget, b_min, provenance=prov)

    res = RuntimeCalibration(plan=plan, out=None, kl_uniform=uniform, kl_plan=cur, steps=steps,
                             n_measured=m.n_measured)
    if plan_out:
        Path(plan_out).write_text(plan.to_json())
    if out is not None:
        plan_mod.write_gguf(gguf, out, plan, progress=progress)
        res.out = Path(out)
    res.wall_s = time.time() - t0
    return res
