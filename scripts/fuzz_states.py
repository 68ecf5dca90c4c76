#!/usr/bin/env python3
"""Mutation fuzz of PolyKV context states (#16): what `llama_state_set_data` / `llama_state_load_file` read back.

    python scripts/fuzz_states.py [--execs N | --seconds S] [--seed S] [--out DIR]

A state file comes from anywhere a prompt cache or a saved session does, and its PolyKV part (group count,
capacities, per-cell positions and scores, per-head positions, KVzip scores, Expected Attention statistics) sizes
allocations and indexes arrays. Seeds: the states of a tiny random model under several plans (per-layer SnapKV
with H2O decode, per-head SnapKV, TOVA, a KVzip prompt scored and not compressed yet, Expected Attention), after
the prompt and after decode steps. Each input is one seed mutated as bytes (bit flips, hostile 32-bit values,
truncation, insertions, repeated or zeroed spans), mostly inside the PolyKV part. A child process loads each into a
fresh context of the seed's plan and, when the load is accepted, decodes three more tokens (eviction on the loaded
bookkeeping). A crash, an abort, a hang (30 s) or a Python exception other than NativeError is a finding, written
to --out with the seed's name. Exit 1 when anything was found. Pure Python, no fuzzing engine.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

POLYKV_MAGIC = struct.pack("<I", 0x504B5635)
HOSTILE_U32 = [0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE,
               1 << 20, 1 << 24, 1 << 30, 0x7FC00000, 0xFF800000, 0x7F800000]  # the last three: NaN, -inf, +inf
N_CTX, N_UB = 256, 32

CHILD = r"""
import json, sys, traceback
from polykv_cpp.api import Model
from polykv_cpp.errors import NativeError
from polykv_cpp.plan import Plan
model_path, plans = sys.argv[1], json.loads(sys.argv[2])
model = Model(model_path)
for line in sys.stdin:
    name, path = line.split()
    try:
        model.set_plan(Plan.from_json(plans[name]["plan"]), prefill=plans[name]["prefill"])
        with model.context(n_ctx=%(n_ctx)d, n_batch=%(n_ub)d, n_ubatch=%(n_ub)d, n_threads=1) as ctx:
            try:
                ctx.load_state_bytes(open(path, "rb").read())
            except NativeError:
                print("refused", flush=True)
                continue
            try:
                ctx.decode([5, 6, 7], phase="decode")
                print("loaded", flush=True)
            except NativeError:
                print("loaded-decode-refused", flush=True)
    except Exception:
        print("pyexc " + json.dumps(traceback.format_exc()), flush=True)
""" % {"n_ctx": N_CTX, "n_ub": N_UB}


def scenarios():
    """name -> (plan, prefill mode, how the state is made)"""
    from polykv_cpp.plan import uniform_plan

    kw = dict(window=8, obs_window=8)
    return {
        "snapkv-h2o": (uniform_plan(2, "snapkv", 40, decode_pattern="h2o", **kw), "chunked", "decode"),
        "snapkv-head": (uniform_plan(2, "snapkv", 40, selection="head", **kw), "chunked", "decode"),
        "tova": (uniform_plan(2, "tova", 40), "chunked", "prompt"),
        "kvzip-scored": (uniform_plan(2, "kvzip", 40, selection="head"), "exact", "kvzip"),
        "expected-attention": (uniform_plan(2, "expected_attention", 40), "exact", "decode"),
    }


def make_seeds(model_path: Path) -> tuple[dict[str, bytes], dict[str, dict]]:
    import numpy as np

    from polykv_cpp.api import Model

    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 380, size=120)]
    seeds, plans = {}, {}
    with Model(model_path) as model:
        for name, (plan, prefill, how) in scenarios().items():
            model.set_plan(plan, prefill=prefill)
            plans[name] = {"plan": plan.to_json(), "prefill": prefill}
            with model.context(n_ctx=N_CTX, n_batch=N_UB, n_ubatch=N_UB, n_threads=1) as ctx:
                ctx.decode(prompt, phase="prefill")
                if how == "kvzip":
                    ctx.score_prompt_kvzip(prompt)
                elif how == "decode":
                    ctx.decode([9], phase="decode")
                    ctx.decode([10], phase="decode")
                seeds[name] = ctx.state_bytes()
    return seeds, plans


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    start = data.find(POLYKV_MAGIC)
    lo = start if start >= 0 and rng.random() < 0.85 else 0

    def pos() -> int:
        return rng.randrange(lo, max(lo + 1, len(b)))

    for _ in range(rng.choice([1, 1, 1, 2, 3, 5])):
        op = rng.randrange(7)
        if not b:
            break
        if op == 0:  # bit flips
            i = pos() if lo < len(b) else rng.randrange(len(b))
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and len(b) >= 4:  # a hostile 32-bit value at a 4-aligned offset of the PolyKV part
            i = min(lo + 4 * rng.randrange(max(1, (len(b) - lo) // 4)), len(b) - 4)
            b[i:i + 4] = struct.pack("<I", rng.choice(HOSTILE_U32))
        elif op == 2:  # truncation
            del b[pos():]
        elif op == 3:  # insertion
            i = pos()
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 8, 64])))
        elif op == 4:  # a span repeated
            i = pos()
            n = rng.choice([4, 16, 256])
            b[i:i] = b[i:i + n]
        elif op == 5:  # a span zeroed or set to 0xff
            i = pos()
            n = rng.choice([4, 16, 256])
            b[i:i + n] = bytes([rng.choice([0, 0xFF])]) * len(b[i:i + n])
        else:  # one byte set
            i = pos()
            if i < len(b):
                b[i] = rng.choice([0, 1, 0x7F, 0x80, 0xFF])
    return bytes(b)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--execs", type=int, default=None, help="inputs to try (default: until --seconds)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="build/fuzz-states", help="where findings are written")
    args = ap.parse_args(argv)

    from tiny_models import TinyConfig, write_tiny_gguf

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="polykv-fuzz-states-"))
    model_path = write_tiny_gguf(work / "tiny.gguf", TinyConfig(), seed=3)
    seeds, plans = make_seeds(model_path)
    names = sorted(seeds)
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    findings: list[str] = []
    child = None
    t0 = time.time()
    n = 0

    def start():
        return subprocess.Popen([sys.executable, "-c", CHILD, str(model_path), json.dumps(plans)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
                                cwd=work)  # not the source tree: the installed package, with its library

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(total=args.execs, desc="states", unit="input", mininterval=2.0, disable=tqdm is None) if tqdm else None
    while (args.execs is None and time.time() - t0 < args.seconds) or (args.execs is not None and n < args.execs):
        if child is None or child.poll() is not None:
            child = start()
        name = names[n % len(names)] if n < len(names) else rng.choice(names)
        data = seeds[name] if n < len(names) else mutate(seeds[name], rng)  # the seeds themselves first
        path = work / "input.bin"
        path.write_bytes(data)
        child.stdin.write(f"{name} {path}\n")
        child.stdin.flush()
        line = _read_line(child, timeout=30.0)
        if line is None or line.startswith("pyexc"):
            kind = "hang" if line is None and child.poll() is None else "pyexc" if line else f"crash{child.poll()}"
            dest = out / f"{kind}-{name}-{n}.bin"
            dest.write_bytes(data)
            findings.append(f"{dest}" + (f": {json.loads(line[6:])}" if line else ""))
            child.kill()
            child.wait()
            child = None
        else:
            counts[line] = counts.get(line, 0) + 1
            if n < len(names) and line != "loaded":
                raise SystemExit(f"the unmutated seed {name} did not load: {line}")
        n += 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if child is not None:
        child.stdin.close()
        child.wait(timeout=30)
    print(json.dumps({"inputs": n, "seconds": round(time.time() - t0, 1), "outcomes": counts,
                      "findings": findings}, indent=1))
    return 1 if findings else 0


def _read_line(proc: subprocess.Popen, timeout: float) -> str | None:
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        return None
    line = proc.stdout.readline()
    return line.strip() or None


if __name__ == "__main__":
    sys.exit(main())
