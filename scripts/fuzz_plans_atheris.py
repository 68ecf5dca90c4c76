#!/usr/bin/env python3
"""Coverage-guided fuzz (atheris, libFuzzer's engine for Python) of the Python plan parser and the budget
arithmetic that follows it (#16 item 1): `Plan.from_json(...).validate()`, then for an accepted plan the JSON round
trip, `scaled()` to several KV budgets with and without sliding-window caps, `tail_applied()` and
`resolved_budgets()`.

    python scripts/fuzz_plans_atheris.py [libFuzzer flags...]      e.g. -runs=100000, -max_total_time=30

Any exception other than PlanError, or a broken invariant (an assert below), is a finding: atheris stops and
writes the input as crash-* (in the current folder, or -artifact_prefix=DIR/). Seeds: native/fuzz/corpus, the
corpus the native harness keeps (scripts/fuzz_native.sh); pass it (or a copy to grow) as the last argument, and
`-dict=native/fuzz/plan.dict` (the plan format's keys and names).
Needs `pip install atheris` (Linux x86_64 wheels).
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from polykv_cpp import plan as P

KV_BUDGETS = (1, 64, 4096, 2**31 - 1)


def _swa_caps(n_layer: int) -> list[int | None]:
    return [None if i % 6 == 5 else 512 for i in range(n_layer)]


def check_scaled(plan: P.Plan, kv_budget: int, caps: list[int | None] | None) -> None:
    try:
        s = plan.scaled(kv_budget, caps=caps)
    except P.PlanError:
        return
    s.validate()
    assert s.budget_avg == kv_budget
    for ph in P.PHASES:
        budgets = s.token_budgets(ph)
        for pp, b in zip(s.phase_plans(ph), budgets):
            if b is None:
                continue
            assert b >= max(1, s.b_min), (ph, b)
            assert pp.n_sink + (pp.window or 0) <= b, (ph, pp, b)
        budgeted = [b for b in budgets if b is not None]
        if budgeted and caps is None:
            n_full = len(budgets) - len(budgeted)
            assert sum(budgeted) == s.n_layer * kv_budget - n_full * (s.full_charge or 0), (ph, budgeted)


def test_one_input(data: bytes) -> None:
    try:
        plan = P.Plan.from_json(data).validate()
    except P.PlanError as e:
        assert str(e)
        return
    again = P.Plan.from_json(plan.to_json()).validate()
    assert again.to_json() == plan.to_json()
    for ph in P.PHASES:
        for n_ctx in (256, 131072):
            assert all(b >= 1 for b in plan.resolved_budgets(ph, n_ctx))
    for kv_budget in KV_BUDGETS:
        check_scaled(plan, kv_budget, None)
        check_scaled(plan, kv_budget, _swa_caps(plan.n_layer))
    plan.tail_applied(4096, _swa_caps(plan.n_layer)).validate()


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
