#!/usr/bin/env python3
"""Prefill modes side by side: quality in both protocols against the peak KV memory each mode needs.

Reads the `polykv-cpp eval` runs of one method and budget made with different prefill modes (exact, chunked with
slack 1, 2, 4, ...) on the same samples, and writes the table `run`'s default is chosen from: per mode, the
task-averaged score per protocol with its 95% interval, the paired difference to exact prefill (the same draw of
prompts for every mode; an interval holding 0 is a tie), and the peak KV bytes of a context:

* exact prefill keeps the whole prompt until it is compressed: its cache is the context's FullKV size;
* chunked prefill allocates budget x slack + one ubatch per layer (the `kv_bytes` the eval measured).

    python scripts/prefill_table.py --method snapkv --budget 256 \\
        exact=results/eval-qwen-2k-prefill/exact s1=results/eval-qwen-2k-prefill/s1 ... \\
        --out results/eval-qwen-2k-prefill
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from polykv_cpp.evaluation.report import bootstrap_task_average, interval

PROTOCOLS = ("query-aware", "query-agnostic")
MIB = 1024 * 1024


def load(path: str) -> dict:
    p = Path(path)
    return json.loads((p / "results.json" if p.is_dir() else p).read_text())


def scores_of(data: dict, method: str, budget: int | None, protocol: str) -> dict[str, dict[tuple, float]]:
    """task -> (length, index) -> score of one (method, budget) and protocol."""
    out: dict[str, dict[tuple, float]] = {}
    for r in data["records"]:
        if (r.get("kind", "ruler") == "ruler" and r["protocol"] == protocol and r["method"] == method
                and r["budget"] == budget and r.get("score") is not None):
            out.setdefault(r["task"], {})[(r["length"], r["index"])] = r["score"]
    return out


def peak_kv_bytes(data: dict, method: str, budget: int) -> int | None:
    """The KV bytes a context of this run holds at its largest (see the module docstring)."""
    run = next((r for r in data["runs"] if r["method"] == method and r["budget"] == budget), None)
    if run is None:
        return None
    if data["config"].get("prefill", "chunked") == "exact":
        return run.get("kv_bytes_fullkv")
    return run.get("kv_bytes")


def mode_label(data: dict, method: str) -> str:
    """exact, or chunked with the slack the method's run took (its plan's own, or --prefill-slack) and its probe."""
    cfg = data["config"]
    if cfg.get("prefill", "chunked") == "exact":
        return "exact"
    run = next((r for r in data["runs"] if r["method"] == method), {})
    label = f"chunked, slack {run.get('prefill_slack', cfg.get('prefill_slack') or 1.0):g}"
    probe = run.get("prompt_probe", cfg.get("prompt_probe"))
    return label + (f", probed by the last {probe} tokens" if probe else "")


def build(runs: dict[str, dict], method: str, budget: int, methods: dict[str, str] | None = None) -> dict:
    """label -> protocol -> {score, ci, diff, diff_ci} and peak bytes; FullKV from the first run that has it.
    ``methods``: label -> the method (or plan name) read from that run, when it is not ``method`` (a plan that
    streams the prompt by another pattern, say)."""
    methods = {k: (methods or {}).get(k, method) for k in runs}
    exact = next((k for k, d in runs.items() if d["config"].get("prefill") == "exact"), None)
    table: dict = {"method": method, "budget": budget, "modes": {}, "fullkv": {}}
    for proto in PROTOCOLS:
        scores = {k: scores_of(d, methods[k], budget, proto) for k, d in runs.items()}
        scores = {k: v for k, v in scores.items() if v}
        full = next((scores_of(d, "fullkv", None, proto) for d in runs.values()
                     if scores_of(d, "fullkv", None, proto)), None)
        if full:
            scores["fullkv"] = full
        if not scores:
            continue
        reps = bootstrap_task_average(scores)
        if full:
            table["fullkv"][proto] = {"score": float(np.nanmedian(reps["fullkv"])), "ci": interval(reps["fullkv"])}
        for k in runs:
            if k not in scores:
                continue
            label = mode_label(runs[k], methods[k]) + ("" if methods[k] == method else f", {methods[k]}")
            row = table["modes"].setdefault(k, {"mode": label,
                                                "peak_kv_bytes": peak_kv_bytes(runs[k], methods[k], budget),
                                                "n_prompts": sum(len(v) for v in scores[k].values())})
            mean = 100 * float(np.mean([np.mean(list(v.values())) for v in scores[k].values()]))
            cell = {"score": mean, "ci": interval(reps[k])}
            if exact and exact in scores and k != exact:
                base = 100 * float(np.mean([np.mean(list(v.values())) for v in scores[exact].values()]))
                cell["diff"] = mean - base
                cell["diff_ci"] = interval(reps[k] - reps[exact])
            row[proto] = cell
    return table


def _cell(c: dict | None, diff: bool = False) -> str:
    if not c:
        return "–"
    if diff:
        if "diff" not in c:
            return "–"
        lo, hi = c["diff_ci"]
        return f"{c['diff']:+.1f} [{lo:+.1f}, {hi:+.1f}]"
    lo, hi = c["ci"]
    return f"{c['score']:.1f} [{lo:.1f}-{hi:.1f}]"


def to_markdown(t: dict) -> str:
    L = [f"Method {t['method']} at budget {t['budget']}; scores 0-100 with 95% intervals (task-stratified paired "
         "bootstrap); differences are to exact prefill on the same prompts.", "",
         "| prefill | peak KV (MiB) | query-aware | QA - exact | query-agnostic | QAg - exact | prompts |",
         "|---|---:|---:|---:|---:|---:|---:|"]
    for row in t["modes"].values():
        peak = "–" if row["peak_kv_bytes"] is None else f"{row['peak_kv_bytes'] / MIB:.1f}"
        L.append(f"| {row['mode']} | {peak} | {_cell(row.get('query-aware'))} | "
                 f"{_cell(row.get('query-aware'), True)} | {_cell(row.get('query-agnostic'))} | "
                 f"{_cell(row.get('query-agnostic'), True)} | {row['n_prompts']} |")
    for proto, c in t["fullkv"].items():
        L.append(f"\nFullKV, {proto}: {c['score']:.1f} [{c['ci'][0]:.1f}-{c['ci'][1]:.1f}]")
    return "\n".join(L) + "\n"


def plot(t: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for proto, marker in zip(PROTOCOLS, ("o", "s")):
        xs, ys, err, labels = [], [], [[], []], []
        for row in t["modes"].values():
            c = row.get(proto)
            if not c or row["peak_kv_bytes"] is None:
                continue
            xs.append(row["peak_kv_bytes"] / MIB)
            ys.append(c["score"])
            err[0].append(c["score"] - c["ci"][0])
            err[1].append(c["ci"][1] - c["score"])
            labels.append(row["mode"].replace("chunked, ", ""))
        ax.errorbar(xs, ys, yerr=err, fmt=marker, capsize=3, label=proto)
        for x, y, s in zip(xs, ys, labels):
            ax.annotate(s, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
    for proto, c in t["fullkv"].items():
        ax.axhline(c["score"], ls="--" if proto == "query-aware" else ":", color="gray", lw=1,
                   label=f"FullKV ({proto})")
    ax.set_xlabel("peak KV memory (MiB)")
    ax.set_ylabel("task score (0-100)")
    ax.set_title(f"{t['method']} at {t['budget']}: prefill modes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="LABEL[@METHOD]=DIR",
                   help="eval output directories (or results.json); @METHOD reads that method or plan of the run "
                        "instead of --method")
    p.add_argument("--method", default="snapkv")
    p.add_argument("--budget", type=int, required=True)
    p.add_argument("--out", default=None, help="write prefill_table.{json,md,png} here")
    args = p.parse_args(argv)
    runs, methods = {}, {}
    for spec in args.runs:
        label, _, path = spec.rpartition("=")
        label, _, meth = (label or path).partition("@")
        try:
            runs[label] = load(path)
        except (OSError, ValueError) as e:
            raise SystemExit(f"prefill_table: cannot read {path}: {e}")
        if meth:
            methods[label] = meth
    t = build(runs, args.method, args.budget, methods)
    if not t["modes"]:
        raise SystemExit(f"prefill_table: no results of {args.method}@{args.budget} in these runs")
    md = to_markdown(t)
    print(md, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "prefill_table.json").write_text(json.dumps(t, indent=1))
        (out / "prefill_table.md").write_text(md)
        plot(t, out / "prefill_table.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
