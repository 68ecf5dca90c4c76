#!/usr/bin/env python3
"""The evaluation suite as a script: the same runner as `polykv-cpp eval`, plus named presets.

    python scripts/eval_suite.py MODEL.polykv.gguf --preset cpu --out results/cpu
    python scripts/eval_suite.py MODEL.gguf --plan plan.json --preset paper -ngl 99 --out results/paper
    python scripts/eval_suite.py MODEL.gguf --preset smoke

Presets only fill in `polykv-cpp eval` flags; flags given after them win (argparse keeps the last value).
Every other flag is passed through unchanged: see `polykv-cpp eval --help` and docs/evaluation.md.
"""

from __future__ import annotations

import sys

PRESETS = {
    # the full comparison: 4 budgets x 2 lengths x 8 tasks x 2 samples, both protocols, PPL/KL
    "paper": ["--budgets", "128,256,512,1024", "--lengths", "4k,8k", "--tasks", "all", "--samples", "2"],
    # docs/results-archive.md, "Quality at 4K: Qwen2.5-Coder-0.5B", on 2 CPU cores: 4K, every task and budget, one
    # sample (about 25 min for the 0.5B model)
    "cpu": ["--budgets", "128,256,512,1024", "--lengths", "4k", "--tasks", "all", "--samples", "1",
            "--ppl-tokens", "128"],
    # minutes: checks that everything runs end to end
    "smoke": ["--quick"],
}


def expand(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--preset":
            if i + 1 >= len(argv) or argv[i + 1] not in PRESETS:
                raise SystemExit(f"eval_suite.py: --preset needs one of {', '.join(PRESETS)}")
            out = PRESETS[argv[i + 1]] + out
            i += 2
            continue
        if argv[i].startswith("--preset="):
            name = argv[i].split("=", 1)[1]
            if name not in PRESETS:
                raise SystemExit(f"eval_suite.py: unknown preset {name!r} ({', '.join(PRESETS)})")
            out = PRESETS[name] + out
        else:
            out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    from polykv_cpp.evaluation.cli import main as eval_main

    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        print("presets:")
        for name, flags in PRESETS.items():
            print(f"  {name:6s} {' '.join(flags)}")
        print()
    return eval_main(expand(args))


if __name__ == "__main__":
    sys.exit(main())
