#!/usr/bin/env python3
"""Feed every input polykv-cpp accepts something bad, and write down what the user gets (#16 item 6).

    python scripts/bad_inputs.py [--out docs/bad-inputs.md] [--workdir DIR]

Each case runs in its own process (the CLI, a stock tool or a short Python snippet) on a tiny random model written
here, so a native crash shows as a signal instead of killing this script. A case passes when the process exits
non-zero (or, for inputs that are accepted on purpose, zero) with a message and without a Python traceback or a
signal, and when no model file changed. The table it writes is docs/bad-inputs.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


@dataclass
class Case:
    what: str        # the input, in words
    tried: str       # what was fed
    argv: list[str]  # the command ("{cli}" = polykv-cpp, "{py}" = python -c)
    env: dict[str, str] | None = None
    accepted: bool = False  # a bad-looking input that is valid on purpose: exit 0 expected


@dataclass
class Outcome:
    case: Case
    rc: int
    message: str
    ok: bool


def _cli() -> list[str]:
    exe = shutil.which("polykv-cpp")
    return [exe] if exe else [sys.executable, "-m", "polykv_cpp.cli"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _message(text: str) -> str:
    """The line a user reads: the last error-looking line of stderr."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:  # our own message, where a stock tool wraps it in its log
        if "PolyKV:" in ln:
            return ln[ln.index("PolyKV:"):]
    for ln in reversed(lines):
        low = ln.lower()
        if any(k in low for k in ("error", "invalid", "not found", "failed", "must", "refus", "cannot", "unknown",
                                  "no such", "expected", "usage")):
            return ln
    return lines[-1] if lines else ""


def build_cases(work: Path) -> tuple[list[Case], list[Path]]:
    from tiny_models import TinyConfig, write_tiny_gguf

    from polykv_cpp.plan import pyramid_plan, uniform_plan, write_gguf

    model = write_tiny_gguf(work / "tiny.gguf", TinyConfig(), seed=0)
    other = write_tiny_gguf(work / "three-layers.gguf", TinyConfig(n_layer=3), seed=1)
    good = uniform_plan(2, "snapkv", 48)
    good_json = json.loads(good.to_json())
    (work / "good.json").write_text(good.to_json())
    (work / "pyramid.json").write_text(pyramid_plan(2, 64).to_json())

    def plan_file(name: str, text: str | bytes) -> str:
        path = work / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(path)

    def mutated(**changes) -> str:
        d = json.loads(good.to_json())
        for key, value in changes.items():
            if key.startswith("layer0_"):
                d["layers"][0]["prefill"][key[len("layer0_"):]] = value
            else:
                d[key] = value
        return json.dumps(d, allow_nan=True)

    plans = {
        "truncated JSON": good.to_json()[:57],
        "not JSON (binary)": bytes(range(256)),
        "invalid UTF-8 inside a string": good.to_json().replace('"snapkv"', '"snap\udcffkv"', 1).encode(
            "utf-8", "surrogateescape"),
        "a JSON list": "[1, 2, 3]",
        "negative budget": mutated(layer0_budget=-5),
        "huge budget (1e18)": mutated(layer0_budget=10 ** 18),
        "NaN budget": mutated(layer0_budget=math.nan),
        "budget as a string": mutated(layer0_budget="512"),
        "unknown pattern": mutated(layer0_pattern="magic"),
        "unicode pattern name": mutated(layer0_pattern="snäpkv\u202e"),
        "wrong layer count (3 for a 2-layer model)": uniform_plan(3, "snapkv", 48).to_json(),
        "unknown key": mutated(colour="red"),
        "`allocation` neither plan nor prompt": mutated(allocation="everywhere"),
        "negative `protect_tail`": mutated(protect_tail=-32),
        "a share that gives a layer 0 tokens (`b_min` 0)": _share_plan(0.0, 1.0),
        "a 400-digit share": _share_plan(10 ** 400, 1.0),
        "empty file": "",
    }
    names = list(plans)
    p = lambda name: plan_file(f"plan-{names.index(name)}.json", plans[name])  # noqa: E731
    bad_gguf_plan = work / "bad-plan.gguf"
    _write_raw_plan_key(model, bad_gguf_plan, '{"version": 1, "n_layer": 2, "layers": "oops"}')
    truncated = work / "truncated.gguf"
    truncated.write_bytes(model.read_bytes()[: model.stat().st_size // 3])
    text_as_gguf = work / "notes.gguf"
    text_as_gguf.write_text("this is not a model\n" * 100)
    write_gguf(model, work / "tiny.polykv.gguf", good)
    bad_qag_plan = work / "bad-query-agnostic-plan.gguf"
    _write_raw_plan_key(work / "tiny.polykv.gguf", bad_qag_plan, '{"version": 1, "n_layer": 2, "layers": []}',
                        key="polykv.plan_query_agnostic")

    prompt = ["-p", "the cat and the dog " * 20, "-n", "4", "-c", "512", "--no-echo"]
    run = lambda *a, **kw: Case(argv=["{cli}", "run", *a], **kw)  # noqa: E731
    cases = [run(str(model), "--plan", p(name), *prompt, what="plan JSON (`--plan`)", tried=name)
             for name in plans]
    cases += [
        Case("plan JSON (`polykv-cpp plan validate`)", "truncated JSON", ["{cli}", "plan", "validate",
                                                                       p("truncated JSON")]),
        Case("plan JSON (`polykv-cpp plan validate`)", "NaN budget", ["{cli}", "plan", "validate", p("NaN budget")]),
        run(str(model), "--plan", str(work / "missing.json"), *prompt, what="plan JSON (`--plan`)",
            tried="a file that does not exist"),
        run(str(bad_gguf_plan), "--plan-from-gguf", *prompt, what="GGUF key `polykv.plan`",
            tried="`layers` is a string"),
        run(str(model), "--plan-from-gguf", *prompt, what="GGUF key `polykv.plan`", tried="no plan in the model"),
        run(str(bad_qag_plan), "--plan-from-gguf", "--question", "where is the cat?", *prompt,
            what="GGUF key `polykv.plan_query_agnostic`", tried="no `budget_avg`, no layers (`run --question`)"),
        run(str(work / "missing.gguf"), *prompt, what="model file", tried="does not exist"),
        run(str(truncated), *prompt, what="model file", tried="truncated to a third"),
        run(str(text_as_gguf), *prompt, what="model file", tried="a text file named .gguf"),
        run(str(other), "--plan", str(work / "good.json"), *prompt, what="model file",
            tried="a 3-layer model with a 2-layer plan"),
        run(str(model), "--plan", str(work / "good.json"), "--kv-budget", "-5", *prompt, what="CLI flags",
            tried="`--kv-budget -5`"),
        run(str(model), "--plan", str(work / "good.json"), "--kv-budget", str(10 ** 12), *prompt,
            what="CLI flags", tried="`--kv-budget 1e12`"),
        run(str(model), "--plan", str(work / "pyramid.json"), "--kv-budget", str(2**31 - 1), *prompt,
            what="CLI flags", tried="`--kv-budget 2147483647` with unequal budgets (a layer's share passes 2^31 - 1)"),
        run(str(model), "--plan", str(work / "good.json"), "--prefill-slack", "nan", *prompt, what="CLI flags",
            tried="`--prefill-slack nan`"),
        run(str(model), "--plan", str(work / "good.json"), "--prefill-slack", "0.5", *prompt, what="CLI flags",
            tried="`--prefill-slack 0.5`"),
        run(str(model), "--plan", str(work / "good.json"), "--prompt-probe", "-3", *prompt, what="CLI flags",
            tried="`--prompt-probe -3`"),
        run(str(model), "--dry-multiplier", "-1", *prompt, what="CLI flags", tried="`--dry-multiplier -1`"),
        run(str(model), "--repeat-penalty", "nan", *prompt, what="CLI flags", tried="`--repeat-penalty nan`"),
        run(str(model), "--plan", str(work / "good.json"), "--prompt-probe", "4096", *prompt, what="CLI flags",
            tried="`--prompt-probe 4096` (longer than a ubatch)"),
        run(str(model), *prompt[:-3], "-c", "0", what="CLI flags", tried="`-c 0`", accepted=True),
        run(str(model), "--prefill-mode", "bogus", *prompt, what="CLI flags", tried="`--prefill-mode bogus`"),
        run(str(model), "-f", str(work / "missing.txt"), "-n", "4", what="CLI flags", tried="`-f` missing file"),
        Case("environment", "`LLAMA_POLYKV_PLAN` = missing file", ["{py}", _ENV.format(model=str(model))],
             env={"LLAMA_POLYKV_PLAN": str(work / "missing.json")}),
        Case("environment", "`LLAMA_POLYKV_PLAN` = truncated JSON", ["{py}", _ENV.format(model=str(model))],
             env={"LLAMA_POLYKV_PLAN": p("truncated JSON")}),
        Case("environment", "`LLAMA_POLYKV_KV_BUDGET=abc`", ["{py}", _ENV.format(model=str(model))],
             env={"LLAMA_POLYKV_PLAN": str(work / "good.json"), "LLAMA_POLYKV_KV_BUDGET": "abc"}),
        Case("environment", "`LLAMA_POLYKV_KV_BUDGET=8` for a plan with 16 sinks and a protected tail",
             ["{py}", _ENV.format(model=str(model))],
             env={"LLAMA_POLYKV_PLAN": plan_file("sinks.json", _sinks_plan()), "LLAMA_POLYKV_KV_BUDGET": "8"}),
        Case("environment", "`LLAMA_POLYKV_PREFILL=sideways`", ["{py}", _ENV.format(model=str(model))],
             env={"LLAMA_POLYKV_PLAN": str(work / "good.json"), "LLAMA_POLYKV_PREFILL": "sideways"}),
        Case("environment", "`LLAMA_POLYKV_PREFILL_SLACK=-1`", ["{py}", _ENV.format(model=str(model))],
             env={"LLAMA_POLYKV_PLAN": str(work / "good.json"), "LLAMA_POLYKV_PREFILL_SLACK": "-1"}),
        Case("environment", "`LLAMA_POLYKV_EVICT_EVERY=0`", ["{py}", _ENV.format(model=str(model))],
             env={"LLAMA_POLYKV_PLAN": str(work / "good.json"), "LLAMA_POLYKV_EVICT_EVERY": "0"}),
        Case("C API", "`llama_polykv_get_kept_positions` of layer 99 in a 2-layer model",
             ["{py}", _C_API.format(model=str(model))]),
        Case("state file", "random bytes", ["{py}", _STATE.format(model=str(model), state=_bytes_file(
            work / "random.bin", os.urandom(4096)))]),
        Case("state file", "a session truncated to half", ["{py}", _STATE.format(model=str(model), state="@half")]),
        Case("calibration data", "`--dataset` a missing file",
             ["{cli}", "calibrate", "--method", "runtime", "--gguf", str(model), "--dataset",
              str(work / "nothing.jsonl"), "--budget", "48", "--ctx", "256", "--n-cont", "16", "-q"]),
        Case("calibration output", "`--out` = the input model",
             ["{cli}", "calibrate", "--method", "runtime", "--gguf", str(model), "--out", str(model), "-q"]),
        Case("eval", "`--ppl-text` a missing file", ["{cli}", "eval", str(model), "--methods", "fullkv", "--budgets",
                                                   "32", "--lengths", "1k", "--tasks", "none", "--ppl-text",
                                                   str(work / "missing.txt"), "--out", str(work / "eval")]),
    ]
    return cases, [model, other, work / "tiny.polykv.gguf"]


def _share_plan(*shares) -> str:
    """A 2-layer plan whose prefill budgets are shares (of the pool above `b_min` 0), its decode 64 tokens each."""
    layers = [{"layer": i, "prefill": {"pattern": "h2o", "share": share}, "decode": {"pattern": "h2o", "budget": 64}}
              for i, share in enumerate(shares)]
    return json.dumps({"version": 1, "n_layer": 2, "budget_avg": 64, "b_min": 0, "budget_rule": "test", "layers": layers})


def _sinks_plan() -> str:
    """H2O with 16 sinks and a 2-token protected tail at 64 tokens per layer: fine as written, not at 8."""
    phase = {"pattern": "h2o", "budget": 64, "n_sink": 16, "window": 16}
    return json.dumps({"version": 1, "n_layer": 2, "budget_avg": 64, "b_min": 1, "budget_rule": "test",
                       "protect_tail": 2, "layers": [{"layer": i, "prefill": phase, "decode": phase} for i in range(2)]})


def _bytes_file(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _write_raw_plan_key(src: Path, dst: Path, text: str, key: str = "polykv.plan") -> None:
    """A copy of `src` whose `key` (`polykv.plan`) holds `text` unchecked (the gguf package, not our validator);
    `src`'s own keys are copied, its plan included."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    writer.add_string(key, text)
    if "polykv.version" not in reader.fields:
        writer.add_string("polykv.version", "1")
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_C_API = r"""
import sys
from polykv_cpp import _native
from polykv_cpp.api import Model
lib = _native.load()
with Model({model!r}) as model:
    from polykv_cpp.plan import uniform_plan
    model.set_plan(uniform_plan(2, "snapkv", 48))
    with model.context(n_ctx=256) as ctx:
        n = lib.llama_polykv_get_kept_positions(ctx.ptr, 99, _native.ffi.NULL, 0)
        err2 = _native.ffi.string(lib.llama_polykv_last_error()).decode()
        print("kept_positions(layer 99):", n, err2, file=sys.stderr)
sys.exit(1 if n < 0 else 0)
"""

# a program on the library that sets no plan itself, so the environment's applies (as in the stock tools)
_ENV = r"""
import sys
from polykv_cpp.api import Model
from polykv_cpp.errors import PolyKVError
with Model({model!r}) as model:
    try:
        with model.context(n_ctx=256) as ctx:
            ctx.decode(list(range(2, 40)))
    except PolyKVError as e:
        print(f"error: {{e}}", file=sys.stderr)
        sys.exit(2)
"""

_STATE = r"""
import sys
from polykv_cpp.api import Model
from polykv_cpp.errors import NativeError
from polykv_cpp.plan import uniform_plan
path = {state!r}
with Model({model!r}) as model:
    model.set_plan(uniform_plan(2, "snapkv", 48))
    with model.context(n_ctx=512) as ctx:
        if path == "@half":
            ctx.decode(list(range(2, 300)))
            ctx.save_state_file("session.bin", list(range(2, 300)))
            data = open("session.bin", "rb").read()
            open("session.bin", "wb").write(data[: len(data) // 2])
            path = "session.bin"
        try:
            ctx.load_state_file(path)
        except NativeError as e:
            print(f"error: {{e}}", file=sys.stderr)
            sys.exit(2)
"""


def run_case(case: Case, work: Path) -> Outcome:
    argv = []
    for a in case.argv:
        if a == "{cli}":
            argv += _cli()
        elif a == "{py}":
            argv += [sys.executable, "-c"]
        else:
            argv.append(a)
    env = {**os.environ, **(case.env or {})}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=300, env=env, cwd=work,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Outcome(case, -999, "timed out after 300 s", False)
    rc, err = proc.returncode, proc.stderr + proc.stdout
    msg = _message(proc.stderr if case.accepted else err).replace(str(work), "<work>")
    crashed = rc < 0 or "Traceback (most recent call last)" in err
    ok = not crashed and ((rc == 0) if case.accepted else (rc != 0 and bool(msg)))
    return Outcome(case, rc, msg, ok)


def table(outcomes: list[Outcome]) -> str:
    lines = ["| input | tried | exit | what the user reads | ok |", "|---|---|---:|---|---|"]
    for o in outcomes:
        msg = o.message.replace("|", "\\|")
        if len(msg) > 160:
            msg = msg[:157] + "..."
        lines.append(f"| {o.case.what} | {o.case.tried} | {o.rc} | {msg} | {'yes' if o.ok else '**NO**'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the table as markdown here (default: print it)")
    ap.add_argument("--workdir", default=None, help="keep the inputs here (default: a temporary folder)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        cases, models = build_cases(work)
        before = {m: _sha(m) for m in models}
        outcomes = []
        try:
            from tqdm import tqdm
            it = tqdm(cases, desc="bad inputs", unit="case", file=sys.stderr)
        except ImportError:
            it = cases
        for case in it:
            outcomes.append(run_case(case, work))
        unchanged = all(_sha(m) == h for m, h in before.items())
    text = table(outcomes)
    n_ok = sum(o.ok for o in outcomes)
    summary = (f"{n_ok} of {len(outcomes)} cases as expected; model files "
               f"{'unchanged' if unchanged else 'CHANGED'} (sha256 before and after)")
    if args.out:
        Path(args.out).write_text(HEADER + text + "\n\n" + summary + ".\n")
    print(text)
    print(summary)
    return 0 if n_ok == len(outcomes) and unchanged else 1


HEADER = """# Bad inputs: what the user gets

Made by `python scripts/bad_inputs.py --out docs/bad-inputs.md` (tiny random models written by the script; each
case in its own process, so a native crash would show as a negative exit code). "ok": the process exited
non-zero with a message and without a Python traceback or a signal (or zero for an input accepted on purpose),
and no model file changed. `tests/test_bad_inputs.py` runs it. The environment variables are read by the library
(here a program that sets no plan itself); the stock tools print the same messages through llama.cpp's log, which
the pinned llama.cpp can cut short when a tool exits at once (its asynchronous logger is leaked on purpose,
`common/log.cpp`).

"""

if __name__ == "__main__":
    sys.exit(main())
