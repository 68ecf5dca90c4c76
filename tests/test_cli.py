"""The polykv-cpp command line, run as users run it."""

import os
import subprocess

import pytest

from conftest import run_cli


def test_version_names_llama_commit(cli_exe):
    proc = run_cli(cli_exe, "--version")
    assert proc.returncode == 0, proc.stderr
    assert "polykv-cpp 0.1.0" in proc.stdout and "llama.cpp 0c1e57098" in proc.stdout


def test_tools_are_installed_and_run(cli_exe):
    proc = run_cli(cli_exe, "tools")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    paths = dict(line.split("\t") for line in proc.stdout.strip().splitlines())
    for tool in ("llama-completion", "llama-cli", "llama-server", "llama-perplexity", "llama-bench"):
        assert os.access(paths[tool], os.X_OK), tool
    help_out = subprocess.run([paths["llama-completion"], "--help"], capture_output=True, text=True, timeout=60)
    assert help_out.returncode == 0 and "--n-predict" in help_out.stdout + help_out.stderr
    version = subprocess.run([paths["llama-bench"], "--help"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0


def test_run_generates_and_reports(cli_exe, tiny_gguf):
    proc = run_cli(cli_exe, "run", tiny_gguf, "-p", "the cat", "-n", "8", "-c", "256")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("the cat")
    assert len(proc.stdout.strip()) > len("the cat")
    assert "KV cache: FullKV" in proc.stderr
    assert "generation:" in proc.stderr


def test_run_with_m_flag_and_prompt_file(cli_exe, tiny_gguf, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the dog")
    a = run_cli(cli_exe, "run", "-m", tiny_gguf, "-f", prompt, "-n", "6", "-c", "256", "--no-echo")
    b = run_cli(cli_exe, "run", tiny_gguf, "-p", "the dog", "-n", "6", "-c", "256", "--no-echo")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


@pytest.mark.parametrize("args,needle", [
    (["run", "/nonexistent/model.gguf", "-p", "x"], "model file not found"),
    (["run", "-p", "x"], "no model"),
    (["run", "{tiny}"], "no prompt"),
    (["run", "{tiny}", "-f", "/nonexistent/prompt.txt"], "prompt file not found"),
    (["run", "{notgguf}", "-p", "x"], "not a GGUF file"),
    (["run", "{tiny}", "-p", "x", "--plan-from-gguf"], "not supported by this build yet"),
    (["run", "{tiny}", "-p", "x", "--plan", "plan.json"], "not supported by this build yet"),
    (["run", "{tiny}", "-p", "x", "--kv-budget", "512"], "not supported by this build yet"),
])
def test_bad_input_gives_clear_error(cli_exe, tiny_gguf, tmp_path, args, needle):
    notgguf = tmp_path / "x.gguf"
    notgguf.write_text("hello")
    args = [a.format(tiny=tiny_gguf, notgguf=notgguf) for a in args]
    proc = run_cli(cli_exe, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_truncated_model_is_a_clean_error(cli_exe, tiny_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:5000])
    proc = run_cli(cli_exe, "run", bad, "-p", "x")
    assert proc.returncode == 2
    assert "failed to load model" in proc.stderr and "Traceback" not in proc.stderr
