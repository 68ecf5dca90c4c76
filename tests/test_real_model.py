"""On the real default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, from its PyPI packages)."""

import subprocess

import pytest

from conftest import run_cli, run_stock
from polykv_cpp._native import bin_dir
from polykv_cpp.api import Model

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def test_greedy_32_tokens_equal_stock_llama_completion(default_model):
    """Our bindings and stock llama-completion (built from the same tree) agree on greedy output.

    llama-completion prints text, so the comparison is on the detokenized 32 tokens; our tokens are also
    checked to re-render exactly that text piece by piece.
    """
    n = 32
    stock = run_stock(
        [str(bin_dir() / "llama-completion"), "-m", str(default_model), "-p", PROMPT, "-n", str(n),
         "--temp", "0", "-c", "1024", "-t", "2", "-no-cnv", "--no-display-prompt", "--no-warmup", "--simple-io"],
        timeout=600)
    assert stock.returncode == 0, stock.stderr[-3000:]
    with Model(default_model) as model, model.context(n_ctx=1024, n_threads=2) as ctx:
        tokens = list(ctx.generate_tokens(model.tokenize(PROMPT), max_tokens=n))
        ours = b"".join(model.token_to_piece(t) for t in tokens).decode("utf-8", "replace")
    assert len(tokens) == n
    # llama-completion ends its output with newlines of its own
    assert stock.stdout.startswith(ours), f"stock: {stock.stdout!r}\nours:  {ours!r}"
    assert stock.stdout[len(ours):].strip("\n") == "", f"stock: {stock.stdout!r}\nours:  {ours!r}"


def test_run_cli_on_default_model(cli_exe, default_model):
    proc = run_cli(cli_exe, "run", default_model, "-p", PROMPT, "-n", "24", "-c", "1024", "-t", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    with Model(default_model) as model, model.context(n_ctx=1024, n_threads=2) as ctx:
        want = ctx.generate(PROMPT, max_tokens=24)  # greedy, as `run` by default (equal to stock: test above)
    assert proc.stdout.startswith(PROMPT) and proc.stdout[len(PROMPT):].rstrip("\n") == want.rstrip("\n"), \
        f"run: {proc.stdout!r}\nAPI: {PROMPT + want!r}"
    assert "qwen2" in proc.stderr and "KV cache: FullKV" in proc.stderr


def test_shipped_plan_runs_on_default_model(cli_exe, default_model):
    """The calibrated plan the demo uses fits the default model and really shrinks its KV cache."""
    from pathlib import Path

    plan = Path(__file__).resolve().parents[1] / "plans" / "qwen2.5-coder-0.5b-instruct-q4_k_m.pool23.b512.json"
    proc = run_cli(cli_exe, "run", default_model, "--plan", plan, "-c", "8192", "-p", PROMPT, "-n", "16", "-v")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KV cache: PolyKV plan (snapkv, streamingllm, tova)" in proc.stderr
    saved = float(proc.stderr.split("saved ")[1].split("%")[0])
    assert saved > 80.0


def test_shipped_per_prompt_plan_re_splits_a_streamed_prompt(default_model):
    """The per-prompt SnapKV plan streams a long prompt at its slack of 2 (probed by its last 32 tokens, as `run`),
    and when the prompt ends re-splits what the layers hold: the budgets follow the prompt, within the pool and
    within budget x slack, and the caches keep their chunked size (no memory beyond the chunked bound)."""
    from pathlib import Path

    from polykv_cpp import plan as plan_mod

    root = Path(__file__).resolve().parents[1]
    plan = plan_mod.load(root / "plans" / "qwen2.5-coder-0.5b-instruct-q4_k_m.snapkv23-head-prompt.b128.json")
    assert plan.allocation == "prompt" and plan.prefill_slack == 2
    with Model(default_model) as model:
        tokens = model.tokenize((root / "docs" / "design.md").read_text())[:3000]
        model.set_plan(plan, prefill="chunked")  # the plan's own slack
        with model.context(n_ctx=4096, n_threads=2) as ctx:
            ctx.decode(tokens, probe=tokens[-32:])
            streamed = ctx.kv_layer_stats()
            ctx.decode([tokens[0]])  # the first decode step compresses the prompt
            stats = ctx.kv_layer_stats()
    budgets = [s.budget_prefill for s in stats]
    assert [s.budget_prefill for s in streamed] == [128] * 24
    assert len(set(budgets)) > 1 and sum(budgets) <= 24 * 128 and min(budgets) >= 32 and max(budgets) <= 256
    assert [s.capacity for s in stats] == [s.capacity for s in streamed] and len({s.capacity for s in stats}) == 1
    assert all(s.used <= b + 1 for s, b in zip(stats, budgets))
