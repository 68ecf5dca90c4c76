#!/usr/bin/env python3
"""KV-cache benchmark: PolyKV plan vs FullKV (stock llama.cpp cache) at several context depths.

For every configuration (FullKV, then each plan) a fresh subprocess loads the model, creates one context of
``--ctx`` cells and, for every depth D in ``--depths``:

* prefills the first D tokens of a deterministic synthetic prompt (Python stdlib source text) in n_batch
  chunks and times it (prefill tok/s, wall clock up to the first logits);
* then generates ``--n-gen`` tokens greedily and reports decode tok/s from llama.cpp's perf counters
  (``eval_ms`` / ``eval_tokens``; the wall-clock rate is stored too);
* records the KV cells in use and the tokens evicted so far.

It also times a prefill of ``--prefill-len`` tokens (reusing the depth measurement when that length is one of
the depths), the allocated KV bytes (sum of the per-layer buffers under a plan, the stock formula without),
the FullKV bytes at the same n_ctx, whether any layer got a full-size (n_ctx) buffer, and the peak RSS of the
subprocess (VmHWM). The derived ratios of the issue are computed at the end (see ``derive_ratios``), printed as
markdown tables, and written to ``--out`` (JSON) and ``--png``.

    python scripts/bench_kv.py                                   # default model, uniform StreamingLLM b=512
    python scripts/bench_kv.py --plan model.polykv.gguf --kv-budget 512 --depths 1024,4096,8192
    python scripts/bench_kv.py --quick --model tiny.gguf --uniform streamingllm --kv-budget 32

``--llama-bench`` additionally runs the stock ``llama-bench`` tool (prefill at ``--prefill-len``, decode at
each depth) per configuration, with the plan passed through ``LLAMA_POLYKV_PLAN`` and FullKV forced with
``LLAMA_POLYKV_DISABLE=1``, as an independent cross-check of the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

MIB = 1024 * 1024
EVENT_PREFIX = "@@BENCH "
TARGETS = {
    "decode_depth_ratio": 0.95,  # plan decode at the deepest depth / at the shallowest, >=
    "plan_vs_fullkv_decode": 1.3,  # plan decode / FullKV decode at the deepest depth, >=
    "prefill_overhead": 0.05,  # plan prefill time / FullKV prefill time - 1 at --prefill-len, <=
}
DEFAULT_DEPTHS = "512,1024,4096,8192"
QUICK = {"depths": "64,128", "prefill_len": 128, "n_gen": 8, "n_batch": 64, "n_ubatch": 32, "ctx": 512}
# stdlib modules whose source is the synthetic prompt, in this order (then any other stdlib *.py, sorted)
PROMPT_MODULES = ("argparse.py", "dataclasses.py", "typing.py", "inspect.py", "functools.py", "subprocess.py",
                  "tarfile.py", "zipfile/__init__.py", "zipfile.py", "pathlib.py", "pathlib/__init__.py",
                  "shutil.py", "tempfile.py", "textwrap.py", "string.py", "enum.py", "ast.py")


# ---------------------------------------------------------------------------------------------- prompt


def prompt_text(min_chars: int) -> tuple[str, list[str]]:
    """Deterministic source text of at least `min_chars` characters (the stdlib of this Python) and the files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / m for m in PROMPT_MODULES if (root / m).is_file()]
    seen = set(files)
    parts, used, total = [], [], 0
    for path in files + sorted(p for p in root.glob("*.py") if p not in seen):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        used.append(str(path.relative_to(root)))
        total += len(text)
        if total >= min_chars:
            break
    return "\n\n".join(parts), used


def prompt_tokens(model, n: int) -> tuple[list[int], list[str]]:
    """The first `n` tokens of the synthetic prompt (BOS as the model wants it)."""
    chars = 4 * n + 4096
    while True:
        text, files = prompt_text(chars)
        toks = model.tokenize(text, add_special=True, parse_special=False)
        if len(toks) >= n:
            return toks[:n], files
        if len(text) < chars:  # the whole stdlib is not enough: repeat it
            text = text * (n // max(len(toks), 1) + 1)
            toks = model.tokenize(text, add_special=True, parse_special=False)
            return toks[:n], files
        chars *= 2


# ---------------------------------------------------------------------------------------------- worker


def _proc_status(key: str) -> int:
    """A kB field of /proc/self/status (VmHWM, VmRSS) in bytes; 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if key == "VmHWM":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return 0


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _emit(kind: str, **data) -> None:
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": kind, **data}) + "\n")
    sys.stdout.flush()


def _make_plan(spec: dict, n_layer: int):
    from polykv_cpp import plan as plan_mod

    if spec["kind"] == "uniform":
        return plan_mod.method_plan(n_layer, spec["pattern"], spec["kv_budget"])
    if spec["kind"] == "file":
        return plan_mod.load(spec["path"], n_layer=n_layer)
    raise ValueError(f"unknown plan kind {spec['kind']!r}")


def _graph_inputs(log: str) -> list[int] | None:
    """The scheduler's count of graph inputs, [prompt, decode] ubatch (each a copy per split to a device; the
    groups' inputs are packed on a device, docs/design.md), from its reserve line in the context's log."""
    m = re.search(r"input tensors = (\d+)(?: / (\d+))?", log)
    if not m:
        return None
    return [int(m.group(1)), int(m.group(2) or m.group(1))]


def run_config(spec: dict) -> dict:
    """Measure one configuration in this process (the worker side); returns the result dict."""
    import inspect

    import numpy as np

    from polykv_cpp.api import KV_TYPE_BYTES, Context, Model

    # FullKV as llama.cpp's tools allocate it (sliding-window layers: window + one ubatch); an older package: its default
    stock_swa = {"swa_full": False} if "swa_full" in inspect.signature(Context.__init__).parameters else {}

    s = spec["settings"]
    res: dict = {"name": spec["name"], "kind": spec["kind"], "loadavg_start": _loadavg()}
    if s.get("rpc"):
        from polykv_cpp import _native

        res["rpc_devices"] = _native.add_rpc_servers(s["rpc"])
    t0 = time.perf_counter()
    with Model(s["model"], n_gpu_layers=s["n_gpu_layers"]) as model:
        res["load_s"] = time.perf_counter() - t0
        res["rss_after_load_bytes"] = _proc_status("VmRSS")
        plan = None
        if spec["kind"] == "fullkv":
            model.set_plan(None)  # an empty override: also disables a plan stored in the model file
        elif spec["kind"] == "gguf":
            model.set_plan(use_gguf=True, kv_budget=spec["kv_budget"])
        else:
            plan = _make_plan(spec, model.n_layer)
            model.set_plan(plan, kv_budget=spec["kv_budget"])
        if plan is not None:
            res["plan_summary"] = plan.summary()
        need = max(max(s["depths"]), s["prefill_len"])
        tokens, files = prompt_tokens(model, need)
        res["prompt_files"] = files[:5] + (["..."] if len(files) > 5 else [])
        from polykv_cpp import _native

        mark = _native.log_mark()
        with model.context(n_ctx=s["ctx"], n_batch=s["n_batch"], n_ubatch=s["n_ubatch"], n_threads=s["threads"],
                           flash_attn=s["flash_attn"], type_k=s["type_k"], type_v=s["type_v"], **stock_swa) as ctx:
            res["graph_inputs"] = _graph_inputs(_native.log_since(mark, min_level=2))
            res["n_ctx"] = ctx.n_ctx
            res["polykv_active"] = ctx.polykv_active
            res["rss_after_context_bytes"] = _proc_status("VmRSS")
            stats = ctx.kv_layer_stats()
            fullkv_formula = _fullkv_bytes(model, ctx.n_ctx, KV_TYPE_BYTES[s["type_k"]], KV_TYPE_BYTES[s["type_v"]],
                                           ctx.n_ubatch)
            if stats:
                res["kv_bytes"] = sum(x.bytes for x in stats)
                res["kv_bytes_fullkv"] = sum(x.bytes_fullkv for x in stats)
                caps = [x.capacity for x in stats]
                res["layers"] = [{"layer": x.layer, "group": x.group, "pattern_prefill": x.pattern_prefill,
                                  "pattern_decode": x.pattern_decode, "budget_prefill": x.budget_prefill,
                                  "budget_decode": x.budget_decode, "capacity": x.capacity, "bytes": x.bytes}
                                 for x in stats]
                res["kv_bytes_bound"] = sum(_expected_bytes(x, ctx.n_ctx, s["n_ubatch"]) for x in stats)
            else:
                res["kv_bytes"] = res["kv_bytes_fullkv"] = fullkv_formula
                caps = [ctx.n_ctx] * model.n_layer
                res["layers"] = []
            res["kv_bytes_fullkv_formula"] = fullkv_formula
            res["max_layer_capacity"] = max(caps)
            res["mean_layer_capacity"] = sum(caps) / len(caps)
            res["n_full_size_layers"] = sum(c >= ctx.n_ctx for c in caps)
            res["full_size_kv_buffer"] = max(caps) >= ctx.n_ctx
            res["kv_bytes_ratio"] = res["kv_bytes"] / res["kv_bytes_fullkv"]
            _emit("step", what="context")

            select_ms: list[float] = []

            reused: list[int] = []

            def greedy(n: int) -> tuple[float, float, int]:
                """n greedy decode steps after the current logits: (perf ms, wall s, perf tokens); the host time
                the plan's evictions took is appended to select_ms, the graphs llama.cpp reused to reused."""
                p0 = ctx.perf()
                s0, _ = ctx.decode_timing()
                w0 = time.perf_counter()
                for _ in range(n):
                    ctx.decode([int(np.argmax(ctx.logits()))])
                ctx.logits()  # sync the last step
                w = time.perf_counter() - w0
                p1 = ctx.perf()
                select_ms.append(ctx.decode_timing()[0] - s0)
                reused.append(int(p1["graphs_reused"] - p0["graphs_reused"]))
                return p1["eval_ms"] - p0["eval_ms"], w, int(p1["eval_tokens"] - p0["eval_tokens"])

            n_probe = s.get("prompt_probe", 0)

            def prefill(n: int) -> float:
                ctx.clear()
                w0 = time.perf_counter()
                ctx.decode(tokens[:n], probe=tokens[max(0, n - n_probe):n] if n_probe else None)
                ctx.logits()  # sync
                return time.perf_counter() - w0

            # warm-up: the first graphs of each shape allocate and touch buffers
            warm = min(len(tokens), max(2 * s["n_ubatch"], 8), ctx.n_ctx - 8)
            prefill(warm)
            greedy(2)
            ctx.clear()
            _emit("step", what="warmup")

            res["depths"] = []
            for depth in s["depths"]:
                runs = []
                for _ in range(s["reps"]):
                    t_pre = prefill(depth)
                    ms, wall, n_eval = greedy(s["n_gen"])
                    layer_stats = ctx.kv_layer_stats()
                    runs.append({
                        "prefill_s": t_pre,
                        "decode_ms_perf": ms,
                        "decode_s_wall": wall,
                        "decode_tokens_perf": n_eval,
                        "kv_used_cells": sum(x.used for x in layer_stats) if layer_stats else ctx.pos_max() + 1,
                        "n_evicted": sum(x.n_evicted for x in layer_stats) if layer_stats else 0,
                        "decode_select_ms": select_ms[-1],
                        "graphs_reused": reused[-1],
                    })
                prefill_s = statistics.median(r["prefill_s"] for r in runs)
                perf_rates = [1000.0 * r["decode_tokens_perf"] / r["decode_ms_perf"] for r in runs
                              if r["decode_ms_perf"] > 0 and r["decode_tokens_perf"] > 0]
                wall_rate = statistics.median(s["n_gen"] / r["decode_s_wall"] for r in runs)
                res["depths"].append({
                    "depth": depth,
                    "prefill_s": prefill_s,
                    "prefill_tok_s": depth / prefill_s,
                    "decode_tok_s": statistics.median(perf_rates) if perf_rates else wall_rate,
                    "decode_tok_s_source": "perf" if perf_rates else "wall",
                    "decode_tok_s_wall": wall_rate,
                    "select_ms_per_token": statistics.median(r["decode_select_ms"] for r in runs) / s["n_gen"],
                    "graphs_reused_share": statistics.median(r["graphs_reused"] for r in runs) / s["n_gen"],
                    "n_gen": s["n_gen"],
                    "kv_used_cells": runs[-1]["kv_used_cells"],
                    "n_evicted": runs[-1]["n_evicted"],
                    "runs": runs,
                })
                _emit("step", what=f"depth {depth}")

            plen = s["prefill_len"]
            same = [d for d in res["depths"] if d["depth"] == plen]
            if same:
                t = same[0]["prefill_s"]
            else:
                t = statistics.median(prefill(plen) for _ in range(s["reps"]))
                _emit("step", what=f"prefill {plen}")
            res["prefill_len"] = plen
            res["prefill_s_at_len"] = t
            res["device_repacks"] = ctx.device_repacks()
            res["prefill_tok_s_at_len"] = plen / t
            ctx.clear()
    res["peak_rss_bytes"] = _proc_status("VmHWM")
    res["total_s"] = time.perf_counter() - t0
    res["loadavg_end"] = _loadavg()
    return res


def _fullkv_bytes(model, n_ctx: int, bk: float, bv: float, n_ubatch: int) -> int:
    """Stock cache bytes: every layer stores K and V of every cell, a sliding-window layer of its window + one
    ubatch (as `polykv_cpp.cli.kv_cache_bytes`; an older package: every layer every cell)."""
    try:
        from polykv_cpp.cli import kv_cache_bytes

        return kv_cache_bytes(model, n_ctx, bk, bv, n_ubatch)
    except ImportError:  # older package: same formula
        arch = model.meta("general.architecture") or ""
        head_k = int(model.meta(f"{arch}.attention.key_length") or model.n_embd // max(model.n_head, 1))
        head_v = int(model.meta(f"{arch}.attention.value_length") or head_k)
        return int(model.n_layer * n_ctx * model.n_head_kv * (head_k * bk + head_v * bv))


def _expected_bytes(st, n_ctx: int, n_ubatch: int) -> int:
    """Bytes one layer should get per the design: min(n_ctx, pad256(max(budgets) + n_ubatch)) cells."""
    budgets = [b for b in (st.budget_prefill, st.budget_decode)]
    if any(b < 0 for b in budgets):
        cells = n_ctx
    else:
        cells = min(n_ctx, int(math.ceil((max(budgets) + n_ubatch) / 256) * 256))
    per_cell = st.bytes_fullkv / max(n_ctx, 1)
    return int(round(cells * per_cell))


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        res = run_config(spec)
    except Exception as e:  # reported to the parent, which prints it
        import traceback

        _emit("error", message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        return 1
    _emit("result", result=res)
    return 0


# ---------------------------------------------------------------------------------------------- parent


def run_in_subprocess(spec: dict, bar, timeout: float | None) -> dict:
    """Run one configuration in a fresh Python process (so its peak RSS is its own) and collect its events."""
    import threading

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        spec_path = f.name
    result, error, rc = None, None, None
    try:
        with tempfile.TemporaryFile("w+") as err:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", spec_path]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
            timer = threading.Timer(timeout, proc.kill) if timeout else None
            if timer:
                timer.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    if not line.startswith(EVENT_PREFIX):
                        continue
                    ev = json.loads(line[len(EVENT_PREFIX):])
                    if ev["event"] == "step":
                        bar.set_postfix_str(f"{spec['name']}: {ev['what']}")
                        bar.update(1)
                    elif ev["event"] == "result":
                        result = ev["result"]
                    elif ev["event"] == "error":
                        error = ev
                rc = proc.wait()
            finally:
                if timer:
                    timer.cancel()
            err.seek(0)
            stderr = err.read()
    finally:
        os.unlink(spec_path)
    if result is None:
        detail = error["traceback"] if error else (stderr[-4000:] or "no output")
        if timeout and rc in (-9, 137):
            detail = f"killed after --timeout {timeout} s\n{detail}"
        raise SystemExit(f"bench_kv: configuration {spec['name']!r} failed (exit code {rc}):\n{detail}")
    return result


def _by_depth(cfg: dict) -> dict[int, dict]:
    return {d["depth"]: d for d in cfg["depths"]}


def derive_ratios(configs: list[dict], depths: list[int], kv_budget: int, n_ubatch: int) -> list[dict]:
    """The issue's ratios, one dict per plan configuration (FullKV is the reference)."""
    d_hi = 8192 if 8192 in depths else max(depths)
    d_lo = 512 if 512 in depths and 512 < d_hi else min(depths)
    full = next((c for c in configs if c["kind"] == "fullkv"), None)
    out = []
    for c in configs:
        if c["kind"] == "fullkv":
            continue
        bd = _by_depth(c)
        r: dict = {"config": c["name"], "depth_hi": d_hi, "depth_lo": d_lo}
        v = bd[d_hi]["decode_tok_s"] / bd[d_lo]["decode_tok_s"]
        r["decode_depth_ratio"] = {"value": v, "target": TARGETS["decode_depth_ratio"], "op": ">=",
                                   "pass": v >= TARGETS["decode_depth_ratio"],
                                   "what": f"plan decode tok/s at depth {d_hi} / at depth {d_lo}"}
        if full is not None:
            fd = _by_depth(full)
            v = bd[d_hi]["decode_tok_s"] / fd[d_hi]["decode_tok_s"]
            r["plan_vs_fullkv_decode"] = {"value": v, "target": TARGETS["plan_vs_fullkv_decode"], "op": ">=",
                                          "pass": v >= TARGETS["plan_vs_fullkv_decode"],
                                          "what": f"plan / FullKV decode tok/s at depth {d_hi}"}
            v = c["prefill_s_at_len"] / full["prefill_s_at_len"] - 1.0
            r["prefill_overhead"] = {"value": v, "target": TARGETS["prefill_overhead"], "op": "<=",
                                     "pass": v <= TARGETS["prefill_overhead"],
                                     "what": f"plan / FullKV prefill time at {c['prefill_len']} tokens - 1"}
            r["fullkv_decode_depth_ratio"] = fd[d_hi]["decode_tok_s"] / fd[d_lo]["decode_tok_s"]
        # KV bytes: plan / FullKV at the same n_ctx, against (budget + headroom) / deepest depth, where the
        # headroom is what the design adds to a budget (one ubatch, padded to 256 cells)
        headroom = int(math.ceil((kv_budget + n_ubatch) / 256) * 256) - kv_budget
        target = (kv_budget + headroom) / d_hi
        v = c["kv_bytes"] / c["kv_bytes_fullkv"]
        r["kv_bytes_ratio"] = {"value": v, "target": target, "op": "<=", "pass": v <= target + 1e-9,
                               "headroom_tokens": headroom,
                               "what": f"plan / FullKV KV bytes at n_ctx {c['n_ctx']} vs "
                                       f"({kv_budget}+{headroom})/{d_hi}"}
        if "kv_bytes_bound" in c:
            r["kv_bytes_vs_design"] = {"value": c["kv_bytes"], "bound": c["kv_bytes_bound"],
                                       "pass": c["kv_bytes"] <= c["kv_bytes_bound"],
                                       "what": "allocated bytes vs sum of min(n_ctx, pad256(budget + n_ubatch))"}
        r["full_size_kv_buffer"] = c["full_size_kv_buffer"]
        out.append(r)
    return out


def markdown(report: dict) -> str:
    lines = []
    m = report["settings"]
    n_ctx = max((c["n_ctx"] for c in report["configs"]), default=m["ctx"])
    lines.append(f"### KV benchmark: {Path(m['model']).name}, n_ctx {n_ctx}, {m['threads']} threads, "
                 f"n_batch {m['n_batch']}, n_ubatch {m['n_ubatch']}, kv budget {m['kv_budget']}, n_gen {m['n_gen']}"
                 + (f", prompt probe {m['prompt_probe']}" if m.get("prompt_probe") else ""))
    lines.append("")
    lines.append("| config | depth | prefill tok/s | decode tok/s | decode tok/s (wall) | eviction ms/token | "
                 "graphs reused | KV MiB | FullKV MiB | KV ratio | max layer cells | full-size buffer | peak RSS MiB |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for c in report["configs"]:
        for d in c["depths"]:
            lines.append(f"| {c['name']} | {d['depth']} | {d['prefill_tok_s']:.1f} | {d['decode_tok_s']:.2f} | "
                         f"{d['decode_tok_s_wall']:.2f} | {d.get('select_ms_per_token', 0.0):.3f} | "
                         f"{100 * d.get('graphs_reused_share', 0.0):.0f}% | {c['kv_bytes'] / MIB:.2f} | "
                         f"{c['kv_bytes_fullkv'] / MIB:.2f} | {c['kv_bytes_ratio']:.4f} | "
                         f"{c['max_layer_capacity']} | {'yes' if c['full_size_kv_buffer'] else 'no'} | "
                         f"{c['peak_rss_bytes'] / MIB:.1f} |")
    lines.append("")
    lines.append("| config | prefill length | prefill tok/s | prefill s | graph inputs (prompt / decode ubatch) |")
    lines.append("|---|---:|---:|---:|---:|")
    for c in report["configs"]:
        inputs = " / ".join(map(str, c["graph_inputs"])) if c.get("graph_inputs") else "-"
        lines.append(f"| {c['name']} | {c['prefill_len']} | {c['prefill_tok_s_at_len']:.1f} | "
                     f"{c['prefill_s_at_len']:.2f} | {inputs} |")
    if report["ratios"]:
        lines.append("")
        lines.append("| config | metric | value | target | pass |")
        lines.append("|---|---|---:|---:|---|")
        for r in report["ratios"]:
            for key in ("decode_depth_ratio", "plan_vs_fullkv_decode", "prefill_overhead", "kv_bytes_ratio"):
                if key in r:
                    x = r[key]
                    val = f"{100 * x['value']:+.1f}%" if key == "prefill_overhead" else f"{x['value']:.3f}"
                    tgt = f"{x['op']} {100 * x['target']:.0f}%" if key == "prefill_overhead" \
                        else f"{x['op']} {x['target']:.3f}"
                    lines.append(f"| {r['config']} | {x['what']} | {val} | {tgt} | "
                                 f"{'PASS' if x['pass'] else 'FAIL'} |")
    if report.get("llama_bench"):
        lines.append("")
        lines.append("| config (llama-bench) | test | depth | tok/s | stddev |")
        lines.append("|---|---|---:|---:|---:|")
        for name, rows in report["llama_bench"].items():
            for row in rows:
                test = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
                lines.append(f"| {name} | {test} | {row['n_depth']} | {row['avg_ts']:.2f} | {row['stddev_ts']:.2f} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for c in report["configs"]:
        xs = [d["depth"] for d in c["depths"]]
        axes[0].plot(xs, [d["decode_tok_s"] for d in c["depths"]], marker="o", label=c["name"])
        axes[1].plot(xs, [d["prefill_tok_s"] for d in c["depths"]], marker="o", label=c["name"])
    for ax, title in ((axes[0], "decode tok/s at depth"), (axes[1], "prefill tok/s of the depth-long prompt")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["settings"]["depths"], [str(d) for d in report["settings"]["depths"]])
        ax.minorticks_off()
        ax.set_xlabel("depth (tokens in context)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    names = [c["name"] for c in report["configs"]]
    x = range(len(names))
    kv = [c["kv_bytes"] / MIB for c in report["configs"]]
    rss = [c["peak_rss_bytes"] / MIB for c in report["configs"]]
    axes[2].bar([i - 0.2 for i in x], kv, width=0.4, label="KV MiB (allocated)")
    axes[2].bar([i + 0.2 for i in x], rss, width=0.4, label="peak RSS MiB")
    axes[2].set_xticks(list(x))
    axes[2].set_xticklabels(names, rotation=15, fontsize=8)
    axes[2].set_title(f"memory at n_ctx {max(c['n_ctx'] for c in report['configs'])}")
    axes[2].legend(fontsize=8)
    for i, v in enumerate(kv):
        axes[2].annotate(f"{v:.1f}", (i - 0.2, v), ha="center", va="bottom", fontsize=7)
    fig.suptitle(f"{Path(report['settings']['model']).name}: PolyKV plan vs FullKV "
                 f"({report['settings']['threads']} threads)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_llama_bench(spec: dict, settings: dict, timeout: float | None) -> list[dict]:
    """Stock llama-bench for one configuration: prefill at prefill_len (depth 0), decode at every depth."""
    from polykv_cpp import _native

    exe = _native.bin_dir() / "llama-bench"
    env = dict(os.environ)
    plan_file = None
    if spec["kind"] == "fullkv":
        env["LLAMA_POLYKV_DISABLE"] = "1"
    else:
        env.pop("LLAMA_POLYKV_DISABLE", None)
        if spec["kind"] != "gguf":
            from polykv_cpp.plan import ModelInfo

            plan = _make_plan(spec, ModelInfo.from_gguf(settings["model"]).n_layer)
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                f.write(plan.to_json())
                plan_file = f.name
            env["LLAMA_POLYKV_PLAN"] = plan_file
        env["LLAMA_POLYKV_KV_BUDGET"] = str(spec["kv_budget"])
    common = [str(exe), "-m", settings["model"], "-t", str(settings["threads"]), "-b", str(settings["n_batch"]),
              "-ub", str(settings["n_ubatch"]), "-fa", settings["flash_attn"], "-ctk", settings["type_k"],
              "-ctv", settings["type_v"], "-r", str(settings["reps"]), "-ngl", str(settings["n_gpu_layers"]),
              "-o", "json"]
    rows = []
    try:
        for extra in (["-p", str(settings["prefill_len"]), "-n", "0", "-d", "0"],
                      ["-p", "0", "-n", str(settings["n_gen"]), "-d", ",".join(map(str, settings["depths"]))]):
            out = subprocess.run(common + extra, env=env, capture_output=True, text=True, timeout=timeout)
            if out.returncode != 0:
                raise SystemExit(f"bench_kv: llama-bench failed for {spec['name']}:\n{out.stderr[-3000:]}")
            for row in json.loads(out.stdout):
                rows.append({k: row.get(k) for k in ("n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts",
                                                     "n_batch", "n_ubatch", "n_threads", "flash_attn")})
    finally:
        if plan_file:
            os.unlink(plan_file)
    return rows


def build_configs(args) -> list[dict]:
    configs = []
    if not args.no_fullkv:
        configs.append({"name": "FullKV", "kind": "fullkv", "kv_budget": 0})
    for pattern in args.uniform or []:
        configs.append({"name": f"{pattern} b={args.kv_budget}", "kind": "uniform", "pattern": pattern.lower(),
                        "kv_budget": args.kv_budget})
    for path in args.plan or []:
        configs.append({"name": f"{Path(path).name} b={args.kv_budget}", "kind": "file",
                        "path": str(Path(path).resolve()), "kv_budget": args.kv_budget})
    if args.plan_from_gguf:
        configs.append({"name": f"model plan b={args.kv_budget}", "kind": "gguf", "kv_budget": args.kv_budget})
    return configs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Benchmark PolyKV plans against FullKV: prefill and decode speed at "
                                            "several depths, KV bytes, peak RSS.")
    p.add_argument("--model", "-m", help="GGUF model (default: the packaged default model, fetched once)")
    p.add_argument("--plan", action="append", metavar="FILE|GGUF",
                   help="a plan (JSON sidecar or a GGUF holding polykv.plan); repeatable")
    p.add_argument("--plan-from-gguf", action="store_true", help="also benchmark the plan stored in --model")
    p.add_argument("--uniform", action="append", metavar="PATTERN",
                   help="a uniform plan of PATTERN at --kv-budget (repeatable; the eval's method names: "
                        "snapkv-head@23, adakv, ...); default streamingllm when no plan is given")
    p.add_argument("--kv-budget", type=int, default=512, help="average tokens per layer (default 512)")
    p.add_argument("--no-fullkv", action="store_true", help="skip the FullKV reference")
    p.add_argument("--depths", default=None, help=f"comma-separated context depths (default {DEFAULT_DEPTHS})")
    p.add_argument("--prefill-len", type=int, default=None, help="fixed prefill length to report (default 4096)")
    p.add_argument("--n-gen", type=int, default=None, help="greedy tokens generated at each depth (default 32)")
    p.add_argument("--reps", type=int, default=1, help="repetitions per depth (median is reported)")
    p.add_argument("--ctx", type=int, default=None, help="n_ctx (default: max(depths, prefill-len) + n-gen + 64)")
    p.add_argument("--batch", type=int, default=None, help="n_batch (default 2048)")
    p.add_argument("--ubatch", type=int, default=None, help="n_ubatch (default 512)")
    p.add_argument("--threads", "-t", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--flash-attn", "-fa", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--cache-type-k", "-ctk", default="f16")
    p.add_argument("--cache-type-v", "-ctv", default="f16")
    p.add_argument("--n-gpu-layers", "-ngl", type=int, default=0)
    p.add_argument("--rpc", default=None, metavar="HOST:PORT[,...]",
                   help="llama.cpp RPC servers to put the offloaded layers on (with -ngl 99), as `run --rpc`")
    p.add_argument("--prompt-probe", type=int, default=0, metavar="N",
                   help="prefill with the prompt's last N tokens as a probe (run's default is 32; 0: none)")
    p.add_argument("--out", default="results/bench.json", help="JSON output (default results/bench.json)")
    p.add_argument("--png", default=None, help="plot (default: --out with .png)")
    p.add_argument("--md", default=None, help="also write the markdown tables to this file")
    p.add_argument("--llama-bench", action="store_true",
                   help="cross-check with the stock llama-bench tool (plan through LLAMA_POLYKV_PLAN)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per configuration subprocess")
    p.add_argument("--quick", action="store_true",
                   help="tiny settings for tests: depths 64,128, prefill 128, n_gen 8, n_batch 64, n_ubatch 32, "
                        "n_ctx 512 (explicit flags win)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def resolve_settings(args) -> dict:
    q = QUICK if args.quick else {}
    depths = sorted({int(x) for x in (args.depths or q.get("depths") or DEFAULT_DEPTHS).split(",") if x.strip()})
    if not depths or min(depths) < 1:
        raise SystemExit("bench_kv: --depths needs positive integers")
    prefill_len = args.prefill_len or q.get("prefill_len") or 4096
    n_gen = args.n_gen or q.get("n_gen") or 32
    need = max(max(depths), prefill_len) + n_gen + 1
    ctx = args.ctx or q.get("ctx") or (max(max(depths), prefill_len) + n_gen + 64)
    ctx = max(ctx, need) if (args.ctx is None) else ctx
    if ctx < need:
        raise SystemExit(f"bench_kv: --ctx {ctx} is too small for depth {max(depths)} / prefill {prefill_len} "
                         f"+ {n_gen} generated tokens (needs >= {need})")
    model = args.model
    if not model:
        from polykv_cpp import models

        model = str(models.fetch(models.DEFAULT_MODEL, progress=True))
    return {
        "model": str(Path(model).resolve()), "depths": depths, "prefill_len": prefill_len, "n_gen": n_gen,
        "reps": max(1, args.reps), "ctx": ctx, "n_batch": args.batch or q.get("n_batch") or 2048,
        "n_ubatch": args.ubatch or q.get("n_ubatch") or 512, "threads": args.threads or os.cpu_count() or 1,
        "flash_attn": args.flash_attn, "type_k": args.cache_type_k, "type_v": args.cache_type_v,
        "n_gpu_layers": args.n_gpu_layers, "kv_budget": args.kv_budget, "prompt_probe": args.prompt_probe,
        "rpc": args.rpc,
    }


def _environment() -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import polykv_cpp
        from polykv_cpp import _native

        info = _native.version_info()
        env["polykv_cpp"] = polykv_cpp.__version__
        env["polykv_native"] = info["polykv"]
        env["llama_commit"] = info["llama_commit"]
        env["system_info"] = info["system"].strip()
    except Exception as e:  # informative only
        env["version_error"] = str(e)
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._worker:
        return worker_main(args._worker)
    from tqdm import tqdm

    if args.kv_budget < 1:
        raise SystemExit("bench_kv: --kv-budget must be positive")
    if not (args.uniform or args.plan or args.plan_from_gguf):
        args.uniform = ["streamingllm"]
    from polykv_cpp.errors import PlanError
    from polykv_cpp.plan import KNOWN_PATTERNS, split_method

    for u in args.uniform or []:
        try:
            split_method(u)
        except PlanError as e:
            raise SystemExit(f"bench_kv: {e} (known patterns: {', '.join(KNOWN_PATTERNS)})") from None
    settings = resolve_settings(args)
    configs = build_configs(args)
    load = _loadavg()
    if load is not None and load > 0.5 * (os.cpu_count() or 1):
        print(f"bench_kv: warning: load average {load:.2f} on {os.cpu_count()} cores; other processes compete for "
              "the CPU and llama.cpp's thread barriers make timings unreliable (run on an idle machine, or use "
              "fewer --threads)", file=sys.stderr)
    steps_per = 2 + len(settings["depths"]) + (0 if settings["prefill_len"] in settings["depths"] else 1)
    results = []
    t0 = time.perf_counter()
    with tqdm(total=steps_per * len(configs), desc="bench_kv", unit="step", disable=args.no_progress,
              file=sys.stderr) as bar:
        for cfg in configs:
            spec = {**cfg, "settings": settings}
            res = run_in_subprocess(spec, bar, args.timeout)
            res.update({k: v for k, v in cfg.items() if k not in res})
            results.append(res)
    report = {
        "schema": "polykv-bench-kv/1",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": settings,
        "environment": _environment(),
        "targets": TARGETS,
        "configs": results,
        "ratios": derive_ratios(results, settings["depths"], settings["kv_budget"], settings["n_ubatch"]),
        "wall_s": None,
    }
    if args.llama_bench:
        report["llama_bench"] = {}
        for cfg in tqdm(configs, desc="llama-bench", disable=args.no_progress, file=sys.stderr):
            report["llama_bench"][cfg["name"]] = run_llama_bench(cfg, settings, args.timeout)
    report["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    png = Path(args.png) if args.png else out.with_suffix(".png")
    plot(report, png)
    md = markdown(report)
    print(md)
    if args.md:
        Path(args.md).write_text(md + "\n")
    print(f"\nwrote {out} and {png} ({report['wall_s']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
