#!/usr/bin/env python3
"""Paired differences between methods of one `polykv-cpp eval` run, with bootstrap 95% intervals.

For every method at the base method's budget: the difference of task-averaged scores (method - base), the
share of the base's gap to FullKV it recovers and its score as a share of FullKV's (the base's too, in a row of
its own), each with the paired, task-stratified bootstrap interval of
`polykv_cpp.evaluation.report.bootstrap_task_average` (the same draw of prompts for every method). A difference
whose interval holds 0 is a tie.

    python scripts/paired_diff.py results/eval-qwen-4k-10samples/results.json --base snapkv
    python scripts/paired_diff.py results/eval-qwen-2k-evict-every-12texts/results.json --metric kl --base pool23-e1

``--metric kl`` (or nll, top1) pairs the teacher-forced texts instead: the per-token KL to FullKV of each text,
the bootstrap drawing texts (one unit each).

Several runs on the same prompts (another prefill mode, a later method) pair as LABEL=PATH: their methods are named
LABEL:method, and the prompts they share must have the same answers and lengths (checked):

    python scripts/paired_diff.py probed=results/eval-qwen-4k-chunked-probe/results.json \
        exact=results/eval-qwen-4k-adakv/results.json --base probed:snapkv@23

Runs on other prompts (another ``--seed``: a held-out replication) pool with ``--pool``: their samples are added to
one another's, each keyed by its run's LABEL, and the methods keep their own names; the bootstrap still draws
within each task, from every run's samples of it:

    python scripts/paired_diff.py s0=results/eval-qwen-4k-head-median/results.json \
        s5000=results/eval-qwen-4k-head-median-seed5000/results.json --pool --base head-median

A label given twice names two runs of the same prompts (a plan evaluated later on a seed's prompts): their methods
are merged under that label, a method both hold (FullKV, say) taken from the first one given.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from polykv_cpp.evaluation.report import bootstrap_task_average, interval


#: teacher-forced measures (``--metric``): per text, lower is better but for top-1 agreement
TEXT_METRICS = ("kl", "nll", "top1")


def method_scores(records: list[dict], protocol: str, metric: str = "score") -> dict[str, dict[str, dict[tuple, float]]]:
    """``method@budget -> task -> (length, index) -> score`` of the RULER records of one protocol (the budget is
    after the last ``@``: a method may hold one, as ``snapkv@23``). With a teacher-forced ``metric`` the perplexity
    texts' records instead, all in one stratum ``texts`` (one unit per text: the bootstrap draws texts)."""
    scores: dict[str, dict[str, dict[tuple, float]]] = {}
    for r in records:
        key = r["method"] if r["budget"] is None else f"{r['method']}@{r['budget']}"
        if metric != "score":
            if r.get("kind") == "ppl" and r.get(metric) is not None:
                scores.setdefault(key, {}).setdefault("texts", {})[(r["task"], r["length"], r["index"])] = r[metric]
            continue
        if r.get("kind", "ruler") != "ruler" or r.get("protocol") != protocol or r.get("score") is None:
            continue
        scores.setdefault(key, {}).setdefault(r["task"], {})[(r["length"], r["index"])] = r["score"]
    return scores


def load_runs(specs: list[str], protocol: str, metric: str = "score",
              pool: bool = False) -> dict[str, dict[str, dict[tuple, float]]]:
    """method_scores of one results.json, or of several given as LABEL=PATH (methods named LABEL:method); refuses
    runs whose shared samples differ (answers or prompt length): their scores would not pair. With ``pool`` the
    runs are on different prompts: a sample is keyed by its run's LABEL as well, and methods keep their names; a
    LABEL given again adds another run of the same prompts (its methods merged; a method both have keeps the
    first run's scores)."""
    scores: dict[str, dict[str, dict[tuple, float]]] = {}
    prompts: dict[tuple, tuple] = {}
    samples_of: dict[str, dict[tuple, tuple]] = {}  # with pool: each run's samples, to refuse the same prompts twice
    methods_of: dict[str, set[str]] = {}  # with pool: the methods each label's runs gave so far
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep:
            label, path = "", spec
        if pool and not label:
            raise SystemExit(f"paired_diff: --pool needs every run as LABEL=PATH ({spec})")
        earlier_methods = set(methods_of.get(label, ()))  # with pool: a label given again adds a run of its prompts
        records = json.load(open(path))["records"]
        for r in records:
            if r.get("kind", "ruler") != "ruler" or "answers" not in r:
                continue
            sample = (r["task"], r["length"], r["index"])
            key = (label, *sample) if pool else sample
            this = (json.dumps(r["answers"]), r.get("n_prompt"))
            if pool:
                samples_of.setdefault(label, {})[sample] = this
            if prompts.setdefault(key, this) != this:
                raise SystemExit(f"paired_diff: {path}: sample {key} differs from the other runs' (answers or prompt "
                                 "length): not the same prompts")
        if pool:
            ours = samples_of.get(label, {})
            for other, theirs in samples_of.items():
                shared = set(ours) & set(theirs) if other != label else set()
                if shared and all(ours[k] == theirs[k] for k in shared):
                    raise SystemExit(f"paired_diff: {label} and {other} hold the same prompts (answers and lengths): "
                                     "--pool adds runs of other seeds; pair runs of the same prompts without it")
        for m, v in method_scores(records, protocol, metric).items():
            if pool:
                if m in earlier_methods:
                    print(f"({label}: {m} is in two of its runs; the scores of the first given are used)")
                    continue
                methods_of.setdefault(label, set()).add(m)
                for task, by_sample in v.items():
                    scores.setdefault(m, {}).setdefault(task, {}).update(
                        {(label, *sample): x for sample, x in by_sample.items()})
            else:
                scores[f"{label}:{m}" if label else m] = v
    return scores


def common_samples(scores: dict[str, dict[str, dict[tuple, float]]]) -> tuple[dict, int]:
    """The scores restricted to the (task, sample) pairs every method has, so that the pairing holds when one
    method's run is incomplete; and how many results that left out."""
    tasks = set.intersection(*(set(v) for v in scores.values())) if scores else set()
    shared = {t: set.intersection(*(set(v[t]) for v in scores.values())) for t in tasks}
    out = {m: {t: {k: v[t][k] for k in sorted(shared[t])} for t in tasks if shared[t]} for m, v in scores.items()}
    n_dropped = sum(len(s) for v in scores.values() for s in v.values()) - sum(len(s) for v in out.values() for s in v.values())
    return out, n_dropped


def task_average(by_task: dict[str, dict[tuple, float]]) -> float:
    """The score (0-100) the report gives a method: the mean over tasks of its mean over their samples."""
    return 100 * float(np.mean([np.mean(list(v.values())) for v in by_task.values()]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="results.json of polykv-cpp eval, or several as LABEL=PATH")
    p.add_argument("--base", default="snapkv", help="the method the others are compared with (default snapkv)")
    p.add_argument("--protocol", default="query-aware")
    p.add_argument("--metric", default="score", choices=("score",) + TEXT_METRICS,
                   help="score: the task scores (default); kl, nll, top1: the teacher-forced texts' per-token KL to "
                        "FullKV, negative log-likelihood or top-1 agreement, paired per text")
    p.add_argument("--only", help="compare only these methods (comma-separated, METHOD or METHOD@BUDGET; the base "
                                  "and fullkv are added)")
    p.add_argument("--pool", action="store_true",
                   help="the LABEL=PATH runs are on different prompts (other seeds): pool their samples as one set")
    p.add_argument("--any-budget", action="store_true",
                   help="compare methods at every budget with the base (default: at the base's budget only)")
    args = p.parse_args(argv)
    scores = load_runs(args.results, args.protocol, args.metric, pool=args.pool)
    unit, fmt = (1.0, "{:+.1f}") if args.metric == "score" else (100.0, "{:+.4f}")  # the bootstrap's scale is 0-100
    if args.only:
        keep = set(args.only.split(",")) | {args.base, "fullkv"}
        scores = {m: v for m, v in scores.items()
                  if m.rpartition("@")[0] in keep or m in keep or m.rpartition(":")[2] == "fullkv"}
    full_key = next((m for m in scores if m.rpartition(":")[2] == "fullkv"), None)
    if full_key is None:
        raise SystemExit("paired_diff: the run has no fullkv results")
    bases = [m for m in scores if m.rpartition("@")[0] == args.base]
    if not bases:
        raise SystemExit(f"paired_diff: no results of {args.base!r} ({args.protocol})")
    # each base's comparisons on the samples that its budget's methods all have (pooled runs, or a run stopped
    # early, may hold a budget or a method on fewer samples than the rest)
    groups = {}
    for base in bases:
        budget = base.rpartition("@")[2]
        group, n_dropped = common_samples({m: v for m, v in scores.items() if args.any_budget or m == full_key
                                           or m.rpartition("@")[2] == budget})
        if n_dropped:
            where = f" at {budget}" if len(bases) > 1 else ""
            print(f"(a method lacks some samples: every method is compared on the "
                  f"{sum(map(len, group[base].values()))} samples they all have{where}; {n_dropped} results left out)")
        groups[base] = (group, bootstrap_task_average(group))

    print(f"| method - {args.base} | budget | difference [95% CI] | gap recovered [95% CI] | of FullKV [95% CI] |")
    print("|---|---:|---:|---:|---:|")
    for base in bases:
        budget = base.rpartition("@")[2]
        group, reps = groups[base]
        full = reps[full_key]

        def of_full(m: str) -> str:
            if args.metric != "score":
                return "-"
            with np.errstate(divide="ignore", invalid="ignore"):
                share = interval(reps[m] / full)
            point = task_average(group[m]) / task_average(group[full_key])
            return f"{100 * point:.0f}% [{100 * share[0]:.0f}%, {100 * share[1]:.0f}%]" if share else f"{100 * point:.0f}%"

        print(f"| {base.rpartition('@')[0]} (base) | {budget} | - | - | {of_full(base)} |")
        for m in sorted(reps):
            if m in (base, full_key):
                continue
            diff = reps[m] - reps[base]
            with np.errstate(divide="ignore", invalid="ignore"):  # replicates where the base equals FullKV
                gap = diff / (full - reps[base])
            point = task_average(group[m]) - task_average(group[base])
            full_gap = task_average(group[full_key]) - task_average(group[base])
            (d0, d1), gap_ci = interval(diff), interval(gap)
            # no gap to recover where the base scores FullKV's average (in every replicate: no interval either);
            # where FullKV only ties the base, replicates divide by gaps near 0 and the ratio's interval means nothing
            full_ci = interval(full - reps[base])
            gap_text = "-" if not full_gap else f"{100 * point / full_gap:.0f}%" + (
                " (FullKV ties the base)" if full_ci and full_ci[0] <= 0 <= full_ci[1] else
                f" [{100 * gap_ci[0]:.0f}%, {100 * gap_ci[1]:.0f}%]" if gap_ci else "")
            print(f"| {m.rpartition('@')[0]} | {m.rpartition('@')[2]} | {fmt.format(point / unit)} "
                  f"[{fmt.format(d0 / unit)}, {fmt.format(d1 / unit)}] | {gap_text} | {of_full(m)} |")
        point = task_average(group[full_key]) - task_average(group[base])
        d0, d1 = interval(full - reps[base])
        print(f"| {full_key} | {budget} | {fmt.format(point / unit)} [{fmt.format(d0 / unit)}, {fmt.format(d1 / unit)}] | 100% | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
