"""A compressed cache saved to a session file in one process continues in another (#16 item 4): llama.cpp's
`llama_state_save_file` / `llama_state_load_file` through our bindings, and the stock tools' `--prompt-cache`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import run_stock
from polykv_cpp._native import bin_dir
from polykv_cpp.api import Model
from polykv_cpp.errors import NativeError
from polykv_cpp.plan import uniform_plan

PROMPT = [(5 * i * i + 7 * i + 3) % 380 + 2 for i in range(400)]
CTX = dict(n_ctx=1024, n_batch=128, n_ubatch=128, n_threads=1)

WRITER = r"""
import json, sys
from polykv_cpp.api import Model
from polykv_cpp.plan import Plan
path, plan, session, prompt, ctx_args = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), \
    json.loads(sys.argv[5])
with Model(path) as model:
    model.set_plan(Plan.from_json(plan))
    with model.context(**ctx_args) as ctx:
        ctx.decode(prompt[:-1])
        ctx.save_state_file(session, prompt[:-1])
        out = list(ctx.generate_tokens([prompt[-1]], max_tokens=10, stop_at_eog=False))
        stats = ctx.kv_layer_stats()
print(json.dumps({"tokens": out, "evicted": sum(s.n_evicted for s in stats)}))
"""


def test_session_file_continues_in_another_process(tiny_gguf, tmp_path):
    plan = uniform_plan(2, "h2o", 48)
    session = tmp_path / "session.bin"
    proc = subprocess.run([sys.executable, "-c", WRITER, str(tiny_gguf), plan.to_json(), str(session),
                           json.dumps(PROMPT), json.dumps(CTX)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    assert written["evicted"] > 0

    with Model(tiny_gguf) as model:
        model.set_plan(plan)
        with model.context(**CTX) as ctx:
            assert ctx.load_state_file(session) == PROMPT[:-1]
            assert ctx.n_past == len(PROMPT) - 1
            kept = [len(ctx.kept_positions(il)) for il in range(2)]
            assert kept == [48, 48]  # the file holds the compressed cache, not the prompt
            assert list(ctx.generate_tokens([PROMPT[-1]], max_tokens=10, stop_at_eog=False)) == written["tokens"]

        # another plan (other budgets, so other cache sizes) or another model: refused with a message
        model.set_plan(uniform_plan(2, "h2o", 96))
        with model.context(**CTX) as ctx, pytest.raises(NativeError, match="failed to load the state"):
            ctx.load_state_file(session)
        with model.context(**CTX) as ctx, pytest.raises(NativeError, match="not found"):
            ctx.load_state_file(tmp_path / "missing.bin")
    from tiny_models import TinyConfig, write_tiny_gguf

    other = write_tiny_gguf(tmp_path / "three-layers.gguf", TinyConfig(n_layer=3), seed=1)
    with Model(other) as model:
        model.set_plan(uniform_plan(3, "h2o", 48))
        with model.context(**CTX) as ctx, pytest.raises(NativeError, match="failed to load the state"):
            ctx.load_state_file(session)


def _completion(model, prompt_cache, env_plan, tmp_path, fresh=False, refused=False):
    text = "the cat and the dog and the bird " * 30
    env = {"PATH": "/usr/bin:/bin", "LLAMA_POLYKV_PLAN": str(env_plan)}
    retry = (lambda: prompt_cache.unlink(missing_ok=True)) if fresh else None  # a rerun must not find the session
    return run_stock([str(bin_dir() / "llama-completion"), "-m", str(model), "-p", text, "-n", "12", "--temp", "0",
                      "-c", "1024", "-t", "1", "-ub", "64", "-no-cnv", "--no-display-prompt", "--no-warmup",
                      "--simple-io", "--prompt-cache", str(prompt_cache)], env=env, cwd=tmp_path,
                     before_retry=retry, **({"done": lambda p: "failed to load session file" in p.stderr}
                                            if refused else {}))


def test_stock_prompt_cache_of_a_compressed_cache(tiny_gguf, tmp_path):
    """`llama-completion --prompt-cache`: the second run loads the first run's compressed session and answers the
    same; the session is smaller than FullKV's; a session of another plan is refused, not misread."""
    plan = tmp_path / "plan.json"
    plan.write_text(uniform_plan(2, "snapkv", 48).to_json())
    cache = tmp_path / "prompt.bin"
    first = _completion(tiny_gguf, cache, plan, tmp_path, fresh=True)
    assert first.returncode == 0, first.stderr[-2000:]
    second = _completion(tiny_gguf, cache, plan, tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "loaded a session" in second.stderr and "exact match" in second.stderr
    assert first.stdout.strip(), first.stderr[-3000:]
    assert second.stdout == first.stdout, (first.stderr[-2000:], second.stderr[-2000:])

    full_plan = tmp_path / "fullkv.json"
    full_plan.write_text(uniform_plan(2, "fullkv", 1024).to_json())
    full_cache = tmp_path / "full.bin"
    assert _completion(tiny_gguf, full_cache, full_plan, tmp_path, fresh=True).returncode == 0
    assert cache.stat().st_size < full_cache.stat().st_size / 4

    other = tmp_path / "other.json"
    other.write_text(uniform_plan(2, "snapkv", 96).to_json())
    wrong = _completion(tiny_gguf, cache, other, tmp_path, refused=True)
    assert "failed to load session file" in wrong.stderr and "PolyKV: the saved state" in wrong.stderr
