"""``polykv-cpp plan show FILE``: the per-layer table of a plan (GGUF or JSON), and ``--png`` a figure.

The figure has the budgets per layer as bars coloured by pattern (one panel per phase) and, when a signals file
from calibration is found (``--signals``, else ``<FILE>.signals.npz``, else the file named in the plan's
provenance next to FILE), heatmaps of the preference signal layer x pattern with the chosen pattern marked.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from polykv_cpp.errors import PolyKVError

PHASES = ("prefill", "decode")
# fixed colours per registry pattern (stable across plots)
COLORS = {"streamingllm": "#1f77b4", "h2o": "#ff7f0e", "snapkv": "#2ca02c", "tova": "#d62728",
          "pyramidkv": "#9467bd", "fullkv": "#7f7f7f", "knorm": "#8c564b"}


def _fmt_params(pp: Any) -> str:
    bits = []
    if pp.is_full:
        return ""
    if pp.n_sink:
        bits.append(f"sink={pp.n_sink}")
    if pp.window is not None:
        bits.append(f"win={pp.window}")
    if pp.obs_window is not None:
        bits.append(f"obs={pp.obs_window}")
    if pp.pool_kernel is not None:
        bits.append(f"pool={pp.pool_kernel}" + (f"{pp.pool_shift:+d}" if pp.pool_shift else ""))
    return ",".join(bits)


def plan_table(plan: Any) -> str:
    """The per-layer table as text."""
    total = plan.n_layer * plan.budget_avg
    budgets = {ph: plan.token_budgets(ph) for ph in PHASES}
    rows = [("layer", "prefill", "budget", "share", "params", "decode", "budget", "share", "params")]
    for lp in plan.layers:
        r: list[str] = [str(lp.layer)]
        for ph in PHASES:
            pp = lp.phase(ph)
            b = budgets[ph][lp.layer]
            if b is None:
                bs, sh = "full", f"{(plan.full_charge or 0) / total:.1%}" if plan.full_charge else "-"
            else:
                bs, sh = str(b), f"{b / total:.1%}"
            r += [pp.pattern + (f"/{pp.selection}" if pp.per_head else ""), bs, sh, _fmt_params(pp)]
        rows.append(tuple(r))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i in (0, 2, 3, 6, 7) else c.ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    for ph in PHASES:
        bs = budgets[ph]
        n_full = sum(b is None for b in bs)
        s = sum(b for b in bs if b is not None)
        charged = f" + {n_full} FullKV x {plan.full_charge}" if n_full else ""
        lines.append(f"{ph}: total {s}{charged} = {s + n_full * (plan.full_charge or 0)} tokens "
                     f"(n_layer x budget_avg = {total})")
    return "\n".join(lines)


def header(plan: Any) -> str:
    pv = plan.provenance
    out = [plan.summary()]
    if pv.date or pv.tool_version:
        out.append(f"made {pv.date or '?'} by {pv.tool_version or '?'}")
    if pv.signals:
        out.append("signals: " + ", ".join(pv.signals))
    cal = pv.calibration
    if isinstance(cal, dict):
        keys = ("dataset", "n_samples", "ctx")
        out.append("calibration: " + ", ".join(f"{k}={cal[k]}" for k in keys if k in cal))
    elif cal:
        out.append(f"calibration: {cal}")
    return "\n".join(out)


def find_signals(path: Path, plan: Any, explicit: str | None) -> Path | None:
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise PolyKVError(f"signals file not found: {p}")
        return p
    cands = [path.with_name(path.name + ".signals.npz")]
    name = (plan.provenance.extra or {}).get("signals_file")
    if isinstance(name, str):
        cands.append(path.with_name(Path(name).name))
    for c in cands:
        if c.is_file():
            return c
    return None


def draw_png(plan: Any, out: Path, signals: Path | None = None, title: str | None = None) -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise PolyKVError("--png needs matplotlib (pip install matplotlib)") from None
    import numpy as np

    sig = None
    if signals is not None:
        with np.load(signals, allow_pickle=False) as z:
            sig = {k: z[k] for k in z.files}
    heat = []
    if sig is not None:
        for ph, key in (("prefill", "cos_prefill"), ("decode", "cos_decode")):
            if key in sig:
                heat.append((ph, key))
    ncols = 2 + len(heat)
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, max(4.0, 0.28 * plan.n_layer + 1.6)),
                             squeeze=False, gridspec_kw={"width_ratios": [1.3, 1.3] + [1.0] * len(heat)})
    axes = axes[0]
    layers = np.arange(plan.n_layer)
    used = []
    for ai, ph in enumerate(PHASES):
        ax = axes[ai]
        bs = plan.resolved_budgets(ph, plan.full_charge or max(b or 0 for b in plan.token_budgets(ph)) or 1)
        pats = plan.patterns(ph)
        bars = ax.barh(layers, bs, color=[COLORS.get(p, "#333333") for p in pats], edgecolor="black", linewidth=0.3)
        for bar, lp in zip(bars, plan.layers):
            if lp.phase(ph).per_head:
                # this layer keeps one token set per KV head (budgets split across heads by score: crossed)
                bar.set_hatch("xxx" if lp.phase(ph).adaptive else "///")
        ax.axvline(plan.budget_avg, color="black", linestyle="--", linewidth=0.8)
        ax.axvline(plan.b_min, color="grey", linestyle=":", linewidth=0.8)
        ax.set_yticks(layers)
        ax.invert_yaxis()
        ax.set_xlabel("tokens kept")
        ax.set_ylabel("layer")
        ax.set_title(f"{ph}: budget per layer")
        used += pats
    handles = [Patch(color=COLORS.get(p, "#333333"), label=p) for p in dict.fromkeys(used)]
    if any(lp.phase(ph).per_head for lp in plan.layers for ph in PHASES):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="per KV head"))
    if any(lp.phase(ph).adaptive for lp in plan.layers for ph in PHASES):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="xxx", label="adaptive heads"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, title="pattern", frameon=False)
    for hi, (ph, key) in enumerate(heat):
        ax = axes[2 + hi]
        m = np.asarray(sig[key])
        names = [str(x) for x in sig.get("patterns", np.arange(m.shape[1]))]
        im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=float(np.nanmin(m)), vmax=1.0)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(m.shape[0]))
        ax.set_title(f"{ph} signal: cosine")
        chosen = plan.patterns(ph)
        for l, p in enumerate(chosen[:m.shape[0]]):
            if p in names:
                ax.plot(names.index(p), l, marker="o", color="red", markersize=4)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(title or plan.summary()[:160], fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def cmd_show(args: argparse.Namespace) -> int:
    from polykv_cpp import plan as plan_mod

    path = Path(args.file)
    if args.query_agnostic:
        if not path.is_file():
            raise plan_mod.PlanError(f"plan file not found: {path}")
        plan = plan_mod.read_gguf(path, validate=not args.no_validate, key=plan_mod.GGUF_KEY_PLAN_QUERY_AGNOSTIC) \
            if plan_mod._is_gguf(path) else None
        if plan is None:
            raise plan_mod.PlanError(f"{path} holds no {plan_mod.GGUF_KEY_PLAN_QUERY_AGNOSTIC} plan")
    else:
        plan = plan_mod.load(path, validate=not args.no_validate)
    if args.json:
        print(plan.to_json())
        return 0
    print(header(plan))
    print()
    print(plan_table(plan))
    if args.png:
        sig = None if args.no_signals else find_signals(path, plan, args.signals)
        out = draw_png(plan, Path(args.png), sig, title=f"{path.name}: {plan.summary()}"[:160])
        print(f"\nwrote {out}" + (f" (signals: {sig})" if sig else " (no signals file found)"))
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``show`` to the ``plan`` sub-command (``polykv_cpp.plan.PLAN_SUBPARSERS``)."""
    from polykv_cpp import plan as plan_mod

    sub = plan_mod.PLAN_SUBPARSERS
    if sub is None:  # plan.register_cli has not run: nothing to attach to
        return
    p = sub.add_parser("show", help="print a plan's per-layer table (and draw it with --png)",
                       description="Print the per-layer table of a plan (GGUF with polykv.plan, or JSON): pattern, "
                                   "budget, share of the total and parameters per phase.")
    p.add_argument("file", metavar="FILE", help="plan .json or .gguf")
    p.add_argument("--png", metavar="OUT.png", help="draw budgets (coloured by pattern) and the signal heatmaps")
    p.add_argument("--signals", metavar="FILE", help="calibration signals .npz (default: found next to FILE)")
    p.add_argument("--no-signals", action="store_true", help="do not look for a signals file")
    p.add_argument("--json", action="store_true", help="print the plan's JSON instead of the table")
    p.add_argument("--no-validate", action="store_true", help="show even an invalid plan")
    p.add_argument("--query-agnostic", action="store_true",
                   help="a GGUF's second plan, polykv.plan_query_agnostic (for prompts compressed before their question)")
    p.set_defaults(func=cmd_show)
