"""Scores: task metrics (RULER string match, LongBench's metrics), perplexity/KL against FullKV, gap recovered.

All task metrics return a number in [0, 1] per sample; reports multiply averages by 100.
"""

from __future__ import annotations

import difflib
import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

# ------------------------------------------------------------------------------------------ text clean-up

_SPECIAL = re.compile(r"<\|[^|>]{1,40}\|>|<(?:start|end)_of_turn>|</?s>")


def clean_prediction(text: str) -> str:
    """RULER's post-processing: drop special-token text and surrounding blanks."""
    return _SPECIAL.sub("", text).strip()


# ----------------------------------------------------------------------------------------- RULER metrics


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """Fraction of the references found in the prediction (case-insensitive) - RULER's niah/vt/cwe metric."""
    if not refs:
        return 0.0
    p = pred.lower()
    return sum(1.0 for r in refs if r.lower() in p) / len(refs)


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """1 if any reference is in the prediction (case-insensitive) - RULER's qa metric."""
    p = pred.lower()
    return 1.0 if any(r.lower() in p for r in refs) else 0.0


# ------------------------------------------------------------------------------------ LongBench metrics
# Same definitions as LongBench's metrics.py (English ones); ROUGE-L and the fuzzy ratio are computed here
# (LCS F-measure on lower-cased word tokens; difflib's ratio) instead of the `rouge` and `fuzzywuzzy` packages.


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _f1(pred_tokens: Sequence[str], ref_tokens: Sequence[str]) -> float:
    common = Counter(pred_tokens) & Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(pred: str, ref: str, **_: Any) -> float:
    return _f1(normalize_answer(pred).split(), normalize_answer(ref).split())


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(pred: str, ref: str, **_: Any) -> float:
    p = re.findall(r"\w+", pred.lower())
    r = re.findall(r"\w+", ref.lower())
    lcs = _lcs(p, r)
    if lcs == 0:
        return 0.0
    prec, rec = lcs / len(p), lcs / len(r)
    return 2 * prec * rec / (prec + rec)


def classification(pred: str, ref: str, all_classes: Sequence[str] | None = None, **_: Any) -> float:
    classes = list(all_classes or [])
    matched = [c for c in classes if c in pred]
    matched = [c for c in matched if not (c in ref and c != ref)]
    if matched:
        return 1.0 / len(matched) if ref in matched else 0.0
    if not classes:
        return 0.0
    best = max(classes, key=lambda c: difflib.SequenceMatcher(None, c, pred).ratio())
    return float(best == ref)


def retrieval(pred: str, ref: str, **_: Any) -> float:
    m = re.findall(r"Paragraph (\d+)", ref)
    if not m:
        return 0.0
    numbers = re.findall(r"\d+", pred)
    return 0.0 if not numbers else sum(1 for n in numbers if n == m[0]) / len(numbers)


def count(pred: str, ref: str, **_: Any) -> float:
    numbers = re.findall(r"\d+", pred)
    return 0.0 if not numbers else sum(1 for n in numbers if n == str(ref)) / len(numbers)


def code_sim(pred: str, ref: str, **_: Any) -> float:
    line = ""
    for candidate in pred.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return difflib.SequenceMatcher(None, line, ref).ratio()


_PER_REF = {"qa_f1": qa_f1, "rouge_l": rouge_l, "classification": classification, "retrieval": retrieval,
            "count": count, "code_sim": code_sim}
METRICS = ("match_all", "match_part", *_PER_REF)


def score(metric: str, pred: str, refs: Sequence[str], *, first_line: bool = False,
          meta: Mapping[str, Any] | None = None) -> float:
    """Score one prediction in [0, 1]. LongBench metrics take the best reference."""
    pred = clean_prediction(pred)
    if first_line:
        pred = pred.lstrip("\n").split("\n")[0]
    if metric == "match_all":
        return string_match_all(pred, refs)
    if metric == "match_part":
        return string_match_part(pred, refs)
    fn = _PER_REF.get(metric)
    if fn is None:
        raise ValueError(f"unknown metric {metric!r} (known: {', '.join(METRICS)})")
    kwargs = {"all_classes": (meta or {}).get("all_classes")}
    return max((fn(pred, r, **kwargs) for r in refs), default=0.0)


# ------------------------------------------------------------------------------------ perplexity and KL


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype(np.float32)


def kl_divergence(logp_ref: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """KL(ref || other) per row, from log-probabilities (nats)."""
    a = np.asarray(logp_ref, dtype=np.float64)
    b = np.asarray(logp, dtype=np.float64)
    return np.maximum(0.0, (np.exp(a) * (a - b)).sum(axis=-1))


def perplexity(nll: Iterable[float]) -> float:
    v = list(nll)
    return math.exp(sum(v) / len(v)) if v else float("nan")


# ------------------------------------------------------------------------------------------ aggregation

HIGHER_IS_BETTER = {"score": True, "ppl": False, "kl": False, "top1": True}


def mean(values: Iterable[float | None]) -> float | None:
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(v) / len(v) if v else None


def best_baseline(values: Mapping[str, float | None], baselines: Iterable[str], higher_is_better: bool = True
                  ) -> tuple[str | None, float | None]:
    """(name, value) of the strongest baseline among those with a value."""
    cands = [(m, values[m]) for m in baselines if values.get(m) is not None]
    if not cands:
        return None, None
    pick = max if higher_is_better else min
    return pick(cands, key=lambda t: t[1])  # type: ignore[arg-type,return-value]


def gap_recovered(plan: float | None, best: float | None, full: float | None, higher_is_better: bool = True
                  ) -> float | None:
    """(plan - best) / (full - best): 1 = as good as FullKV, 0 = as good as the best baseline, < 0 = worse.

    The same formula serves lower-is-better metrics (perplexity, KL) with `best` the lowest baseline. None when
    a value is missing or FullKV is not better than the best baseline (there is no gap to recover).
    """
    if plan is None or best is None or full is None:
        return None
    gap = full - best
    if (gap if higher_is_better else -gap) <= 1e-12:
        return None
    return (plan - best) / gap
