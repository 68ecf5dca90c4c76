"""The polykv-cpp command line, run as users run it."""

import os
import subprocess

import pytest

from conftest import cell_pad_of, padded, run_cli, run_stock


def test_version_names_llama_commit(cli_exe):
    proc = run_cli(cli_exe, "--version")
    assert proc.returncode == 0, proc.stderr
    assert "polykv-cpp 0.1.0" in proc.stdout and "llama.cpp 0c1e57098" in proc.stdout


def test_tools_are_installed_and_run(cli_exe):
    proc = run_cli(cli_exe, "tools")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    paths = dict(line.split("\t") for line in proc.stdout.strip().splitlines())
    for tool in ("llama-completion", "llama-cli", "llama-server", "llama-perplexity", "llama-bench", "llama-batched-bench",
                 "ggml-rpc-server"):
        assert os.access(paths[tool], os.X_OK), tool
    help_out = subprocess.run([paths["llama-completion"], "--help"], capture_output=True, text=True, errors="replace",
                              timeout=60)
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


def test_run_chat_wraps_the_prompt_in_the_template(cli_exe, tmp_path):
    from test_native import CHATML
    from tiny_models import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "chat.gguf", extra_kv={"tokenizer.chat_template": CHATML})
    proc = run_cli(cli_exe, "run", path, "-p", "the cat", "-n", "4", "-c", "256", "--chat")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n")
    assert "prompt: " in proc.stderr
    plain = run_cli(cli_exe, "run", path, "-p", "the cat", "-n", "4", "-c", "256")
    assert plain.stdout.startswith("the cat")
    # token counts differ: the template's markers were fed too
    n_chat = int(proc.stderr.split("prompt: ")[1].split(" ")[0])
    n_plain = int(plain.stderr.split("prompt: ")[1].split(" ")[0])
    assert n_chat > n_plain


@pytest.mark.parametrize("args,needle", [
    (["run", "/nonexistent/model.gguf", "-p", "x"], "model file not found"),
    (["run", "-p", "x"], "no model"),
    (["run", "{tiny}"], "no prompt"),
    (["run", "{tiny}", "-f", "/nonexistent/prompt.txt"], "prompt file not found"),
    (["run", "{notgguf}", "-p", "x"], "not a GGUF file"),
    (["run", "{tiny}", "-p", "x", "--plan-from-gguf"], "holds no PolyKV plan"),
    (["run", "{tiny}", "-p", "x", "--plan", "/nonexistent/plan.json"], "not found"),
    (["run", "{tiny}", "-p", "x", "--plan", "{badplan}"], "JSON"),
    (["run", "{tiny}", "-p", "x", "--plan", "{plan5}"], "the plan is for 5 layers but the model has"),
    (["run", "{tiny}", "-p", "x", "--kv-budget", "512"], "rescales a plan"),
    (["run", "{tiny}", "-p", "x", "--chat"], "no chat template"),
    (["run", "{tiny}", "-p", "x", "--prefill-mode", "exact", "--prefill-slack", "2"], "applies to the chunked"),
    (["run", "{tiny}", "-p", "x", "--plan", "{plan2}", "--prefill-slack", "0.5"], "slack must be"),
    (["run", "{tiny}", "-p", "x", "--plan", "{plan2}", "--plan-from-gguf"], "not both"),
])
def test_bad_input_gives_clear_error(cli_exe, tiny_gguf, tmp_path, args, needle):
    from polykv_cpp.plan import uniform_plan

    notgguf = tmp_path / "x.gguf"
    notgguf.write_text("hello")
    badplan = tmp_path / "bad.json"
    badplan.write_text('{"version": 1, "n_layer": ')
    plan5 = tmp_path / "plan5.json"
    plan5.write_text(uniform_plan(5, "h2o", 64).to_json())
    plan2 = tmp_path / "plan2.json"
    plan2.write_text(uniform_plan(2, "h2o", 64).to_json())
    args = [a.format(tiny=tiny_gguf, notgguf=notgguf, badplan=badplan, plan5=plan5, plan2=plan2) for a in args]
    proc = run_cli(cli_exe, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_evict_every_batches_decode_eviction(cli_exe, tiny_gguf, tmp_path):
    """--evict-every K overrides the plan's: the cache grows K - 1 tokens above the budget before an eviction brings
    it back (5 decode steps after a prompt compressed to 32: 37 held with K = 8, 32 with the plan's own K = 1)."""
    from polykv_cpp.plan import uniform_plan

    sidecar = tmp_path / "plan.json"
    sidecar.write_text(uniform_plan(2, "streamingllm", 32, n_sink=4).to_json())
    used = {}
    for k in (None, 8):
        proc = run_cli(cli_exe, "run", tiny_gguf, "--plan", sidecar, "-p", "the cat " * 30, "-n", "6", "-c", "2048",
                       "-ub", "128", "--no-echo", "-v", *(["--evict-every", k] if k else []))
        assert proc.returncode == 0, proc.stderr[-2000:]
        used[k] = [line.split(" used ")[1].split()[0] for line in proc.stderr.splitlines() if " used " in line
                   and "[polykv-cpp]   layer" in line]
    assert used == {None: ["32", "32"], 8: ["37", "37"]}
    bad = run_cli(cli_exe, "run", tiny_gguf, "--plan", sidecar, "-p", "x", "-n", "2", "--evict-every", "0")
    assert bad.returncode == 2 and "evict_every must be an integer from 1 to 65536" in bad.stderr
    bad = run_cli(cli_exe, "run", tiny_gguf, "-p", "x", "-n", "2", "--evict-every", "8")
    assert bad.returncode == 2 and "--evict-every needs a plan" in bad.stderr


def test_run_reports_quantized_kv_bytes(cli_exe, tmp_path):
    """`-ctk/-ctv q8_0` with a plan: the summary names the K/V types and its MiB are the q8_0 cells' bytes (34 per 32
    values against f16's 64), for the plan's caches and for FullKV's. A model whose heads hold whole q8_0 blocks."""
    import re

    from polykv_cpp.plan import uniform_plan
    from tiny_models import TinyConfig, write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "d32.gguf", TinyConfig(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=128),
                            seed=3)
    sidecar = tmp_path / "plan.json"
    sidecar.write_text(uniform_plan(2, "snapkv", 4096, window=8, obs_window=8).to_json())  # caches of MiB, not KiB
    mib = {}
    for kv_type in ("f16", "q8_0"):
        for plan_args in ([], ["--plan", sidecar]):
            proc = run_cli(cli_exe, "run", model, "-p", "the cat and the dog " * 20, "-n", "4", "-c", "16384",
                           "-ub", "128", "--no-echo", "-ctk", kv_type, "-ctv", kv_type, *plan_args)
            assert proc.returncode == 0, proc.stderr[-2000:]
            line = next(x for x in proc.stderr.splitlines() if "KV cache:" in x)
            assert f"(K/V {kv_type}/{kv_type})" in line, line
            sizes = [float(v) for v in re.findall(r"([0-9.]+) MiB", line)]
            mib[kv_type, bool(plan_args)] = sizes
    for with_plan in (False, True):
        for f16, q8 in zip(mib["f16", with_plan], mib["q8_0", with_plan]):
            assert abs(q8 - f16 * 34 / 64) <= 0.08, (with_plan, mib)  # both printed to 0.1 MiB
    assert mib["q8_0", True][0] < mib["q8_0", True][1] == mib["q8_0", False][0]


def test_run_question_takes_the_model_files_query_agnostic_plan(cli_exe, tiny_gguf, tmp_path):
    """A GGUF with both plans: a prompt read whole (the question inside) follows polykv.plan, a prompt compressed
    before its --question follows polykv.plan_query_agnostic; a model with one plan serves both."""
    from polykv_cpp.plan import uniform_plan, write_gguf

    both = write_gguf(tiny_gguf, tmp_path / "both.gguf", uniform_plan(2, "streamingllm", 32, n_sink=4),
                      query_agnostic_plan=uniform_plan(2, "h2o", 48, n_sink=4))
    one = write_gguf(tiny_gguf, tmp_path / "one.gguf", uniform_plan(2, "streamingllm", 32, n_sink=4))
    common = ["-p", "the cat and the dog " * 20, "-n", "4", "-c", "1024", "-ub", "128", "--no-echo", "-v",
              "--plan-from-gguf"]
    aware = run_cli(cli_exe, "run", both, *common)
    agnostic = run_cli(cli_exe, "run", both, *common, "--question", "where is the cat?")
    fallback = run_cli(cli_exe, "run", one, *common, "--question", "where is the cat?")
    for proc in (aware, agnostic, fallback):
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KV cache: PolyKV plan (streamingllm)" in aware.stderr and "the model file's plan polykv.plan" in aware.stderr
    assert "budget 32/32" in aware.stderr
    assert "KV cache: PolyKV plan (h2o)" in agnostic.stderr and "budget 48/48" in agnostic.stderr
    assert "the model file's plan polykv.plan_query_agnostic" in agnostic.stderr
    assert "KV cache: PolyKV plan (streamingllm)" in fallback.stderr
    assert "the model file's plan polykv.plan;" in fallback.stderr or "the model file's plan polykv.plan\n" in fallback.stderr


def test_run_with_plan_reports_memory_saved(cli_exe, tiny_gguf, tmp_path):
    from polykv_cpp.plan import uniform_plan, write_gguf

    plan = uniform_plan(2, "streamingllm", 32, n_sink=4)
    sidecar = tmp_path / "plan.json"
    sidecar.write_text(plan.to_json())
    with_plan = tmp_path / "tiny.polykv.gguf"
    write_gguf(tiny_gguf, with_plan, plan)
    outs = []
    pad = cell_pad_of(tiny_gguf)
    assert padded(16 + 128, pad) == padded(32 + 128, pad)
    for args in (["--plan", sidecar], ["--plan-from-gguf"], ["--plan-from-gguf", "--kv-budget", "16"]):
        model = with_plan if "--plan-from-gguf" in args else tiny_gguf
        proc = run_cli(cli_exe, "run", model, "-p", "the cat and the dog " * 20, "-n", "8", "-c", "2048",
                       "-ub", "128", "--no-echo", "-v", *args)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "KV cache: PolyKV plan (streamingllm)" in proc.stderr
        cells = padded(32 + 128, pad)  # budget + ubatch (128), padded: 32+128 and 16+128 both give 160 on the CPU
        assert f"saved {100 * (1 - cells / 2048):.1f}%" in proc.stderr
        outs.append(proc)
    assert outs[0].stdout == outs[1].stdout
    assert "budget 32/32" in outs[0].stderr and "budget 16/16" in outs[2].stderr
    assert "used 32" in outs[0].stderr and "used 16" in outs[2].stderr
    exact = run_cli(cli_exe, "run", tiny_gguf, "--plan", sidecar, "--prefill-mode", "exact", "-p", "the cat " * 20,
                    "-n", "4", "-c", "2048", "-ub", "128", "--no-echo", "-v")
    assert exact.returncode == 0, exact.stderr[-2000:]
    # whole-prompt caches of n_ctx cells until the compression, then the plan's cells
    assert f"saved {100 * (1 - cells / 2048):.1f}%; exact prefill (the prompt was held whole" in exact.stderr
    assert "used 32" in exact.stderr and f"capacity {cells} " in exact.stderr
    # slack 4: 4 x 32 + 128 cells while the 100-token prompt streams, 32 kept once the answer starts
    slack = run_cli(cli_exe, "run", tiny_gguf, "--plan", sidecar, "--prefill-slack", "4", "-p", "the cat and the dog " * 20,
                    "-n", "4", "-c", "2048", "-ub", "128", "--no-echo", "-v")
    assert slack.returncode == 0, slack.stderr[-2000:]
    assert f"saved {100 * (1 - 256 / 2048):.1f}%; chunked prefill with slack 4" in slack.stderr
    assert "used 32" in slack.stderr
    # the stock tools take the slack from the environment
    from polykv_cpp._native import bin_dir
    env = dict(os.environ, LLAMA_POLYKV_PLAN=str(sidecar), LLAMA_POLYKV_PREFILL_SLACK="4")
    tool = run_stock([str(bin_dir() / "llama-completion"), "-m", str(tiny_gguf), "-p", "the cat", "-n", "2",
                      "-no-cnv", "--no-warmup", "-c", "2048", "-ub", "128", "-v"], timeout=120, env=env)
    assert tool.returncode == 0, tool.stderr[-2000:]
    assert "prefill slack 4" in tool.stderr and "12.5% of FullKV" in tool.stderr
    # without the flag the plan in the file is not used
    plain = run_cli(cli_exe, "run", with_plan, "-p", "x", "-n", "2", "-c", "256")
    assert plain.returncode == 0 and "FullKV (no plan)" in plain.stderr



def test_a_plans_prefill_slack_is_the_default_of_run_and_the_stock_tools(cli_exe, tiny_gguf, tmp_path):
    """A plan that names its slack ("prefill_slack": 4) runs with it unless --prefill-slack or
    LLAMA_POLYKV_PREFILL_SLACK says otherwise: 4 x 32 + 128 cells while the prompt streams instead of 32 + 128."""
    from dataclasses import replace

    from polykv_cpp._native import bin_dir
    from polykv_cpp.plan import uniform_plan

    sidecar = tmp_path / "plan.json"
    sidecar.write_text(replace(uniform_plan(2, "snapkv", 32), prefill_slack=4).to_json())
    run = ["run", tiny_gguf, "--plan", sidecar, "-p", "the cat and the dog " * 20, "-n", "4", "-c", "2048",
           "-ub", "128", "--no-echo", "-v"]
    own = run_cli(cli_exe, *run)
    assert own.returncode == 0, own.stderr[-2000:]
    assert f"saved {100 * (1 - 256 / 2048):.1f}%; chunked prefill with slack 4" in own.stderr
    overridden = run_cli(cli_exe, *run, "--prefill-slack", "1")
    assert overridden.returncode == 0, overridden.stderr[-2000:]
    assert f"saved {100 * (1 - 160 / 2048):.1f}%; chunked prefill" in overridden.stderr
    assert "slack" not in overridden.stderr
    stock = [str(bin_dir() / "llama-completion"), "-m", str(tiny_gguf), "-p", "the cat", "-n", "2", "-no-cnv",
             "--no-warmup", "-c", "2048", "-ub", "128", "-v"]
    tool = run_stock(stock, timeout=120, env=dict(os.environ, LLAMA_POLYKV_PLAN=str(sidecar)))
    assert tool.returncode == 0, tool.stderr[-2000:]
    assert "prefill slack 4" in tool.stderr
    tool = run_stock(stock, timeout=120, env=dict(os.environ, LLAMA_POLYKV_PLAN=str(sidecar),
                                                  LLAMA_POLYKV_PREFILL_SLACK="1"))
    assert tool.returncode == 0, tool.stderr[-2000:]
    assert "PolyKV plan active" in tool.stderr and "prefill slack" not in tool.stderr

def test_run_probes_a_streaming_prompt_with_its_last_tokens(cli_exe, tiny_gguf, tmp_path):
    """--prompt-probe N: the summary names the probe; the cache keeps the plan's size; the default probes with the
    last 32 tokens, 0 turns it off; bad values are refused."""
    from polykv_cpp.plan import uniform_plan

    sidecar = tmp_path / "plan.json"
    sidecar.write_text(uniform_plan(2, "snapkv", 32).to_json())
    run = ["run", tiny_gguf, "--plan", sidecar, "-p", "the cat and the dog " * 40, "-n", "4", "-c", "2048",
           "-ub", "128", "--no-echo"]
    probed = run_cli(cli_exe, *run, "--prompt-probe", "16")
    assert probed.returncode == 0, probed.stderr[-2000:]
    assert "chunked prefill, probed by the prompt's last 16 tokens" in probed.stderr
    assert f"saved {100 * (1 - 160 / 2048):.1f}%" in probed.stderr  # 32 + one ubatch of 128 cells, as unprobed
    default = run_cli(cli_exe, *run)
    assert default.returncode == 0 and "chunked prefill, probed by the prompt's last 32 tokens" in default.stderr
    off = run_cli(cli_exe, *run, "--prompt-probe", "0")
    assert off.returncode == 0 and "probed" not in off.stderr and "; chunked prefill" in off.stderr
    short = run_cli(cli_exe, *run[:4], "-p", "the cat", *run[6:])  # one ubatch: nothing to probe
    assert short.returncode == 0 and "probed" not in short.stderr, short.stderr[-2000:]
    for bad in ("-1", "128"):
        proc = run_cli(cli_exe, *run, "--prompt-probe", bad)
        assert proc.returncode == 2 and "--prompt-probe must be" in proc.stderr and "Traceback" not in proc.stderr


def test_truncated_model_is_a_clean_error(cli_exe, tiny_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:5000])
    proc = run_cli(cli_exe, "run", bad, "-p", "x")
    assert proc.returncode == 2
    assert "failed to load model" in proc.stderr and "Traceback" not in proc.stderr


def test_stock_tools_honour_plan_from_gguf_and_env(tiny_gguf, tmp_path):
    from polykv_cpp._native import bin_dir
    from polykv_cpp.plan import uniform_plan, write_gguf

    plan = uniform_plan(2, "streamingllm", 32, n_sink=4)
    with_plan = write_gguf(tiny_gguf, tmp_path / "tiny.polykv.gguf", plan)
    sidecar = tmp_path / "plan.json"
    sidecar.write_text(plan.to_json())
    completion = run_stock(
        [str(bin_dir() / "llama-completion"), "-m", str(with_plan), "-p", "the cat", "-n", "4", "-no-cnv",
         "--no-warmup", "-c", "2048", "-ub", "128", "-v"], timeout=120)
    assert completion.returncode == 0, completion.stderr[-2000:]
    assert "PolyKV plan active (GGUF key polykv.plan)" in completion.stderr
    assert "7.8% of FullKV" in completion.stderr  # 160 of 2048 cells
    env = dict(os.environ, LLAMA_POLYKV_PLAN=str(sidecar), LLAMA_POLYKV_KV_BUDGET="16")
    bench = subprocess.run([str(bin_dir() / "llama-bench"), "-m", str(tiny_gguf), "-p", "32", "-n", "4", "-r", "1",
                            "-v"], capture_output=True, text=True, errors="replace", timeout=120, env=env)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert f"PolyKV plan active (file {sidecar}, kv-budget 16)" in bench.stdout + bench.stderr
    disabled = run_stock(
        [str(bin_dir() / "llama-completion"), "-m", str(with_plan), "-p", "the cat", "-n", "2", "-no-cnv",
         "--no-warmup", "-c", "512", "-v"], timeout=120, env=dict(os.environ, LLAMA_POLYKV_DISABLE="1"))
    assert disabled.returncode == 0 and "PolyKV plan active" not in disabled.stderr


def test_run_defaults_to_exact_prefill_for_a_plan_that_needs_the_whole_prompt(cli_exe, tiny_gguf, tmp_path):
    """Per-prompt budgets (and KVzip) need the whole prompt: without --prefill-mode, run compresses it once and says
    why; the answer equals --prefill-mode exact's; --prefill-mode chunked still streams (with the plan's budgets),
    and so does a prefill slack > 1 (the budgets re-split within budget x slack)."""
    from polykv_cpp.plan import uniform_plan

    sidecar = tmp_path / "plan.json"
    sidecar.write_text(uniform_plan(2, "snapkv", 32, allocation="prompt", b_min=4).to_json())
    run = ["run", tiny_gguf, "--plan", sidecar, "-p", "the cat and the dog " * 20, "-n", "6", "-c", "1024",
           "-ub", "128", "--no-echo"]
    auto = run_cli(cli_exe, *run)
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "; exact prefill (the plan's KVzip pass or per-prompt budgets need the whole prompt)" in auto.stderr
    exact = run_cli(cli_exe, *run, "--prefill-mode", "exact")
    assert exact.returncode == 0 and "; exact prefill" in exact.stderr and "need the whole prompt" not in exact.stderr
    assert auto.stdout == exact.stdout and auto.stdout.strip()
    chunked = run_cli(cli_exe, *run, "--prefill-mode", "chunked")
    assert chunked.returncode == 0 and "; chunked prefill" in chunked.stderr, chunked.stderr[-2000:]
    # with a prefill slack, chunked prefill re-splits what each layer holds when the prompt ends: run streams
    slack = run_cli(cli_exe, *run, "--prefill-slack", "2")
    assert slack.returncode == 0 and "; chunked prefill" in slack.stderr, slack.stderr[-2000:]
    assert "need the whole prompt" not in slack.stderr
    plain = run_cli(cli_exe, "run", tiny_gguf, "--plan", sidecar.parent / "snap.json", "-p", "x", "-n", "1")
    assert plain.returncode == 2 and "Traceback" not in plain.stderr  # a missing plan file: a message


@pytest.mark.parametrize("mode", ["exact", "chunked"])
def test_run_question_is_read_after_the_prompt_was_compressed(cli_exe, tmp_path, mode):
    """--question: the prompt is compressed first and the question fed after it (kvpress's pipeline), in the chat
    template as one user message: the answer equals the API's decode(context); compress_prompt(); generate(question)
    on the same two token lists; without a plan it equals FullKV on the same tokens."""
    from polykv_cpp.api import Model
    from polykv_cpp.cli import split_question
    from polykv_cpp.plan import uniform_plan
    from test_native import CHATML
    from tiny_models import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "chat.gguf", extra_kv={"tokenizer.chat_template": CHATML})
    sidecar = tmp_path / "plan.json"
    plan = uniform_plan(2, "snapkv", 32)
    sidecar.write_text(plan.to_json())
    doc, question = "the cat and the dog " * 30, "where is the cat?"
    kw = dict(n_ctx=1024, n_batch=128, n_ubatch=128)
    args = ["run", path, "-p", doc, "--question", question, "--chat", "-n", "6", "-c", "1024", "-ub", "128",
            "-b", "128", "--no-echo", "--prefill-mode", mode, "--prompt-probe", "0"]
    proc = run_cli(cli_exe, *args, "--plan", sidecar)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "compressed before the question (" in proc.stderr
    with Model(path) as model:
        context, q = split_question(model, doc, question, chat=True)
        assert context.startswith("<|im_start|>user\nthe cat") and q.startswith(question)
        assert q.endswith("<|im_end|>\n<|im_start|>assistant\n")
        q_tokens = model.tokenize(q, add_special=False, parse_special=True)
        outs = []
        for p in (plan, None):
            model.set_plan(p, prefill=mode)
            with model.context(**kw) as ctx:
                ctx.decode(model.tokenize(context))
                if p is not None and mode == "exact":
                    ctx.compress_prompt()
                outs.append("".join(ctx.generate(q_tokens, max_tokens=6, temperature=0.0, stream=True)))
    assert proc.stdout.rstrip("\n") == outs[0]
    full = run_cli(cli_exe, *args)
    assert full.returncode == 0 and full.stdout.rstrip("\n") == outs[1], full.stderr[-2000:]
