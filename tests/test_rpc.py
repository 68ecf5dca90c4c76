"""A model split across machines with llama.cpp's RPC backend: `ggml-rpc-server` on 127.0.0.1 holds the layers and
their plan-sized KV caches, and generation follows the plan there exactly as locally (same greedy tokens, same kept
positions per layer and per head). Loopback only, bounded in time; the RPC devices are process-global, so every
run is a child process."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from polykv_cpp._native import bin_dir
from polykv_cpp.plan import uniform_plan
from tiny_models import TinyConfig, write_tiny_gguf

CFG = TinyConfig(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=384)
BUDGET = 40

pytestmark = pytest.mark.skipif(os.environ.get("POLYKV_RPC", "ON").upper() in ("OFF", "0"),
                                reason="built without the RPC backend (POLYKV_RPC=OFF)")

CHILD = textwrap.dedent("""
    import json, sys
    from polykv_cpp import _native
    from polykv_cpp.api import Model
    from polykv_cpp.plan import Plan
    path, plan_path, endpoint, per_head = sys.argv[1:5]
    prompt = json.loads(sys.argv[5])
    ngl = 0
    if endpoint:
        print(json.dumps(_native.add_rpc_servers(endpoint)), file=sys.stderr)
        ngl = 99
    with Model(path, n_gpu_layers=ngl) as model:
        plan = Plan.from_json(open(plan_path).read())
        model.set_plan(plan)
        mark = _native.log_mark()
        with model.context(n_ctx=512, n_batch=32, n_ubatch=32, n_threads=1) as ctx:
            packed = "are packed into" in _native.log_since(mark, min_level=2)
            out = list(ctx.generate_tokens(prompt, max_tokens=12))
            heads = [0, 1] if per_head == "head" else [None]
            kept = {f"{il}/{h}": ctx.kept_positions(il, h) for il in range(2) for h in heads}
            stats = [(s.capacity, s.used, s.n_evicted) for s in ctx.kv_layer_stats()]
            repacks = ctx.device_repacks()
    print(json.dumps({"tokens": out, "kept": kept, "stats": stats, "device_repacks": repacks, "packed": packed}))
""")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("rpc") / "tiny.gguf", CFG, seed=5)


@pytest.fixture(scope="module")
def server():
    exe = bin_dir() / "ggml-rpc-server"
    assert exe.exists(), f"{exe} not built (the default build has POLYKV_RPC=ON)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port), "-t", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "ggml-rpc-server did not start"
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def run_child(path, plan_file, selection, endpoint=""):
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, CFG.n_vocab, size=150)]
    env = {**os.environ, "LLAMA_ARG_REPACK": "0"}  # the server's CPU runs ggml's plain kernels: so does local
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(plan_file), endpoint, selection,
                        json.dumps(prompt)],
                       capture_output=True, text=True, timeout=300, env=env,
                       cwd=Path(path).parent)  # not the source tree: the installed package, with its library
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.parametrize("selection", ["layer", "head"])
def test_a_plan_runs_on_an_rpc_server_as_locally(path, server, tmp_path, selection):
    plan = uniform_plan(CFG.n_layer, "snapkv", BUDGET, decode_pattern="h2o", selection=selection, window=8,
                        obs_window=8)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    local, _ = run_child(path, plan_file, selection)
    remote, log = run_child(path, plan_file, selection, server)
    assert json.loads(log.strip().splitlines()[0]) == {server: 1}  # one device: the server's CPU
    assert remote["tokens"] == local["tokens"]
    assert remote["kept"] == local["kept"]
    assert all(len(k) == BUDGET for k in local["kept"].values())
    # the same cells held and evicted; the capacity follows the device's padding (256 cells for a non-CPU device)
    assert [s[1:] for s in remote["stats"]] == [s[1:] for s in local["stats"]]
    assert all(s[0] % 256 == 0 and s[0] < BUDGET + 32 + 256 for s in remote["stats"])
    # per-head layers move their kept rows after evictions: on the server, as one graph per eviction (not one
    # round trip per moved row); in host memory, by plain copies
    assert local["device_repacks"] == 0
    assert (remote["device_repacks"] > 0) == (selection == "head")
    # the groups' graph inputs cross to the server packed, one per type (test_packed_inputs.py), not on the host
    assert remote["packed"] and not local["packed"]


def test_cli_run_with_rpc(path, server, tmp_path, cli_exe):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(uniform_plan(CFG.n_layer, "tova", BUDGET).to_json())
    env = {**os.environ, "LLAMA_ARG_REPACK": "0"}
    args = ["run", "-m", path, "--plan", plan_file, "-p", "hello " * 60, "-n", "12", "--no-echo", "-c", "512",
            "-ub", "32", "-t", "1"]
    local = run_cli(cli_exe, *args, env=env, timeout=300)
    remote = run_cli(cli_exe, *args, "--rpc", server, env=env, timeout=300)
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr[-2000:]
    assert remote.stdout == local.stdout and remote.stdout.strip()
    assert "evicted so far" in remote.stderr


def test_bad_rpc_servers_get_a_clear_error(path, cli_exe):
    bad = run_cli(cli_exe, "run", "-m", path, "-p", "hi", "-n", "1", "--rpc", "no-port-here")
    assert bad.returncode == 2 and "expected host:port" in bad.stderr and "Traceback" not in bad.stderr
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = run_cli(cli_exe, "run", "-m", path, "-p", "hi", "-n", "1", "--rpc", f"127.0.0.1:{port}", timeout=120)
    assert gone.returncode == 2 and f"RPC server 127.0.0.1:{port}: cannot connect" in gone.stderr
    assert "Traceback" not in gone.stderr
