#!/usr/bin/env python3
"""Batched decoding of several sequences with a plan: the stock `llama-batched-bench`, three ways.

For each configuration the stock tool built from our tree (`polykv-cpp tools`) prefills one prompt of ``--pp`` tokens
per sequence and then decodes ``--tg`` steps of one token per sequence, for every number of parallel sequences in
``--npl`` (one context with ``n_seq_max`` = the largest; ``-c`` = that many x (pp + tg)):

* ``fullkv``: stock llama.cpp (``LLAMA_POLYKV_DISABLE=1``): one unified cache, a batch of decode steps is one ubatch;
* ``plan-shared``: the plan (``LLAMA_POLYKV_PLAN``): every sequence has caches of its own; a batch of decode steps
  shares ubatches (the weights are read once per step, attention runs per sequence);
* ``plan-separate``: the same with ``LLAMA_POLYKV_SHARED_UBATCH=0``: one ubatch per sequence and step (what the
  library did before shared ubatches).

Each configuration runs ``--reps`` times; the report takes the median of every row, writes ``--out`` (JSON and
markdown) and a PNG of decode tok/s against the number of sequences, with the KV MiB each configuration
allocated (from the tool's log).

    python scripts/bench_seqs.py --plan plans/qwen2.5-coder-0.5b-instruct-q4_k_m.b512.json --kv-budget 512 \\
        --pp 2048 --tg 32 --npl 1,2,4,8 --reps 3 --out results/bench-seqs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from server_load import bin_dir, kv_mib_from_log  # scripts/, next to this one

CONFIGS = ("fullkv", "plan-shared", "plan-separate")
FIELDS = ("t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")


def tool_path() -> Path:
    path = bin_dir() / "llama-batched-bench"
    if not path.exists():
        sys.exit(f"bench_seqs: {path} is missing: reinstall polykv-cpp (`pip install .`)")
    return path


def default_model() -> str:
    from polykv_cpp import models  # noqa: PLC0415

    return str(models.fetch(models.DEFAULT_MODEL, progress=False))


def run_once(config: str, args, n_ctx: int) -> tuple[list[dict], float | None]:
    env = dict(os.environ)
    for key in ("LLAMA_POLYKV_PLAN", "LLAMA_POLYKV_KV_BUDGET", "LLAMA_POLYKV_DISABLE", "LLAMA_POLYKV_SHARED_UBATCH"):
        env.pop(key, None)
    if config == "fullkv":
        env["LLAMA_POLYKV_DISABLE"] = "1"
    else:
        env["LLAMA_POLYKV_PLAN"] = str(Path(args.plan).resolve())
        if args.kv_budget:
            env["LLAMA_POLYKV_KV_BUDGET"] = str(args.kv_budget)
        env["LLAMA_POLYKV_SHARED_UBATCH"] = "1" if config == "plan-shared" else "0"
    cmd = [str(tool_path()), "-m", args.model, "-c", str(n_ctx), "-b", str(args.batch), "-ub", str(args.ubatch),
           "-npp", str(args.pp), "-ntg", str(args.tg), "-npl", args.npl, "-t", str(args.threads),
           "-fa", args.flash_attn, "--output-format", "jsonl", "-lv", "4"]  # -lv 4: the info lines with the KV size
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace", timeout=args.timeout)
    if proc.returncode != 0:
        sys.exit(f"bench_seqs: {config} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    if config != "fullkv" and "PolyKV plan active" not in proc.stderr:
        sys.exit(f"bench_seqs: {config}: the plan did not load:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return rows, kv_mib_from_log(proc.stderr)


def median_rows(runs: list[list[dict]]) -> list[dict]:
    out = []
    for rows in zip(*runs):
        row = {k: rows[0][k] for k in ("pp", "tg", "pl", "n_kv")}
        for f in FIELDS:
            row[f] = statistics.median(r[f] for r in rows)
        out.append(row)
    return out


def markdown(report: dict) -> str:
    lines = [f"model `{Path(report['model']).name}`, plan `{report['plan']}` (kv-budget {report['kv_budget']}), "
             f"pp {report['pp']} per sequence, tg {report['tg']}, {report['threads']} threads, flash attention "
             f"{report['flash_attn']}, median of {report['reps']} runs", "",
             "| sequences | config | KV MiB | prefill tok/s | decode tok/s (all sequences) | decode vs fullkv | "
             "decode vs plan-separate |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    by = {c: {r["pl"]: r for r in report["configs"][c]["rows"]} for c in report["configs"]}
    for pl in sorted(by["fullkv"]):
        for c in CONFIGS:
            r = by[c][pl]
            vs_full = r["speed_tg"] / by["fullkv"][pl]["speed_tg"]
            vs_sep = r["speed_tg"] / by["plan-separate"][pl]["speed_tg"]
            kv = report["configs"][c]["kv_mib"]
            lines.append(f"| {pl} | {c} | {kv:.1f} | {r['speed_pp']:.1f} | {r['speed_tg']:.2f} | {vs_full:.2f}x | "
                         f"{vs_sep:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for c in CONFIGS:
        rows = report["configs"][c]["rows"]
        ax.plot([r["pl"] for r in rows], [r["speed_tg"] for r in rows], marker="o",
                label=f"{c} ({report['configs'][c]['kv_mib']:.0f} MiB KV)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(report["npl"], [str(n) for n in report["npl"]])
    ax.set_xlabel("sequences decoded together")
    ax.set_ylabel("decode tok/s, all sequences")
    ax.set_title(f"llama-batched-bench, {report['pp']}-token prompts, budget {report['kv_budget']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", "-m", default=None, help="GGUF model (default: the packaged default model)")
    ap.add_argument("--plan", required=True, help="plan JSON (LLAMA_POLYKV_PLAN)")
    ap.add_argument("--kv-budget", type=int, default=512, help="rescale the plan to this average budget (0: as is)")
    ap.add_argument("--pp", type=int, default=2048, help="prompt tokens per sequence")
    ap.add_argument("--tg", type=int, default=32, help="decode steps (one token per sequence each)")
    ap.add_argument("--npl", default="1,2,4,8", help="numbers of parallel sequences")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--threads", "-t", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--flash-attn", "-fa", choices=("on", "off", "auto"), default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per tool run")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    args = ap.parse_args(argv)
    if not Path(args.plan).is_file():
        ap.error(f"--plan {args.plan}: no such file")
    try:
        npl = [int(x) for x in args.npl.split(",")]
    except ValueError:
        ap.error(f"--npl {args.npl!r}: expected comma-separated integers")
    if not npl or min(npl) < 1:
        ap.error("--npl: every number of sequences must be >= 1")
    args.model = args.model or default_model()
    n_ctx = max(npl) * (args.pp + args.tg)

    report = {"model": args.model, "plan": args.plan, "kv_budget": args.kv_budget, "pp": args.pp, "tg": args.tg,
              "npl": npl, "threads": args.threads, "flash_attn": args.flash_attn, "reps": args.reps, "n_ctx": n_ctx,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "configs": {}}
    runs: dict[str, list] = {c: [] for c in CONFIGS}
    kv: dict[str, float | None] = {}
    # repetitions interleave the configurations, so a slow spell of the machine does not fall on one of them
    with tqdm(total=args.reps * len(CONFIGS), desc="llama-batched-bench", unit="run") as bar:
        for _ in range(args.reps):
            for c in CONFIGS:
                rows, kv[c] = run_once(c, args, n_ctx)
                runs[c].append(rows)
                bar.update()
    for c in CONFIGS:
        report["configs"][c] = {"rows": median_rows(runs[c]), "kv_mib": kv[c], "runs": runs[c]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-seqs.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    (args.out / "bench-seqs.md").write_text(md)
    plot(report, args.out / "bench-seqs.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
