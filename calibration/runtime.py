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
  at ``budget``; on a model with sliding-window layers, try its budgets in proportion to each layer's span (its
  window, or the context: ``Plan.span_split``); per layer, the pattern with the lowest joint KL given the other
  layers (the pattern preference, measured with every layer compressed, not one layer alone); then move budget
  between layers (a layer gets ``budget/2`` more or less, the others pay or receive in proportion to what they
  hold above ``b_min``) where the KL drops; last, the same plan with its budgets re-split per prompt by the prompt's own
  scores (``"allocation": "prompt"``, then ``"prompt_median"``: relative to each set's median; floors at the
  patterns' sinks and windows). A change is kept when it lowers
  the KL by more than ``min_gain`` (relative).

Calibration data: natural texts (``dataset`` as for the transformers method), or ``dataset="tasks"``: the
synthetic long-context tasks of ``polykv-cpp eval`` generated with seed ``1000 + seed`` (never the evaluation's
samples), each continued by the model's own FullKV answer; only the answer tokens are scored, in the
query-aware protocol (whole prompt compressed) and/or the query-agnostic one (context compressed, then question
and answer fed). The search minimizes the KL (``objective="kl"``, default on texts) or the share of scored
tokens whose top-1 next token differs from FullKV's (``"top1"``, default on tasks).

Limits: the search measures the prefill phase (the decode phase uses each layer's prefill pattern and budget);
the plan fits the calibration texts and the budget it was searched at (other budgets rescale it with
``Plan.scaled``); every measured plan costs ``samples x n_cont`` tokens of forward, so the search is about
``(1 + n_pattern) x n_layer`` plan measurements (Qwen2.5-0.5B, 4 samples: ~10 minutes on 2 CPU cores).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from calibration.core import CALIBRATED_EVICT_EVERY, RUNTIME_PATTERNS, check_evict_every
from polykv_cpp.errors import CalibrationError
from polykv_cpp.evaluation.runner import KVZIP_ROOM
from polykv_cpp.plan import uses_kvzip

DEFAULT_SAMPLES = 4
DEFAULT_MIN_GAIN = 0.01
#: ``dataset`` value for the synthetic tasks of ``polykv-cpp eval`` (RULER-style), with the model's FullKV answers
TASKS_DATASET = "tasks"
#: what the search minimizes: KL(FullKV || plan) per scored token, or the share of scored tokens whose top-1
#: next token differs from FullKV's (bounded; follows what greedy answers do; default on tasks, where one lost
#: needle gives a KL of several nats that outweighs every other item)
OBJECTIVES = ("kl", "top1")
#: task samples for calibration use seed ``TASK_SEED_OFFSET + seed``: never the evaluation's default seeds
TASK_SEED_OFFSET = 1000


@dataclass
class SearchStep:
    what: str
    kl: float
    accepted: bool


@dataclass
class RuntimeCalibration:
    plan: Any
    out: Path | None
    objective: str  # what the search minimized: "kl" or "top1" (see OBJECTIVES)
    loss_uniform: dict[str, float]
    loss_plan: float
    steps: list[SearchStep] = field(default_factory=list)
    n_measured: int = 0
    wall_s: float = 0.0


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def move_budget(budgets: Sequence[int], layer: int, delta: int, b_min: int,
                caps: Sequence[int | None] | None = None) -> list[int] | None:
    """Give ``layer`` ``delta`` more tokens (negative: fewer), the other layers paying in proportion to what
    they hold above ``b_min`` or receiving equal parts (only layers below their cap: ``caps[l]``, the window of
    a sliding-window layer, None = none); the total stays exact. None if it cannot be done."""
    from polykv_cpp.plan import largest_remainder

    b = list(budgets)
    caps = list(caps) if caps is not None else [None] * len(b)
    if b[layer] + delta < b_min or (caps[layer] and b[layer] + delta > caps[layer]):
        return None
    others = [j for j in range(len(b)) if j != layer]
    if delta > 0:
        weights = [b[j] - b_min for j in others]
        if sum(weights) < delta:
            return None
    else:
        weights = [0 if caps[j] and b[j] >= caps[j] else 1 for j in others]
        if not any(weights):
            return None
    shares = largest_remainder(weights, abs(delta))
    for j, s in zip(others, shares):
        b[j] += -s if delta > 0 else s
    b[layer] += delta
    if min(b) < b_min or any(c and x > c for x, c in zip(b, caps)):
        return None
    return b


@dataclass
class CalibrationItem:
    """A context that is compressed, and the continuation fed after it. KL is scored on the continuation's
    next-token distributions from index ``score_from`` on (earlier ones belong to a question, not scored)."""

    context: list[int]
    continuation: list[int]
    score_from: int = 0
    snapshot: Any = None  # the FullKV portable state after `context`, when already computed


def text_items(samples: Sequence[Sequence[int]], n_cont: int) -> list[CalibrationItem]:
    """Calibration texts: the last ``n_cont`` tokens of each sample continue the rest."""
    return [CalibrationItem(list(s[:-n_cont]), list(s[-n_cont:])) for s in samples]


def _ctx_for(n_tokens: int) -> int:
    """A context size for ``n_tokens`` tokens: one more, rounded up to 256."""
    return int(np.ceil((n_tokens + 1) / 256) * 256)


def _portable_fullkv(model, n_ctx: int, n_batch: int, n_threads: int | None):
    from polykv_cpp import plan as plan_mod

    model.set_plan(plan_mod.uniform_plan(model.n_layer, plan_mod.FULLKV, n_ctx), prefill="portable")
    return model.context(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=512, n_threads=n_threads)


def task_items(model, *, tasks: Sequence[str], length: int, n_per_task: int, seed: int,
               protocols: Sequence[str], n_threads: int | None, progress: bool, room: int = 0
               ) -> tuple[list[CalibrationItem], int]:
    """Synthetic long-context tasks (the generators of ``polykv-cpp eval``, another seed) with the model's
    own FullKV answer as continuation, and the n_ctx their snapshots need. query-aware: the whole prompt is
    compressed and the answer scored; query-agnostic: the context is compressed, question + answer are fed and
    only the answer is scored. One portable prefill per sample serves both (snapshots after each part)."""
    from polykv_cpp.evaluation import tasks as T
    from polykv_cpp.evaluation.runner import read_answer

    builder = T.PromptBuilder(lambda t, a, p: model.tokenize(t, add_special=a, parse_special=p),
                              T.detect_chat_format(model.meta("tokenizer.chat_template")))
    samples = T.generate_ruler(tasks, [length], n_per_task, seed, lambda s: builder.count(s) + s.max_new_tokens,
                               stop_at_newline=builder.chat.name == "none")
    prompts = [builder.build(s, max_prompt=s.length - s.max_new_tokens) for s in samples]
    n_ctx = _ctx_for(max(p.n_prompt + s.max_new_tokens for s, p in zip(samples, prompts)) + room)
    items: list[CalibrationItem] = []
    it = list(zip(samples, prompts))
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="FullKV answers", unit="sample", file=sys.stderr)
    with _portable_fullkv(model, n_ctx, 512, n_threads) as ctx:
        for s, p in it:
            ctx.clear()
            ctx.decode(p.part1)
            after_context = ctx.snapshot()
            ctx.decode(p.part2)
            after_prompt = ctx.snapshot()
            ctx.restore(after_prompt)  # generate_tokens([]) answers from a restored state's logits
            gen = ctx.generate_tokens([], max_tokens=s.max_new_tokens)
            answer: list[int] = []

            def recorded():
                for tok in gen:
                    answer.append(tok)
                    yield tok
            try:
                read_answer(recorded(), model, s)  # stops where the eval stops reading an answer
            finally:
                gen.close()
            if len(answer) < 2:
                continue  # nothing to score after the first answer token
            if "query-aware" in protocols:
                items.append(CalibrationItem(p.tokens, answer, snapshot=after_prompt))
            if "query-agnostic" in protocols:
                items.append(CalibrationItem(p.part1, p.part2 + answer, score_from=len(p.part2) - 1,
                                             snapshot=after_context))
    if not items:
        raise CalibrationError("no calibration task produced an answer of two tokens or more")
    return items, n_ctx


class _Measure:
    """Contexts prefilled once (portable) and the FullKV reference of their continuations."""

    def __init__(self, model, items: list[CalibrationItem], n_threads: int | None, progress: bool,
                 n_ctx: int | None = None, room: int = 0):
        self.model = model
        self.n_layer = model.n_layer
        T = max(len(i.context) + len(i.continuation) for i in items)
        self.n_ctx = n_ctx or _ctx_for(T + room)  # room: cells a KVzip reconstruction chunk needs
        self.n_batch = max(512, max(len(i.continuation) for i in items))
        self.n_threads = n_threads
        self.n_measured = 0
        self.items: list[tuple[Any, CalibrationItem, np.ndarray]] = []
        it = items
        if progress:
            from tqdm import tqdm
            it = tqdm(items, desc="prefill (once)", unit="sample", file=sys.stderr)
        with _portable_fullkv(model, self.n_ctx, self.n_batch, n_threads) as ctx:
            for item in it:
                if item.snapshot is not None:
                    snap = item.snapshot
                    ctx.restore(snap)
                else:
                    ctx.clear()
                    ctx.decode(item.context)
                    snap = ctx.snapshot()
                self.items.append((snap, item, self._logprobs(ctx, item)))

    @staticmethod
    def _logprobs(ctx, item: CalibrationItem) -> np.ndarray:
        ctx.decode(item.continuation, all_logits=True)
        return _log_softmax(np.stack([ctx.logits(i) for i in range(item.score_from, len(item.continuation))]))

    def measure(self, plan) -> dict[str, float]:
        """Means over items of ``kl``: KL(FullKV || plan) in nats per scored continuation token, and ``top1``:
        the share of scored tokens whose most likely next token differs from FullKV's."""
        kl = top1 = 0.0
        for ctx, item, ref in self._compressed(plan):
            lp = self._logprobs(ctx, item)
            kl += float(np.mean(np.sum(np.exp(ref) * (ref - lp), axis=-1, dtype=np.float64)))
            top1 += float(np.mean(lp.argmax(axis=-1) != ref.argmax(axis=-1)))
        return {"kl": kl / len(self.items), "top1": top1 / len(self.items)}

    def kl(self, plan) -> float:
        return self.measure(plan)["kl"]

    def score_shares(self, pattern: str, budget: int) -> np.ndarray:
        """Per layer, the share of the kept (head, token) pairs that one threshold over the whole model gives it.

        Each calibration context is compressed by ``pattern`` with room for all of it (nothing evicted), every
        layer's and KV head's scores are read (`Context.kept_scores`), and the ``n_layer x n_head_kv x budget``
        highest-scored pairs of the whole model are kept: KVzip's and Ada-KV's global rule, which kvpress applies
        per context. A layer's share is its part of those pairs, averaged over the contexts. Sliding-window
        layers are left out (their share is 0; their window bounds them)."""
        windows = self.model.attention_windows()
        whole = max(len(i.context) for _, i, _ in self.items)
        plan = build(self.n_layer, [pattern] * self.n_layer, [min(whole, w or whole) for w in windows], whole,
                     min(whole, 64))
        shares = np.zeros(self.n_layer)
        n_head = self.model.n_head_kv
        layers = [il for il in range(self.n_layer) if not windows[il]]
        for ctx, _, _ in self._compressed(plan):
            sc = {il: np.stack([ctx.kept_scores(il, h) for h in range(n_head)]) for il in layers}
            pool = np.concatenate([sc[il].ravel() for il in layers])
            k = min(len(pool), len(layers) * n_head * budget)
            thr = np.partition(pool, len(pool) - k)[len(pool) - k]
            kept = np.array([float((sc[il] >= thr).sum()) if il in sc else 0.0 for il in range(self.n_layer)])
            shares += kept / kept.sum()
        return shares / len(self.items)

    def _compressed(self, plan):
        """Each item's context restored into one portable context with `plan` and compressed as the runtime does
        (after KVzip's reconstruction pass for kvzip plans): yields (context, item, FullKV log-probs)."""
        self.model.set_plan(plan, prefill="portable")
        with self.model.context(n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=512,
                                n_threads=self.n_threads) as ctx:
            for snap, item, ref in self.items:
                ctx.restore(snap)
                if uses_kvzip(plan):
                    ctx.compress_prompt_kvzip(item.context, chunk=KVZIP_ROOM)
                else:
                    ctx.compress_prompt()
                yield ctx, item, ref
        self.n_measured += 1


def build(n_layer: int, patterns: Sequence[str], budgets: Sequence[int], budget: int, b_min: int,
          provenance=None, rule: str = "search"):
    """A plan with `patterns[l]` at `budgets[l]` in both phases (each pattern's default parameters but the
    pooling window of a name such as "snapkv@23" or "snapkv@15+4")."""
    from polykv_cpp import plan as plan_mod

    layers = []
    for il, (name, b) in enumerate(zip(patterns, budgets)):
        one = plan_mod.method_plan(1, name, int(b), b_min=min(b_min, int(b)))  # "snapkv-head": per KV head
        layers.append(plan_mod.LayerPlan(il, one.layers[0].prefill, one.layers[0].decode))
    return plan_mod.Plan(version=plan_mod.PLAN_FORMAT_VERSION, n_layer=n_layer, budget_avg=budget, b_min=b_min,
                         budget_rule=rule, layers=layers, provenance=provenance or plan_mod.Provenance.now(),
                         exact_total=True).validate()


def with_allocation(plan, allocation: str):
    """`plan` as is (``"plan"``), or with its budgets re-split per prompt (``"prompt"``, ``"prompt_median"``); the
    floor of a layer's budget (``b_min``) is then what its patterns always keep (sinks and windows), the least a
    valid plan allows."""
    if allocation == "plan":
        return plan
    floor = max([max(lp.prefill.reserved, lp.decode.reserved) for lp in plan.layers] + [1])
    return dataclasses.replace(plan, allocation=allocation, b_min=floor).validate()


def runtime_calibrate(gguf: str | Path, out: str | Path | None, *, budget: int, samples: int = DEFAULT_SAMPLES,
                      ctx: int = 2048, n_cont: int = 128, patterns: Sequence[str] = RUNTIME_PATTERNS,
                      b_min: int | None = None, dataset: str = "builtin",
                      seed: int = 0, text_field: str = "text", split: str = "train",
                      tasks: Sequence[str] | None = None, protocols: Sequence[str] = ("query-aware",),
                      objective: str | None = None,
                      budget_moves: bool = True, budgets_from_scores: bool = False, prompt_budgets: bool = True,
                      score_pattern: str | None = None, min_gain: float = DEFAULT_MIN_GAIN, plan_out: str | Path | None = None,
                      n_threads: int | None = None, progress: bool = True, evict_every: int = CALIBRATED_EVICT_EVERY,
                      log: Callable[[str], None] | None = None) -> RuntimeCalibration:
    from polykv_cpp import plan as plan_mod
    from polykv_cpp.api import Model

    from calibration.data import load_calibration_data

    log = log or (lambda m: print(m, file=sys.stderr))
    t0 = time.time()
    check_evict_every(evict_every)
    gguf = Path(gguf)
    if not gguf.is_file():
        raise CalibrationError(f"model file not found: {gguf}")
    if out is not None and Path(out).resolve() == gguf.resolve():
        raise CalibrationError("--out must be a new file: the model file is never modified in place")
    def _budgeted(p: str) -> bool:
        try:
            base = plan_mod.split_method(p)[0]
        except plan_mod.PlanError:
            return False
        return base in plan_mod.KNOWN_PATTERNS and base != plan_mod.FULLKV

    bad = [p for p in patterns if not _budgeted(p)]
    if bad or not patterns:
        raise CalibrationError(f"runtime calibration patterns must be budgeted patterns or their per-head or pooling "
                               f"variants (e.g. snapkv-head, snapkv@23; got {bad or 'none'})")
    if score_pattern is not None:
        if not _budgeted(score_pattern):
            raise CalibrationError(f"--score-pattern must be a budgeted pattern or its per-head variant (e.g. "
                                   f"kvzip-head; got {score_pattern!r})")
        budgets_from_scores = True
    # a KVzip candidate (or scorer) reconstructs each prompt after it: leave its chunk room in every context
    room = KVZIP_ROOM if any(plan_mod.split_method(p)[0] in plan_mod.RECONSTRUCTION_PATTERNS
                             for p in [*patterns, *([score_pattern] if score_pattern else [])]) else 0
    from_tasks = dataset == TASKS_DATASET
    objective = objective or ("top1" if from_tasks else "kl")
    if objective not in OBJECTIVES:
        raise CalibrationError(f"unknown objective {objective!r} (known: {', '.join(OBJECTIVES)})")
    if from_tasks:
        from polykv_cpp.evaluation.runner import PROTOCOLS
        from polykv_cpp.evaluation.tasks import RULER_TASKS

        tasks = list(tasks or RULER_TASKS)
        bad = [t for t in tasks if t not in RULER_TASKS] + [p for p in protocols if p not in PROTOCOLS]
        if bad or not protocols:
            raise CalibrationError(f"unknown task(s)/protocol(s) {bad or 'none'} (tasks: {', '.join(RULER_TASKS)}; "
                                   f"protocols: {', '.join(PROTOCOLS)})")
        n_cont = 0  # the continuation is each task's FullKV answer
    elif n_cont < 2 or n_cont >= ctx // 2:
        raise CalibrationError(f"--n-cont must be in [2, ctx/2) (got {n_cont})")
    reserved = max(max(lp.prefill.reserved, lp.decode.reserved) for lp in
                   (build(1, [p], [budget], budget, 1).layers[0] for p in patterns))
    floor_given = b_min is not None
    b_min = b_min if b_min is not None else min(budget, max(budget // 4, reserved))
    if not reserved <= b_min <= budget:
        raise CalibrationError(f"b_min {b_min} must be within [{reserved}, {budget}] (sinks + windows of the "
                               "patterns, and the budget)")
    n_compressed = ctx - (128 if from_tasks else n_cont)  # tasks: the prompt leaves room for question + answer
    if budget >= n_compressed:
        raise CalibrationError(f"budget {budget} keeps the whole context of about {n_compressed} tokens: nothing "
                               "to measure; use a larger --ctx")

    with Model(gguf) as model:
        n_layer = model.n_layer
        if from_tasks:
            task_seed = TASK_SEED_OFFSET + seed
            log(f"runtime calibration of {gguf.name}: {n_layer} layers, budget {budget}, b_min {b_min}, "
                f"{samples} sample(s) x {len(tasks)} task(s) x {ctx} tokens (seed {task_seed}), "
                f"{', '.join(protocols)}, patterns {', '.join(patterns)}")
            items, items_n_ctx = task_items(model, tasks=tasks, length=ctx, n_per_task=samples, seed=task_seed,
                                            protocols=protocols, n_threads=n_threads, progress=progress, room=room)
            description = {"dataset": TASKS_DATASET, "tasks": tasks, "protocols": list(protocols), "ctx": ctx,
                           "n_samples": samples, "seed": task_seed, "n_items": len(items),
                           "continuation": "the model's FullKV answer"}
        else:
            data = load_calibration_data(dataset, lambda t: model.tokenize(t, add_special=False,
                                                                           parse_special=False),
                                         ctx=ctx, n_samples=samples, seed=seed, text_field=text_field, split=split,
                                         tokenizer_desc="the GGUF's own")
            log(f"runtime calibration of {gguf.name}: {n_layer} layers, budget {budget}, b_min {b_min}, "
                f"{samples} samples x {ctx} tokens (continuation {n_cont}), patterns {', '.join(patterns)}")
            items, items_n_ctx = text_items(data.samples, n_cont), None
            description = data.description
        m = _Measure(model, items, n_threads, progress, n_ctx=items_n_ctx, room=room)
        windows = model.attention_windows()
        n_total = (len(patterns) + n_layer * (len(patterns) - 1) + (2 * n_layer if budget_moves else 0)
                   + (1 if any(windows) else 0)
                   + (1 if budgets_from_scores else 0) + (1 if prompt_budgets else 0))
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=n_total, desc="search", unit="plan", file=sys.stderr)

        def measure(pats, buds, what, allocation: str = "plan") -> float:
            r = m.measure(with_allocation(build(n_layer, pats, buds, budget, b_min), allocation))
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{what}: KL {r['kl']:.4f} top-1 miss {r['top1']:.3f}")
            return r[objective]

        steps: list[SearchStep] = []
        split_by_span = False
        # a sliding-window layer cannot use more than its window: the start gives the rest to the other layers
        start = plan_mod.allocate_budgets(n_layer * budget, [1] * n_layer, b_min, windows)
        uniform = {p: measure([p] * n_layer, start, f"uniform {p}") for p in patterns}
        best = min(uniform, key=uniform.get)  # type: ignore[arg-type]
        pats, buds, cur = [best] * n_layer, start, uniform[best]
        steps.append(SearchStep(f"start: uniform {best}", cur, True))
        if any(windows):
            # every layer the same share of what it attends to (Plan.span_split): the global layers, the only ones
            # that reach the start of the prompt, get what the sliding-window layers' windows do not need
            cand_b = plan_mod.allocate_budgets(n_layer * budget, plan_mod.layer_spans(windows, ctx), b_min, windows)
            loss = measure(pats, cand_b, "budgets by span")
            ok = loss < cur * (1 - min_gain)
            steps.append(SearchStep(f"budgets in proportion to the layers' spans: {cand_b}", loss, ok))
            if ok:
                buds, cur, split_by_span = cand_b, loss, True
        if budgets_from_scores:
            # the global rule of KVzip / Ada-KV, learned once: each layer's budget follows its share of the
            # model's best-scored (head, token) pairs on the calibration contexts. The scorer may differ from
            # the pattern that runs (KVzip's budgets, Expected Attention's selection: no reconstruction pass)
            scorer = score_pattern or best
            shares = m.score_shares(scorer, budget)
            weights = np.maximum(shares * n_layer * budget - b_min, 0.0)
            cand_b = plan_mod.allocate_budgets(n_layer * budget, list(weights), b_min, windows)
            loss = measure(pats, cand_b, "budgets from scores")
            ok = loss <= cur
            steps.append(SearchStep(f"budgets from {scorer}'s scores: {cand_b}", loss, ok))
            if ok:
                buds, cur = cand_b, loss
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
                    cand_b = move_budget(buds, il, delta, b_min, windows)
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
        allocation = "plan"
        if prompt_budgets:
            # the searched budgets as each prompt's pool, re-split per prompt by its own scores (Ada-KV's and
            # KVzip's global rule, the layers of each pattern among themselves; floors: the patterns' sinks and
            # windows), measured as exact prefill compresses (chunked prefill re-splits within budget x its slack)
            # by the raw scores, then by the scores relative to each set's median (a flat layer's many middling
            # scores no longer outbid the peaked layers); the better of the two is kept if it lowers the loss
            best = cur
            for mode, what in (("prompt", "budgets re-split per prompt by its scores"),
                               ("prompt_median", "budgets re-split per prompt by its scores relative to each "
                                                 "set's median")):
                loss = measure(pats, buds, what, allocation=mode)
                ok = loss < best * (1 - min_gain)  # best <= cur: below the plan so far and the other mode
                steps.append(SearchStep(what, loss, ok))
                if ok:
                    allocation, best = mode, loss
            cur = best
        if bar is not None:
            bar.close()

        info = plan_mod.ModelInfo.from_gguf(gguf)
        prov = plan_mod.Provenance.now(
            model=info, calibration={**description, "method": "runtime", "n_cont": n_cont},
            signals=[f"{objective}_runtime"],
            extra={"objective": objective, "loss_uniform": uniform, "loss_plan": cur, "plans_measured": m.n_measured,
                   "accepted": [s.what for s in steps if s.accepted], "budgets_from_scores": budgets_from_scores,
                   "prompt_budgets": allocation != "plan", "allocation": allocation,
                   **({"score_pattern": score_pattern} if score_pattern else {})})
        plan = with_allocation(build(n_layer, pats, buds, budget, b_min, provenance=prov), allocation)
        if split_by_span and not floor_given and plan.b_min > reserved:
            # as `calibrate`'s transformers method: the split's proportions down to what the patterns always keep,
            # not to a quarter of the budget, where every layer would be equal again (--kv-budget 128 of a 512 plan)
            plan = plan.with_floor(reserved)

    plan = dataclasses.replace(plan, evict_every=evict_every)  # checked on entry; build() validated the rest
    res = RuntimeCalibration(plan=plan, out=None, objective=objective, loss_uniform=uniform, loss_plan=cur,
                             steps=steps,
                             n_measured=m.n_measured)
    if plan_out:
        Path(plan_out).write_text(plan.to_json())
    if out is not None:
        # a plan measured only with the question after the compression is the file's query-agnostic plan (the
        # source's polykv.plan stays); any other replaces polykv.plan (the source's query-agnostic plan stays)
        if tuple(protocols) == ("query-agnostic",):
            plan_mod.embed_plans(gguf, out, query_agnostic_plan=plan, progress=progress)
        else:
            plan_mod.embed_plans(gguf, out, plan=plan, progress=progress)
        res.out = Path(out)
    res.wall_s = time.time() - t0
    return res
