"""Per-head caches moved by a graph on their own device equal the host copies.

After an eviction a per-head layer moves each head's kept tokens into its first cells (`repack`). Where the caches
are not in host memory (a GPU, an RPC server) those copies run as one graph of get_rows/set_rows on that device
instead of two transfers per moved token, layer and tensor; ``LLAMA_POLYKV_DEVICE_REPACK=1`` takes the graph on
the CPU too, so here it is checked against the host copies (which test_per_head checks against the numpy
reference): the same kept sets per head and the same logits, bit for bit (F32/F16 rows go through F32 and back
unchanged). Transposed V (flash attention
off) and quantized caches keep the host copies. The RPC test runs the graph on a real non-host device.
"""

import numpy as np
import pytest

from polykv_cpp.api import Model
from tiny_models import TinyConfig, write_tiny_gguf
from test_per_head import decode_recording, head_plan
from test_polykv_native import CFG, P, tokens, twin  # noqa: F401

pytest.importorskip("torch")


def run_counting(path, plan, toks, layer, *, flash_attn="on", prefill="chunked", type_k="f32", type_v="f32"):
    """As test_per_head.run_heads (kept sets of `layer` per head after the prompt and each decode step, logits),
    plus the evictions whose moves ran as a graph."""
    with Model(path) as model:
        model.set_plan(plan, prefill=prefill)
        with model.context(n_ctx=256, n_batch=512, n_ubatch=512, flash_attn=flash_attn, type_k=type_k,
                           type_v=type_v) as ctx:
            ctx.decode(toks[:P])
            kept = [[ctx.kept_positions(layer, h) for h in range(CFG.n_head_kv)] if prefill == "chunked" else None]
            logits = [ctx.logits()]
            steps = decode_recording(ctx, toks[P:], layer)
            n = ctx.device_repacks()
    return kept + steps[0], np.array(logits + steps[1]), n


def run_both(monkeypatch, path, plan, toks, layer, **kw):
    """(kept, logits, graph repacks) with the graph forced, then with the host copies."""
    out = []
    for mode in ("1", "0"):
        monkeypatch.setenv("LLAMA_POLYKV_DEVICE_REPACK", mode)
        out.append(run_counting(path, plan, toks, layer, **kw))
    return out


@pytest.mark.parametrize("type_kv", ["f32", "f16"])
@pytest.mark.parametrize("pattern", ["snapkv", "h2o", "tova"])
def test_graph_moves_equal_host_copies(monkeypatch, twin, tokens, pattern, type_kv):
    _, path = twin
    plan = head_plan(0, pattern)
    (kept_g, logits_g, n_g), (kept_h, logits_h, n_h) = run_both(monkeypatch, path, plan, tokens, 0,
                                                                 type_k=type_kv, type_v=type_kv)
    assert n_g > 0 and n_h == 0
    assert kept_g == kept_h
    np.testing.assert_array_equal(logits_g, logits_h)


@pytest.mark.parametrize("prefill", ["chunked", "exact"])
def test_pooled_adaptive_moves_across_head_slots_equal_host_copies(monkeypatch, twin, tokens, prefill):
    """An adaptive layer (flash attention on) moves a head's token into another head's slot: the graph's rows
    (cell x n_head_kv + slot) match the host copies."""
    _, path = twin
    plan = head_plan(1, "snapkv", selection="adaptive")
    (kept_g, logits_g, n_g), (kept_h, logits_h, n_h) = run_both(monkeypatch, path, plan, tokens, 1, prefill=prefill)
    assert n_g > 0 and n_h == 0
    assert kept_g[1:] == kept_h[1:]
    assert any(len(set(map(len, heads))) > 1 for heads in kept_g[1:])  # the heads held different numbers of tokens
    np.testing.assert_array_equal(logits_g, logits_h)


def test_exact_prefill_moves_many_rows_at_once(monkeypatch, twin, tokens):
    """Exact prefill compresses the whole prompt once: hundreds of rows move in one graph."""
    _, path = twin
    plan = head_plan(1, "snapkv")
    (kept_g, logits_g, n_g), (kept_h, logits_h, n_h) = run_both(monkeypatch, path, plan, tokens, 1, prefill="exact")
    assert n_g > 0 and n_h == 0
    assert kept_g[1:] == kept_h[1:]
    np.testing.assert_array_equal(logits_g, logits_h)


def test_transposed_caches_keep_host_copies(monkeypatch, twin, tokens):
    _, path = twin
    monkeypatch.setenv("LLAMA_POLYKV_DEVICE_REPACK", "1")
    kept, logits, n = run_counting(path, head_plan(0, "snapkv"), tokens, 0, flash_attn="off")
    assert n == 0 and all(len(k) > 0 for heads in kept if heads for k in heads)


def test_quantized_caches_keep_host_copies(monkeypatch, tmp_path, tokens):
    """q8_0 rows would be requantized on the way through F32: the host copies them (a model whose heads hold
    whole q8_0 blocks: 32 dimensions)."""
    path = write_tiny_gguf(tmp_path / "d32.gguf", TinyConfig(n_layer=CFG.n_layer, n_embd=128, n_head=4, n_head_kv=2,
                                                             n_ff=128, n_vocab=CFG.n_vocab), seed=3)
    monkeypatch.setenv("LLAMA_POLYKV_DEVICE_REPACK", "1")
    _, _, n_q = run_counting(str(path), head_plan(0, "snapkv"), tokens, 0, type_k="q8_0", type_v="q8_0")
    _, _, n_f = run_counting(str(path), head_plan(0, "snapkv"), tokens, 0, type_k="f16", type_v="f16")
    assert n_q == 0 and n_f > 0
