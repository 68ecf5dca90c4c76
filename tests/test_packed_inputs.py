"""Graph inputs packed into one input per type equal the groups' own inputs.

A plan gives every cache group its own graph inputs: the cells the ubatch's keys and values go to, and the attention
mask (per-head layers: a mask slice per KV head; adaptive layers: a visibility mask and an owner mask). Where the
caches are off the host (a GPU, an RPC server) ggml's scheduler copies each graph input to the device on its own, a
synchronous transfer each: about three per layer and token. So the library packs a decode step's inputs of one type
into one graph input, copies that once and views it on the device (`llm_graph_input_attn_kv_poly::packs`,
`docs/design.md`). ``LLAMA_POLYKV_PACK_INPUTS=1`` packs every ubatch, on the CPU too: the kept sets and logits must
equal the unpacked run's bit for bit (the same values at other addresses), for every kind of layer in one graph,
flash attention on and off, chunked and exact prefill, several sequences in one ubatch, and a sliding-window model.
`test_rpc.py` runs the packed inputs on a real non-host device, where they are the default.
"""

import os

import numpy as np
import pytest

from polykv_cpp import _native
from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.plan import uniform_plan
from tiny_models import TinyConfig, write_tiny_gguf

CFG = TinyConfig(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=384)
N_PROMPT, N_DECODE, BUDGET = 150, 12, 48
PACKED_LOG = "are packed into"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("packed") / "tiny.gguf", CFG, seed=5)


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(8)
    return [int(t) for t in rng.integers(3, CFG.n_vocab, size=N_PROMPT + N_DECODE)]


def packed_since(mark: int) -> bool:
    """Whether the library said it packed the inputs since `mark`: read when the context is made (its first graph,
    the scheduler's reserve, is built then), before the log's bounded history fills with later lines."""
    return PACKED_LOG in _native.log_since(mark, min_level=2)


def every_kind_plan() -> plan_mod.Plan:
    """One layer of each kind of cache group: per layer, per KV head, adaptive heads, and a positional one."""
    kinds = [("snapkv", "layer"), ("h2o", "head"), ("snapkv", "adaptive"), ("streamingllm", "layer")]
    params = {"snapkv": dict(n_sink=0, window=8, obs_window=16, pool_kernel=7), "h2o": dict(n_sink=0, window=8),
              "streamingllm": dict(n_sink=4)}
    layers = []
    for il, (pattern, selection) in enumerate(kinds):
        phase = plan_mod.PhasePlan(pattern, budget=BUDGET, selection=selection, **params[pattern])
        layers.append(plan_mod.LayerPlan(il, phase, phase))
    return plan_mod.Plan(version=1, n_layer=CFG.n_layer, budget_avg=BUDGET, b_min=1, budget_rule="test",
                         layers=layers, exact_total=False).validate()


def run(monkeypatch, path, plan, toks, mode, *, flash_attn="on", prefill="chunked", n_ubatch=64):
    """Kept positions of every layer and KV head after the prompt and each decode step, the logits, and whether
    the library said it packed the inputs."""
    monkeypatch.setenv("LLAMA_POLYKV_PACK_INPUTS", mode)
    mark = _native.log_mark()
    with Model(path) as model:
        model.set_plan(plan, prefill=prefill)
        with model.context(n_ctx=512, n_batch=512, n_ubatch=n_ubatch, flash_attn=flash_attn, type_k="f32",
                           type_v="f32") as ctx:
            said = packed_since(mark)

            def snap():
                return [[ctx.kept_positions(il, h) for h in (None, *range(CFG.n_head_kv))]
                        for il in range(CFG.n_layer)]

            ctx.decode(toks[:N_PROMPT])
            kept, logits = [snap()], [ctx.logits()]
            for t in toks[N_PROMPT:]:
                ctx.decode([t])
                kept.append(snap())
                logits.append(ctx.logits())
    return kept, np.array(logits), said


@pytest.mark.parametrize("prefill", ["chunked", "exact"])
@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_packed_inputs_equal_the_groups_own(monkeypatch, path, tokens, flash_attn, prefill):
    plan = every_kind_plan()
    kept_p, logits_p, said_p = run(monkeypatch, path, plan, tokens, "1", flash_attn=flash_attn, prefill=prefill)
    kept_u, logits_u, said_u = run(monkeypatch, path, plan, tokens, "0", flash_attn=flash_attn, prefill=prefill)
    assert said_p and not said_u
    assert kept_p == kept_u
    # something was evicted in every compressing layer, or the comparison would say little
    assert all(len(kept_p[-1][il][0]) < N_PROMPT for il in range(CFG.n_layer))
    np.testing.assert_array_equal(logits_p, logits_u)


def test_cpu_caches_are_not_packed_by_default(monkeypatch, path, tokens):
    """On the host the groups' inputs are already where the graph reads them: nothing to pack."""
    if os.environ.get("LLAMA_ARG_N_GPU_LAYERS", "0") != "0" and _native.has_gpu():
        pytest.skip("the layers are offloaded (scripts/gpu_check.sh): packed by default")
    _, _, said = run(monkeypatch, path, every_kind_plan(), tokens, "")
    assert not said


def test_packed_inputs_of_several_sequences_in_one_ubatch(monkeypatch, path, tokens):
    """Decode steps of several sequences share a ubatch: one input per sequence, each packed."""
    prompts = [tokens[:150], tokens[7:128], tokens[20:161]]
    plan = uniform_plan(CFG.n_layer, "snapkv", BUDGET, selection="head")
    runs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("LLAMA_POLYKV_PACK_INPUTS", mode)
        mark = _native.log_mark()
        with Model(path) as model:
            model.set_plan(plan)
            with model.context(n_ctx=3 * 256, n_ubatch=64, n_seq_max=3, type_k="f32", type_v="f32") as ctx:
                said = packed_since(mark)
                for s, p in enumerate(prompts):
                    ctx.decode_sequences({s: p[:-4]})
                logits = []
                for k in range(4):
                    out = ctx.decode_sequences({s: [p[len(p) - 4 + k]] for s, p in enumerate(prompts)})
                    logits.append(np.array([ctx.logits(out[s]) for s in range(3)]))
                kept = [[ctx.kept_positions(il, h, seq=s) for il in range(CFG.n_layer) for h in (0, 1)]
                        for s in range(3)]
                shared = ctx.shared_ubatches()
        runs[mode] = (np.array(logits), kept, shared, said)
    assert runs["1"][2] == runs["0"][2] and runs["1"][2][0] > 0  # the decode steps did share ubatches
    assert runs["1"][3] and not runs["0"][3]
    assert runs["1"][1] == runs["0"][1]
    np.testing.assert_array_equal(runs["1"][0], runs["0"][0])


@pytest.mark.slow
def test_packed_inputs_on_a_sliding_window_model(monkeypatch):
    """Gemma-3-270M: sliding-window and global groups, the iSWA input forwarding to the packed one."""
    from polykv_cpp import models

    gguf = models.fetch("gemma-3-270m-q4_k_m", progress=False)
    text = ("The quick brown fox jumps over the lazy dog. " * 30) + "The secret number is 4817. " + \
           ("A journey of a thousand miles begins with a single step. " * 30)
    runs = {}
    with Model(gguf) as model:
        toks = model.tokenize(text)[:700]
        for mode in ("1", "0"):
            monkeypatch.setenv("LLAMA_POLYKV_PACK_INPUTS", mode)
            mark = _native.log_mark()
            model.set_plan(uniform_plan(model.n_layer, "snapkv", 128))
            with model.context(n_ctx=1024, n_ubatch=256, type_k="f32", type_v="f32") as ctx:
                said = packed_since(mark)
                ctx.decode(toks[:-4])
                logits = [ctx.logits()]
                for t in toks[-4:]:
                    ctx.decode([t])
                    logits.append(ctx.logits())
                kept = [ctx.kept_positions(il) for il in range(model.n_layer)]
            runs[mode] = (np.array(logits), kept, said)
    assert runs["1"][2] and not runs["0"][2]
    assert runs["1"][1] == runs["0"][1]
    np.testing.assert_array_equal(runs["1"][0], runs["0"][0])


def test_graph_inputs_script_counts_the_copies(path, tmp_path):
    """scripts/graph_inputs.py reads the scheduler's count: every group's index and mask inputs unpacked, one
    per type packed, fewer than FullKV's (which has its own index and mask inputs)."""
    import subprocess
    import sys
    from pathlib import Path

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(every_kind_plan().to_json())
    md = tmp_path / "inputs.md"
    script = Path(__file__).resolve().parent.parent / "scripts" / "graph_inputs.py"
    r = subprocess.run([sys.executable, str(script), "--model", str(path), "--plan", str(plan_file), "--ctx", "512",
                        "--ubatch", "64", "--md", str(md)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split("|") for line in md.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    # the decode graph's count (the last of "prompt / decode")
    inputs = {(cells[1].strip(), cells[2].strip()): int(cells[5].split("/")[-1]) for cells in rows[1:]}
    fullkv = inputs[("FullKV", "-")]
    unpacked = inputs[("plan.json", "one per group")]
    packed = inputs[("plan.json", "packed")]
    # 4 groups, each with k and v indices and a mask (the adaptive one a second, owner mask): 13 more than the
    # tokens, positions and output rows FullKV has besides its own 3
    assert unpacked - (fullkv - 3) == 4 * 3 + 1
    assert packed == fullkv - 3 + 2  # one index input (I64) and one mask input (F16)
