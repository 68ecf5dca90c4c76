"""examples/chat.py on piped input: turns share one compressed cache and report its memory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CHAT = Path(__file__).parents[1] / "examples" / "chat.py"


def _chat(*args, stdin: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHAT), *map(str, args)], input=stdin, capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_chat_keeps_the_conversation_in_a_compressed_cache(tiny_gguf, tmp_path):
    long = "the cat and the dog and the bird " * 12
    proc = _chat(tiny_gguf, "--pattern", "streamingllm", "--budget", "32", "-n", "8",
                 stdin=f"{long}\n{long}\nand now?\n\nnot read\n", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("> ") == 3  # the empty line ended the chat
    turns = [tuple(map(int, m)) for m in
             re.findall(r"(\d+) tokens so far, layers keep (\d+)-(\d+), (\d+) evicted", proc.stderr)]
    assert len(turns) == 3
    seen = [t[0] for t in turns]
    assert seen[0] > 300 and seen[1] > seen[0] + 300 and seen[2] > seen[1]  # each turn adds to the same context
    assert all(t[2] <= 32 for t in turns)  # after every answer each layer holds its budget
    evicted = [t[3] for t in turns]
    assert evicted[0] > 0 and evicted[1] > evicted[0] + 250 and evicted[2] > evicted[1]
    assert re.search(r"\(\d+% saved\)", proc.stderr)


def test_chat_missing_model(tmp_path):
    proc = _chat(tmp_path / "nope.gguf", stdin="hi\n", cwd=tmp_path)
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_with_a_kvzip_plan_compresses_the_first_message_once(tiny_gguf, tmp_path):
    """A plan that needs the whole prompt (the shipped query-agnostic KVzip plan's shape: kvzip per head,
    per-prompt budgets, follow-ups kept): exact prefill, KVzip's pass on the first message before its answer,
    nothing evicted afterwards, every later token kept in every layer."""
    import dataclasses

    from polykv_cpp.plan import uniform_plan
    from tiny_models import TinyConfig

    plan = uniform_plan(TinyConfig().n_layer, "kvzip", 32, selection="head", allocation="prompt", b_min=4)
    path = tmp_path / "kvzip-keep.json"
    path.write_text(dataclasses.replace(plan, followup="keep").to_json())
    long = "the cat and the dog and the bird " * 12
    proc = _chat(tiny_gguf, "--plan", path, "-n", "8", stdin=f"{long}\nand the cat?\nand now?\n", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("first message compressed (KVzip's reconstruction pass") == 1
    turns = [tuple(map(int, m)) for m in
             re.findall(r"(\d+) tokens so far, layers keep (\d+)-(\d+), (\d+) evicted", proc.stderr)]
    assert len(turns) == 3
    seen, low, high, evicted = zip(*turns)
    assert seen[0] > 300 and evicted[0] > 200 and high[0] < seen[0]  # the first message was compressed
    assert evicted[1] == evicted[0] and evicted[2] == evicted[0]  # the follow-ups are kept
    for t in (1, 2):  # every layer holds every token that came after
        assert low[t] - low[t - 1] == seen[t] - seen[t - 1] == high[t] - high[t - 1]


def test_chat_recompress_keeps_a_kvzip_history_at_the_plans_size(tiny_gguf, tmp_path):
    """`--recompress`: before each new message the whole conversation is re-read and compressed by KVzip's pass
    again, so the cache stays near the plan's size instead of growing by every later turn."""
    import dataclasses

    from polykv_cpp.plan import uniform_plan
    from tiny_models import TinyConfig

    plan = uniform_plan(TinyConfig().n_layer, "kvzip", 32, selection="head", allocation="prompt", b_min=4)
    path = tmp_path / "kvzip-keep.json"
    path.write_text(dataclasses.replace(plan, followup="keep").to_json())
    long = "the cat and the dog and the bird " * 12
    stdin = f"{long}\n{long}\nand now?\n"
    kept = _chat(tiny_gguf, "--plan", path, "-n", "8", stdin=stdin, cwd=tmp_path)
    again = _chat(tiny_gguf, "--plan", path, "-n", "8", "--recompress", stdin=stdin, cwd=tmp_path)
    for proc in (kept, again):
        assert proc.returncode == 0, proc.stderr[-2000:]
    pattern = r"(\d+) tokens so far, layers keep (\d+)-(\d+), (\d+) evicted"
    kept_turns = [tuple(map(int, m)) for m in re.findall(pattern, kept.stderr)]
    lines = [tuple(map(int, m)) for m in re.findall(pattern, again.stderr)]
    assert again.stderr.count("history re-read and compressed") == 2
    assert len(lines) == 5  # three answers and the two re-compressions between them
    first, recompressed, _, recompressed2, last = lines
    # the re-read history is the whole conversation so far, compressed to the plan's size
    assert recompressed[0] > first[0] and recompressed[2] <= TinyConfig().n_layer * 32
    assert recompressed2[0] > 600 and recompressed2[2] < recompressed2[0] / 4
    # without it every later token stays in every layer: the last turn keeps far more
    assert kept_turns[-1][2] - kept_turns[0][2] == kept_turns[-1][0] - kept_turns[0][0]
    assert last[2] < kept_turns[-1][2] / 3
