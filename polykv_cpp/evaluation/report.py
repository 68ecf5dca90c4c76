"""Reports of an evaluation: summary tables (in the JSON), markdown and PNG plots.

`summarize(results)` aggregates the per-sample records; `write_report(results, out_dir)` writes
`results.json`, `results.md` and the plots (`score_vs_budget.png`, `tasks_<protocol>.png`,
`ppl_vs_budget.png`, `longbench_vs_budget.png`). `polykv-cpp eval --report-only DIR` re-renders them from a
saved `results.json`.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from polykv_cpp.evaluation import scoring

FULL = "full"
#: bootstrap replicates of every interval (paired over samples, stratified by task)
N_BOOT = 2000
BASELINES = ("streamingllm", "h2o", "snapkv", "tova", "knorm", "pyramidkv")
TASK_KINDS = ("ruler", "longbench")


def _bk(budget: int | None) -> str:
    return FULL if budget is None else str(budget)


def _plan_methods(data: Mapping[str, Any]) -> list[str]:
    return [m for m in data.get("methods", []) if m in data.get("plans", {})]


# ------------------------------------------------------------------------------------------- summaries


def summarize(data: Mapping[str, Any]) -> dict[str, Any]:
    """Aggregate the records: task scores (0-100) per kind/protocol/length/method/budget with bootstrap 95%
    intervals, perplexity/KL, and the gap recovered by every plan method against the strongest baseline (with its
    interval)."""
    recs = data.get("records", [])
    out: dict[str, Any] = {}
    reps: dict[tuple, np.ndarray] = {}
    for kind in TASK_KINDS:
        rs = [r for r in recs if r["kind"] == kind]
        if rs:
            out[kind] = _task_table(rs, reps, kind)
    pp = [r for r in recs if r["kind"] == "ppl"]
    if pp:
        out["ppl"] = _ppl_table(pp)
    out["gap_recovered"] = _gaps(out, data, reps)
    return out


def bootstrap_task_average(scores: Mapping[str, Mapping[str, Mapping[Any, float]]], n_boot: int = N_BOOT,
                           seed: int = 0) -> dict[str, np.ndarray]:
    """Bootstrap replicates of the task-averaged score (0-100) of several methods on the same samples.

    ``scores[method][task][sample] = score`` (0-1). Every replicate draws, for each task, as many samples as the
    task has, with replacement, and the same draw serves every method (paired: a difference between two methods
    is measured on the same prompts); a method's replicate is the mean over tasks of its mean over the drawn
    samples it has. Returns ``method -> [n_boot]``; the 2.5 and 97.5 percentiles are the 95% interval.
    """
    rng = np.random.default_rng(seed)
    tasks = sorted({t for by_t in scores.values() for t in by_t})
    draws = {}
    for t in tasks:
        ids = sorted({i for by_t in scores.values() for i in by_t.get(t, {})}, key=str)
        draws[t] = (ids, rng.integers(0, len(ids), size=(n_boot, len(ids))))
    out: dict[str, np.ndarray] = {}
    for m, by_t in scores.items():
        per_task = []
        for t in tasks:
            if t not in by_t:
                continue
            ids, idx = draws[t]
            vals = np.array([by_t[t].get(i, np.nan) for i in ids], dtype=np.float64)
            with np.errstate(invalid="ignore"):
                per_task.append(np.nanmean(vals[idx], axis=1))
        out[m] = 100 * np.nanmean(np.stack(per_task), axis=0) if per_task else np.full(n_boot, np.nan)
    return out


def interval(reps: np.ndarray) -> list[float] | None:
    """The 95% percentile interval of bootstrap replicates (None if they are all undefined)."""
    reps = reps[np.isfinite(reps)]
    if reps.size == 0:
        return None
    return [float(np.percentile(reps, 2.5)), float(np.percentile(reps, 97.5))]


def _task_table(rs: list[dict[str, Any]], reps: dict[tuple, np.ndarray] | None = None, kind: str = "ruler"
                ) -> dict[str, Any]:
    # protocol -> length ("all" too) -> method -> budget -> task -> sample -> score
    acc: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))))
    for r in rs:
        for L in (str(r["length"]), "all"):
            acc[r["protocol"]][L][r["method"]][_bk(r["budget"])][r["task"]][(r["length"], r["index"])] = r["score"]
    table: dict[str, Any] = {}
    for p, by_len in acc.items():
        for L, by_m in by_len.items():
            for m, by_b in by_m.items():
                for b, by_t in by_b.items():
                    t_means = {t: 100 * sum(v.values()) / len(v) for t, v in sorted(by_t.items())}
                    cell = {"avg": sum(t_means.values()) / len(t_means), "tasks": t_means,
                            "n": sum(len(v) for v in by_t.values())}
                    table.setdefault(p, {}).setdefault(L, {}).setdefault(m, {})[b] = cell
            # paired intervals: per budget, every method at that budget with FullKV, on the same draws
            budgets = {b for by_b in by_m.values() for b in by_b if b != FULL}
            for b in sorted(budgets, key=int) or [FULL]:
                group = {m: by_b[b] for m, by_b in by_m.items() if b in by_b}
                if FULL in by_m.get("fullkv", {}):
                    group["fullkv"] = by_m["fullkv"][FULL]
                for m, r in bootstrap_task_average(group).items():
                    mb = FULL if m == "fullkv" else b
                    table[p][L][m][mb].setdefault("ci95", interval(r))
                    if reps is not None:
                        reps[(kind, p, L, m, b)] = r
    return table


def _ppl_table(rs: list[dict[str, Any]]) -> dict[str, Any]:
    acc: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rs:
        for L in (str(r["length"]), "all"):
            acc[L][r["method"]][_bk(r["budget"])].append(r)
    table: dict[str, Any] = {}
    for L, by_m in acc.items():
        for m, by_b in by_m.items():
            for b, lst in by_b.items():
                n = sum(r["n_scored"] for r in lst)
                nll = sum(r["nll"] * r["n_scored"] for r in lst) / n
                table.setdefault(L, {}).setdefault(m, {})[b] = {
                    "ppl": math.exp(nll), "nll": nll, "kl": sum(r["kl"] * r["n_scored"] for r in lst) / n,
                    "top1": 100 * sum(r["top1"] * r["n_scored"] for r in lst) / n, "n_scored": n,
                    "texts": sorted({r["task"] for r in lst})}
    return table


def _budgets(table_by_m: Mapping[str, Mapping[str, Any]]) -> list[str]:
    bs = {b for by_b in table_by_m.values() for b in by_b if b != FULL}
    return sorted(bs, key=int)


def _gap_cell(by_m: Mapping[str, Mapping[str, Any]], plan: str, b: str, get, higher: bool,
              reps: Mapping[str, np.ndarray] | None = None) -> dict[str, Any] | None:
    if plan not in by_m or b not in by_m[plan] or FULL not in by_m.get("fullkv", {}):
        return None
    vals = {m: get(by_m[m][b]) for m in BASELINES if m in by_m and b in by_m[m]}
    best, best_v = scoring.best_baseline(vals, BASELINES, higher)
    full_v = get(by_m["fullkv"][FULL])
    plan_v = get(by_m[plan][b])
    cell = {"value": scoring.gap_recovered(plan_v, best_v, full_v, higher), "plan": plan_v, "best": best,
            "best_value": best_v, "fullkv": full_v}
    if reps is not None and best is not None and all(k in reps for k in (plan, best, "fullkv")):
        # the best baseline is the one of the point estimate; its gap is re-measured on every replicate
        gap = reps["fullkv"] - reps[best]
        with np.errstate(divide="ignore", invalid="ignore"):
            g = np.where(gap > 1e-12, (reps[plan] - reps[best]) / gap, np.nan)
        cell["ci95"] = interval(g)
        cell["diff_ci95"] = interval(reps[plan] - reps[best])
    return cell


def _gaps(summary: Mapping[str, Any], data: Mapping[str, Any], reps: Mapping[tuple, np.ndarray] | None = None
          ) -> dict[str, Any]:
    plans = _plan_methods(data)
    reps = reps or {}
    out: dict[str, Any] = {}
    for kind in TASK_KINDS:
        for p, by_len in summary.get(kind, {}).items():
            for L, by_m in by_len.items():
                for plan in plans:
                    for b in _budgets(by_m):
                        r = {m: v for (k, pp, LL, m, bb), v in reps.items() if (k, pp, LL, bb) == (kind, p, L, b)}
                        cell = _gap_cell(by_m, plan, b, lambda c: c["avg"], True, r or None)
                        if cell:
                            out.setdefault(kind, {}).setdefault(p, {}).setdefault(L, {}).setdefault(plan, {})[b] = cell
    for L, by_m in summary.get("ppl", {}).items():
        for plan in plans:
            for b in _budgets(by_m):
                for metric in ("kl", "ppl"):
                    cell = _gap_cell(by_m, plan, b, lambda c, k=metric: c[k], False)
                    if cell:
                        out.setdefault("ppl", {}).setdefault(metric, {}).setdefault(L, {}).setdefault(plan, {})[b] = cell
    return out


# ------------------------------------------------------------------------------------------- markdown


def _f(x: float | None, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{nd}f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _section(L: list[str], title: str, lines: list[str], always: bool = False) -> None:
    """Append a `## title` section with `lines` (nothing when there are none, unless `always`)."""
    if lines or always:
        L.extend([f"## {title}", "", *lines, ""])


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(cols: list[str]) -> list[str]:
    return [_row(cols), _row(["---"] * len(cols))]


def _method_order(data: Mapping[str, Any], present: Iterable[str]) -> list[str]:
    present = set(present)
    return [m for m in data.get("methods", []) if m in present] + sorted(present - set(data.get("methods", [])))


def _budget_label(b: str, lengths: list[int]) -> str:
    if len(lengths) == 1:
        return f"{b} ({100 * int(b) / lengths[0]:.1f}%)"
    return b


def _task_avg_table(data: Mapping[str, Any], by_m: Mapping[str, Any], gaps: Mapping[str, Any], lengths: list[int]
                    ) -> list[str]:
    budgets = _budgets(by_m)
    lines = _header(["method"] + [_budget_label(b, lengths) for b in budgets])
    for m in _method_order(data, by_m):
        if m == "fullkv":
            v = _with_ci(by_m[m].get(FULL, {}))
            lines.append(_row(["**fullkv** (keeps all)"] + [v] * len(budgets)))
        else:
            lines.append(_row([m] + [_with_ci(by_m[m].get(b, {})) for b in budgets]))
    for plan, by_b in gaps.items():
        cells = []
        for b in budgets:
            c = by_b.get(b)
            if not c or c["value"] is None:
                cells.append("n/a")
                continue
            ci = c.get("ci95")
            ci_s = f" [{_pct(ci[0])}, {_pct(ci[1])}]" if ci else ""
            cells.append(f"{_pct(c['value'])}{ci_s} (vs {c['best']})")
        lines.append(_row([f"gap recovered by {plan}"] + cells))
    return lines


def _with_ci(cell: Mapping[str, Any]) -> str:
    """"47.1 [40.2-53.9]": the average and its bootstrap 95% interval."""
    v = _f(cell.get("avg"))
    ci = cell.get("ci95")
    return f"{v} [{_f(ci[0])}-{_f(ci[1])}]" if ci else v


def _task_detail(data: Mapping[str, Any], by_m: Mapping[str, Any], b: str) -> list[str]:
    tasks = sorted({t for by_b in by_m.values() for c in by_b.values() for t in c["tasks"]})
    lines = _header(["method"] + tasks + ["avg"])
    for m in _method_order(data, by_m):
        c = by_m[m].get(FULL if m == "fullkv" else b)
        if not c:
            continue
        lines.append(_row([m] + [_f(c["tasks"].get(t)) for t in tasks] + [_f(c["avg"])]))
    return lines


def to_markdown(data: Mapping[str, Any]) -> str:
    env = data.get("environment", {})
    cfg = data.get("config", {})
    summ = data.get("summary") or summarize(data)
    gaps = summ.get("gap_recovered", {})
    lengths = cfg.get("lengths", [])
    L: list[str] = []
    L.append(f"# PolyKV evaluation: {env.get('model_description', '?')}")
    L.append("")
    if data.get("partial"):
        L.append("**Partial results** (the run has not finished).")
        L.append("")
    L.append(f"- model: `{env.get('model')}` ({env.get('arch')}, {env.get('n_layer')} layers)")
    L.append(f"- device: {env.get('device')}, {env.get('n_threads')} threads; n_ctx {env.get('n_ctx')}, "
             f"n_ubatch {cfg.get('n_ubatch')}, KV {cfg.get('type_k')}/{cfg.get('type_v')}; chat format: "
             f"{env.get('chat_format')}")
    L.append(f"- prefill: {data.get('prefill') or 'chunked: compressed after every ubatch'}")
    L.append(f"- polykv-cpp {env.get('polykv_cpp')}, llama.cpp {env.get('llama_cpp')}; seed {cfg.get('seed')}; "
             f"{env.get('elapsed_s')} s")
    L.append(f"- lengths (prompt + answer budget, tokens of this model): {', '.join(map(str, lengths))}; "
             f"{cfg.get('n_samples')} sample(s) per task and length")
    L.append(f"- budgets: {data.get('budget_definition', '')}")
    windows = data.get("sliding_window_layers") or {}
    capped = (f"; a sliding-window layer gets at most its window ({len(windows)} layers, "
              f"{', '.join(sorted({str(w) for w in windows.values()}))} tokens) and the rest goes to the other layers"
              if windows else "")
    for name, p in data.get("plans", {}).items():
        L.append(f"- plan `{name}`: {p.get('summary')} (from {p.get('origin')}); as written at budget "
                 f"{p.get('budget_avg')}, rescaled to other budgets with `Plan.scaled` (b_min {p.get('b_min')} "
                 f"kept{capped})")
    L.append("- protocols:")
    for p, text in data.get("protocols", {}).items():
        L.append(f"  - **{p}**: {text}")
    L.append("- gap recovered = (plan - best baseline) / (FullKV - best baseline); the best baseline is the "
             "strongest of streamingllm, h2o, snapkv, tova, knorm, pyramidkv at that budget (lowest for "
             "perplexity/KL); n/a when FullKV is not better than it")
    L.append("")
    titles = {"ruler": "RULER-style synthetic tasks", "longbench": "LongBench"}
    for kind in TASK_KINDS:
        if kind not in summ:
            continue
        for proto, by_len in summ[kind].items():
            L.append(f"## {titles[kind]} - protocol: {proto}")
            L.append("")
            keys = ["all"] + sorted((k for k in by_len if k != "all"), key=int)
            if len(keys) == 2:
                keys = keys[1:]
            for Lk in keys:
                what = "all lengths" if Lk == "all" else f"length {Lk}"
                L.append(f"### Average score (0-100) over tasks, {what}")
                L.append("")
                L += _task_avg_table(data, by_len[Lk], gaps.get(kind, {}).get(proto, {}).get(Lk, {}),
                                     [int(Lk)] if Lk != "all" else lengths)
                L.append("")
            top = by_len["all"] if "all" in by_len else by_len[keys[0]]
            for b in _budgets(top):
                L.append(f"### Per task, budget {b} ({proto}, all lengths)")
                L.append("")
                L += _task_detail(data, top, b)
                L.append("")
    if "ppl" in summ:
        L.append("## Perplexity and KL divergence against FullKV (teacher-forced)")
        L.append("")
        texts = ", ".join(f"`{n}` ({o})" for n, o in data.get("ppl_texts", []))
        L.append(f"Texts: {texts}. {data.get('protocols', {}).get('teacher-forced', '')}. KL = mean over scored "
                 "tokens of KL(FullKV || method) in nats; top-1 = % of tokens whose most likely next token equals "
                 "FullKV's.")
        L.append("")
        by_m = summ["ppl"]["all"]
        budgets = _budgets(by_m)
        L += _header(["method"] + [f"ppl@{b}" for b in budgets] + [f"KL@{b}" for b in budgets] +
                     [f"top-1@{b}" for b in budgets])
        for m in _method_order(data, by_m):
            if m == "fullkv":
                c = by_m[m][FULL]
                L.append(_row(["**fullkv**"] + [_f(c["ppl"], 3)] * len(budgets) + ["0"] * len(budgets) +
                              ["100"] * len(budgets)))
                continue
            cs = [by_m[m].get(b) for b in budgets]
            L.append(_row([m] + [_f(c and c["ppl"], 3) for c in cs] + [_f(c and c["kl"], 4) for c in cs] +
                          [_f(c and c["top1"]) for c in cs]))
        for plan, by_b in gaps.get("ppl", {}).get("kl", {}).get("all", {}).items():
            L.append(_row([f"KL gap recovered by {plan}"] + [""] * len(budgets) +
                          ["n/a" if not by_b.get(b) or by_b[b]["value"] is None else
                           f"{_pct(by_b[b]['value'])} (vs {by_b[b]['best']})" for b in budgets] + [""] * len(budgets)))
        L.append("")
    lb = data.get("longbench")
    if isinstance(lb, dict) and lb:
        L.append("## LongBench sources")
        L.append("")
        for t, st in lb.items():
            L.append(f"- {t}: {st}")
        L.append("")
    elif lb:
        L.append(f"LongBench: {lb}.")
        L.append("")
    L.append("## Runs: status and KV memory")
    L.append("")
    L += _header(["method", "budget", "budget / shortest length", "status", "KV MiB", "FullKV KV MiB", "seconds"])
    short = min(lengths) if lengths else None
    for r in data.get("runs", []):
        b = r.get("budget")
        ratio = "-" if b is None or not short else f"{100 * b / short:.1f}%"
        kv = r.get("kv_bytes")
        kvf = r.get("kv_bytes_fullkv")
        secs = (r.get("task_seconds") or 0) + (r.get("ppl_seconds") or 0)
        status = r.get("status", "?")
        if len(status) > 70:
            status = status[:67] + "..."
        L.append(_row([r["method"], "full" if b is None else str(b), ratio, status,
                       _f(kv / 2**20 if kv else None, 2), _f(kvf / 2**20 if kvf else None, 2), _f(secs, 1)]))
    L.append("")
    _section(L, "What was reused", [f"- {line}" for line in data.get("reuse", {}).get("summary", [])], always=True)
    _section(L, "Notes", [f"- {n}" for n in data.get("notes", [])])
    _section(L, "Plots", [f"![{name}]({name})" for name in data.get("plots", [])])
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------- plots

_STYLE = {"fullkv": ("black", "--"), "streamingllm": ("tab:gray", "-"), "h2o": ("tab:orange", "-"),
          "snapkv": ("tab:blue", "-"), "tova": ("tab:green", "-"), "knorm": ("tab:purple", "-"),
          "pyramidkv": ("tab:cyan", "-"), "kvzip": ("darkgoldenrod", "-"),
          "expected_attention": ("tab:pink", "-")}
_PLAN_COLORS = ("tab:red", "tab:brown", "tab:pink", "tab:olive")


def _style(m: str, plans: list[str]) -> tuple[str, str, float]:
    if m in _STYLE:
        c, ls = _STYLE[m]
        return c, ls, 1.5
    if m.endswith("-head") and m[:-5] in _STYLE:
        return _STYLE[m[:-5]][0], ":", 1.8  # a per-head baseline: its pattern's colour, dotted
    return _PLAN_COLORS[plans.index(m) % len(_PLAN_COLORS)] if m in plans else "tab:olive", "-", 2.6


def _lines(ax, data: Mapping[str, Any], by_m: Mapping[str, Any], get, ylabel: str, title: str) -> None:
    plans = _plan_methods(data)
    budgets = _budgets(by_m)
    xs = [int(b) for b in budgets]
    for m in _method_order(data, by_m):
        c, ls, lw = _style(m, plans)
        if m == "fullkv":
            v = get(by_m[m].get(FULL))
            if v is not None and xs:
                ax.axhline(v, color=c, ls=ls, lw=1.2, label="fullkv")
            continue
        pts = [(x, get(by_m[m].get(b))) for x, b in zip(xs, budgets)]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=c, ls=ls, lw=lw, label=m)
    if xs:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("average KV budget (tokens per layer)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)


def _legend(ax, **kw: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def write_plots(data: Mapping[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    summ = data.get("summary") or summarize(data)
    files: list[str] = []
    name = data.get("environment", {}).get("model_description", "")

    def save(fig, fname: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        files.append(fname)

    for kind, fname in (("ruler", "score_vs_budget.png"), ("longbench", "longbench_vs_budget.png")):
        if kind not in summ:
            continue
        protos = list(summ[kind])
        fig, axes = plt.subplots(1, len(protos), figsize=(6.2 * len(protos), 4.4), squeeze=False)
        for ax, p in zip(axes[0], protos):
            by_m = summ[kind][p].get("all") or next(iter(summ[kind][p].values()))
            _lines(ax, data, by_m, lambda c: c and c["avg"], "average score (0-100)",
                   f"{'RULER-style' if kind == 'ruler' else 'LongBench'}, {p}")
        _legend(axes[0][0], fontsize=8)
        fig.suptitle(name, fontsize=10)
        save(fig, fname)
    if "ruler" in summ:
        for p, by_len in summ["ruler"].items():
            by_m = by_len.get("all") or next(iter(by_len.values()))
            budgets = _budgets(by_m)
            tasks = sorted({t for by_b in by_m.values() for c in by_b.values() for t in c["tasks"]})
            methods = _method_order(data, by_m)
            plans = _plan_methods(data)
            if not budgets or not tasks:
                continue
            fig, axes = plt.subplots(len(budgets), 1, figsize=(max(8.0, 1.3 * len(tasks) + 3.5), 2.7 * len(budgets) + 0.4),
                                     squeeze=False)
            width = 0.8 / max(1, len(methods))
            for ax, b in zip(axes[:, 0], budgets):
                for j, m in enumerate(methods):
                    c = by_m[m].get(FULL if m == "fullkv" else b)
                    if not c:
                        continue
                    ys = [c["tasks"].get(t, 0.0) for t in tasks]
                    ax.bar([i + (j - (len(methods) - 1) / 2) * width for i in range(len(tasks))], ys, width,
                           color=_style(m, plans)[0], label=m, edgecolor="white", lw=0.3)
                ax.set_xticks(range(len(tasks)))
                ax.set_xticklabels(tasks, fontsize=8)
                ax.set_ylim(0, 105)
                ax.set_ylabel(f"score, budget {b}", fontsize=8)
                ax.grid(axis="y", alpha=0.3)
            _legend(axes[0, 0], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            fig.suptitle(f"{name}: per-task scores, {p}", fontsize=10)
            save(fig, f"tasks_{p}.png")
    if "ppl" in summ:
        by_m = summ["ppl"]["all"]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
        _lines(axes[0], data, by_m, lambda c: c and c["kl"], "KL(FullKV || method), nats", "KL vs FullKV")
        _lines(axes[1], data, by_m, lambda c: c and c["ppl"], "perplexity", "perplexity (teacher-forced)")
        axes[0].set_yscale("symlog", linthresh=1e-3)
        axes[0].set_ylim(bottom=0)
        _legend(axes[0], fontsize=8)
        fig.suptitle(name, fontsize=10)
        save(fig, "ppl_vs_budget.png")
    return files


# ---------------------------------------------------------------------------------------------- files


def write_report(data: dict[str, Any], out_dir: Path, *, png: bool = True) -> dict[str, Path]:
    """Write results.json, results.md and (with matplotlib) the PNG plots; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    data["summary"] = summarize(data)
    data["plots"] = []
    if png:
        try:
            data["plots"] = write_plots(data, out_dir)
        except ImportError:
            data.setdefault("notes", []).append("plots skipped: matplotlib is not installed "
                                                "(pip install 'polykv-cpp[plot]')")
    for f in data["plots"]:
        paths[Path(f).stem] = out_dir / f
    from polykv_cpp.evaluation.runner import _json_default

    p = out_dir / "results.json"
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_json_default))
    tmp.replace(p)
    paths["json"] = p
    md = out_dir / "results.md"
    md.write_text(to_markdown(data))
    paths["markdown"] = md
    return paths


def load_results(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    if not p.is_file():
        raise FileNotFoundError(f"no results.json at {p}")
    return json.loads(p.read_text())
