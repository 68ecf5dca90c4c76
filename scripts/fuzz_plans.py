#!/usr/bin/env python3
"""Differential fuzz of the plan parsers: Python's `Plan.from_json(...).validate()` against the native
`llama_polykv_set_model_plan` (#16 item 1), on mutated plan texts.

    python scripts/fuzz_plans.py [--seconds 30 | --execs N] [--seed S] [--corpus DIR]

Seeds: the shipped plans in plans/, plans made by the registry (every pattern, per layer and per head), and the
files of the corpus. Each input is mutated structurally (a value replaced by a hostile one, a key dropped or
added, layers duplicated) or as bytes (flips, truncation, insertion, splices). For each input it records both
verdicts; a Python exception other than PlanError, a native crash (the worker runs in a child process and names
the input it died on) or a disagreement between the parsers is a finding, saved into the corpus folder with a
name that says which. Every Nth input the native side also accepts is run: a context is created and a prompt
decoded with eviction. Exit 1 when anything was found. Pure Python, no fuzzing engine (no clang on this machine).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

HOSTILE = [-1, 0, 1, 3, 2**31 - 1, 2**31, 2**63, -(2**63), 1e308, -1e-308, 0.5, math.nan, math.inf, -math.inf, "",
           "full", "snapkv", "head", "adaptive", "layer", "ünïcode\u202e", "x" * 5000, None, True, False, [], {},
           [1, 2], {"a": 1}, "1", "NaN"]
KEYS = ["pattern", "budget", "share", "n_sink", "window", "obs_window", "pool_kernel", "selection", "version",
        "n_layer", "budget_avg", "b_min", "layers", "layer", "prefill", "decode", "exact_total", "budget_rule",
        "full_charge", "provenance", "evict_every", "allocation", "allocation_cap", "colour"]
N_LAYER = 2


def seeds() -> list[str]:
    from polykv_cpp import plan as P

    out = [p.read_text() for p in sorted((ROOT / "plans").glob("*.json"))]
    for name in P.KNOWN_PATTERNS:
        for selection in ("layer", "head"):
            if selection == "head" and name not in P.PER_HEAD_PATTERNS:
                continue
            try:
                out.append(P.uniform_plan(N_LAYER, name, 48, selection=selection).to_json())
            except P.PlanError:
                pass
    out.append(P.pyramid_plan(N_LAYER, 64).to_json())
    capped = P.uniform_plan(N_LAYER, "kvzip", 48, selection="head", allocation="prompt")
    out.append(P.Plan.from_dict({**capped.to_dict(), "allocation_cap": 2}).to_json())
    return out


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _get(node, path):
    for p in path:
        node = node[p]
    return node


def mutate_structure(text: str, rng: random.Random) -> str | None:
    try:
        d = json.loads(text)
    except (ValueError, RecursionError):
        return None
    for _ in range(rng.randint(1, 3)):
        paths = list(_paths(d))
        path = rng.choice(paths)
        if not path:
            continue
        parent, key = _get(d, path[:-1]), path[-1]
        op = rng.random()
        if op < 0.55:
            parent[key] = copy.deepcopy(rng.choice(HOSTILE))
        elif op < 0.7 and isinstance(parent, dict):
            del parent[key]
        elif op < 0.85 and isinstance(parent, dict):
            parent[rng.choice(KEYS)] = copy.deepcopy(rng.choice(HOSTILE))
        elif isinstance(parent, list) and parent:
            parent.append(copy.deepcopy(rng.choice(parent)))
        elif isinstance(parent, dict) and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
            parent[key] = parent[key] * rng.choice([-1, 2, 1000, 0.5]) + rng.choice([0, 1, -1])
    return json.dumps(d, allow_nan=True)


def mutate_bytes(data: bytes, rng: random.Random, other: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        if not b:
            b = bytearray(other[: rng.randint(0, len(other))])
        elif op < 0.3:
            i = rng.randrange(len(b))
            b[i] = rng.randrange(256)
        elif op < 0.45:
            b = b[: rng.randrange(len(b))]
        elif op < 0.65:
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.choice([rng.randrange(256) for _ in range(4)] + list(b'{}[]",:0-9e.\\\xc3\xff'))
                           for _ in range(rng.randint(1, 8)))
        elif op < 0.8:
            i, j = sorted(rng.randrange(len(b) + 1) for _ in range(2))
            del b[i:j]
        else:
            i = rng.randrange(len(b) + 1)
            j = rng.randrange(len(other) + 1)
            b = b[:i] + bytearray(other[j:j + rng.randint(1, 200)])
    return bytes(b)


WORKER = r"""
import json, math, sys
from pathlib import Path
from polykv_cpp import _native, plan as P
from polykv_cpp.api import Model
from polykv_cpp.errors import PlanError, PolyKVError
ffi = _native.ffi
lib = _native.load()
inputs, current, every = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[4])
model = Model(sys.argv[5])
n_run = 0
out = []
for i, data in enumerate(json.loads(inputs.read_text())):
    raw = bytes.fromhex(data).replace(b"\0", b" ")  # a C string ends at NUL: both parsers see the same text
    if not raw:
        raw = b" "  # the C API reads an empty text as "no plan" (documented), not as a plan to parse
    current.write_bytes(raw)
    try:
        P.Plan.from_json(raw).validate(n_layer=%d)
        py = "accept"
    except PlanError:
        py = "reject"
    except Exception as e:
        py = "BUG " + type(e).__name__ + ": " + str(e)[:200]
    rc = lib.llama_polykv_set_model_plan(model.ptr, raw, 0)
    nat = "accept" if rc == 0 else "reject"
    err = "" if rc == 0 else ffi.string(lib.llama_polykv_last_error()).decode("utf-8", "replace")
    ran = ""
    if rc == 0 and i %% every == 0:
        try:
            with model.context(n_ctx=256, n_batch=64, n_ubatch=64) as ctx:
                ctx.decode([(7 * j) %% 300 + 2 for j in range(150)])
                list(ctx.generate_tokens([], max_tokens=2, stop_at_eog=False))
            ran = "ran"
        except PolyKVError as e:
            ran = "refused: " + str(e)[:120]
        n_run += 1
    lib.llama_polykv_set_model_plan(model.ptr, ffi.NULL, 0)
    out.append([py, nat, err[:200], ran])
current.unlink()
print(json.dumps(out))
""" % N_LAYER


def run_batch(batch: list[bytes], model: Path, every: int, tmp: Path) -> tuple[list, bytes | None, str]:
    inputs, current = tmp / "inputs.json", tmp / "current.bin"
    inputs.write_text(json.dumps([b.hex() for b in batch]))
    # run in the temporary folder: the worker imports the polykv_cpp that is installed (or on PYTHONPATH), not a
    # source tree that happens to be the current directory
    proc = subprocess.run([sys.executable, "-c", WORKER, str(inputs), str(current), str(ROOT), str(every),
                           str(model)], capture_output=True, text=True, timeout=1800, cwd=tmp)
    if proc.returncode != 0:
        crashed = current.read_bytes() if current.exists() else None
        return [], crashed, f"worker exit {proc.returncode}: {proc.stderr[-500:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), None, ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="run this long (default 30)")
    ap.add_argument("--execs", type=int, default=0, help="or this many inputs (overrides --seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=2000, help="inputs per worker process")
    ap.add_argument("--run-every", type=int, default=200, help="decode with every Nth natively accepted input")
    ap.add_argument("--corpus", default="fuzz-plans", help="extra seeds in (*.json), findings out (*.finding); "
                    "default ./fuzz-plans")
    args = ap.parse_args(argv)

    from tiny_models import TinyConfig, write_tiny_gguf

    rng = random.Random(args.seed)
    corpus = Path(args.corpus)
    pool = [s.encode() for s in seeds()] + [p.read_bytes() for p in sorted(corpus.glob("*.json"))]
    findings: dict[str, bytes] = {}
    stats = {"execs": 0, "python_accept": 0, "native_accept": 0, "agree": 0, "ran": 0, "refused_at_context": 0}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = write_tiny_gguf(tmp / "tiny.gguf", TinyConfig(n_layer=N_LAYER), seed=0)
        try:
            from tqdm import tqdm
            bar = tqdm(total=args.execs or None, desc="fuzz", unit="input", file=sys.stderr)
        except ImportError:
            bar = None
        while (stats["execs"] < args.execs) if args.execs else (time.time() - t0 < args.seconds):
            batch = []
            for _ in range(args.batch):
                base = rng.choice(pool)
                m = mutate_structure(base.decode("utf-8", "replace"), rng) if rng.random() < 0.6 else None
                batch.append(m.encode("utf-8", "surrogatepass") if m is not None
                             else mutate_bytes(base, rng, rng.choice(pool)))
            results, crashed, why = run_batch(batch, model, args.run_every, tmp)
            if crashed is not None or why:
                findings["crash-" + hashlib.sha1(crashed or b"").hexdigest()[:12]] = crashed or b""
                print(f"the worker died: {why}", file=sys.stderr)
                continue
            for raw, (py, nat, err, ran) in zip(batch, results):
                stats["execs"] += 1
                stats["python_accept"] += py == "accept"
                stats["native_accept"] += nat == "accept"
                stats["ran"] += ran == "ran"
                stats["refused_at_context"] += ran.startswith("refused")
                if py.startswith("BUG"):
                    findings[f"python-{py.split(':')[0][4:]}-" + hashlib.sha1(raw).hexdigest()[:12]] = raw
                elif py != nat:
                    findings[f"disagree-py-{py}-native-{nat}-" + hashlib.sha1(raw).hexdigest()[:12]] = raw
                else:
                    stats["agree"] += 1
            if bar is not None:
                bar.update(len(results))
                bar.set_postfix_str(f"findings {len(findings)}")
        if bar is not None:
            bar.close()
    stats["seconds"] = round(time.time() - t0, 1)
    corpus.mkdir(parents=True, exist_ok=True)
    for name, raw in sorted(findings.items()):
        (corpus / f"{name}.finding").write_bytes(raw)
    print(json.dumps({**stats, "findings": sorted(findings)}, indent=1))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
