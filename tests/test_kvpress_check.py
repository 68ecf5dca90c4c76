"""The kvpress cross-check (polykv_cpp.evaluation.kvpress_check) on a tiny random Qwen2 model and its GGUF twin.

The shared prefill must give, for every press, the cache kvpress's own hooks give; the whole check must replay
an eval run's samples and agree with our runtime where both run the same thing (FullKV on fp32 twins)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import run_cli  # noqa: E402
from tiny_models import TinyConfig, tiny_hf_qwen2, write_qwen2_gguf_from_hf  # noqa: E402

from polykv_cpp.errors import PolyKVError  # noqa: E402
from polykv_cpp.evaluation import kvpress_check as K  # noqa: E402
from polykv_cpp.evaluation.runner import EvalConfig, run_eval  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """A tiny HF Qwen2 checkpoint and its fp32 GGUF twin (the checkpoint with the GGUF's tokenizer, which
    KVzipPress loads)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("kvp")
    model = tiny_hf_qwen2(TinyConfig(n_layer=3), seed=1)
    model.save_pretrained(d / "hf")
    write_qwen2_gguf_from_hf(model, d / "tiny.gguf")
    AutoTokenizer.from_pretrained(str(d), gguf_file="tiny.gguf").save_pretrained(d / "hf")
    return d


def _kvpress_own_cache(model, press, ids):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=torch.tensor([ids]), past_key_values=cache)
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("n_ids,ratio_budget", [(150, 24), (150, 70), (1600, 700)])
def test_shared_prefill_gives_the_cache_of_kvpress_own_hooks(twins, n_ids, ratio_budget):
    from transformers import AutoModelForCausalLM

    sdpa = AutoModelForCausalLM.from_pretrained(twins / "hf", dtype=torch.float32, attn_implementation="sdpa").eval()
    eager = AutoModelForCausalLM.from_pretrained(twins / "hf", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 380, (n_ids,), generator=g).tolist()
    presses = {m: K.make_press(kvpress, m, K.ratio_for(ratio_budget, len(ids))) for m, press in K.PRESS_OF.items()
               if press != K.KVZIP_PRESS}  # replayed after the prefill: test_kvzip_replay_equals_kvpress_own_flow
    shared = K.SharedPrefill(sdpa, presses)
    logits, full = shared.run(ids)
    with torch.no_grad():
        ref_logits = sdpa(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits, ref_logits)  # the presses never change the prefill's own output
    assert [k.shape[2] for k, _ in K.full_layers(full)] == [n_ids] * 3
    # kvpress needs eager attention for ObservedAttentionPress. On the eager model the shared prefill passes it
    # the layer's own attention weights; on SDPA it computes them (equal in layer 0, whose input does not
    # depend on the attention kernel; later layers see SDPA's slightly different hidden states)
    shared_eager = K.SharedPrefill(eager, {m: presses[m] for m in K.NEEDS_ATTENTIONS})
    shared_eager.run(ids)
    for m in K.NEEDS_ATTENTIONS:
        own = _kvpress_own_cache(eager, presses[m], ids)
        torch.testing.assert_close(shared.kept[m][0], own[0])
        shared.kept[m] = shared_eager.kept[m]
    for m, press in presses.items():
        own = _kvpress_own_cache(eager if m in K.NEEDS_ATTENTIONS else sdpa, press, ids)
        got = shared.kept[m]
        for layer, ((k0, v0), (k1, v1)) in enumerate(zip(own, got)):
            assert k1.shape == k0.shape, (m, layer)
            torch.testing.assert_close(k1, k0, msg=f"{m} layer {layer}")
            torch.testing.assert_close(v1, v0, msg=f"{m} layer {layer}")
        if not m.startswith("pyramidkv"):
            assert all(k.shape[2] == ratio_budget for k, _ in got), m
        else:  # PyramidKV: the same average; a pyramid only when budget / beta >= window, else SnapKV's sizes
            sizes = [k.shape[2] for k, _ in got]
            assert abs(sum(sizes) / 3 - ratio_budget) <= 1
            assert (sizes[0] > sizes[-1]) == (ratio_budget / press.beta >= press.window_size)


def test_eager_attention_weights_match_transformers_eager(twins):
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(twins / "hf", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = torch.randint(3, 380, (1, 64), generator=torch.Generator().manual_seed(1))
    seen = {}

    def hook(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        keys = cache.layers[module.layer_idx].keys
        seen["ours"] = K.eager_attention_weights(module, kwargs["hidden_states"], keys, kwargs["position_embeddings"])
        seen["eager"] = output[1]

    from transformers import DynamicCache

    h = eager.model.layers[1].self_attn.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            eager(input_ids=ids, past_key_values=DynamicCache())
    finally:
        h.remove()
    torch.testing.assert_close(seen["ours"], seen["eager"], atol=1e-6, rtol=1e-5)


def test_ratio_for_keeps_exactly_the_budget():
    from kvpress.utils import compute_n_kept

    for n in (33, 100, 511, 4000, 8191):
        for b in (1, 7, 32, 128, 500, 1024):
            r = K.ratio_for(b, n)
            assert compute_n_kept(n, r) == min(b, n) if r else b >= n
            for n_pairs in (n, 2 * n, 24 * 2 * n):  # KVzipPress prunes int(pairs x ratio) of heads x tokens pairs
                r = K.ratio_for(b, n, counts_pruned=True)
                assert n_pairs - int(n_pairs * r) == n_pairs // n * min(b, n)


def test_make_press_uses_our_window_kernel_and_sinks():
    from polykv_cpp.plan import DEFAULT_PARAMS

    s = K.make_press(kvpress, "snapkv", 0.5)
    assert (s.window_size, s.kernel_size) == (DEFAULT_PARAMS["snapkv"]["obs_window"],
                                              DEFAULT_PARAMS["snapkv"]["pool_kernel"])
    assert K.make_press(kvpress, "streamingllm", 0.5).n_sink == DEFAULT_PARAMS["streamingllm"]["n_sink"]
    ea = K.make_press(kvpress, "expected_attention-head", 0.5)
    assert type(ea).__name__ == "ExpectedAttentionPress" and ea.n_sink == DEFAULT_PARAMS["expected_attention"]["n_sink"]
    own = K.make_press(kvpress, "snapkv", 0.5, own_params=True)
    assert (own.window_size, own.kernel_size) == (kvpress.SnapKVPress().window_size, kvpress.SnapKVPress().kernel_size)
    with pytest.raises(K.KVPressCheckError, match="no kvpress press"):
        K.make_press(kvpress, "polykv", 0.5)
    pooled = K.make_press(kvpress, "snapkv-head@23", 0.5)
    assert type(pooled).__name__ == "SnapKVPress" and (pooled.window_size, pooled.kernel_size) == (
        DEFAULT_PARAMS["snapkv"]["obs_window"], 23)
    for bad in ("expected_attention@15", "snapkv@x"):
        with pytest.raises(K.KVPressCheckError, match="no kvpress press"):
            K.make_press(kvpress, bad, 0.5)


@pytest.fixture(scope="module")
def eval_run(twins):
    out = twins / "eval"
    cfg = EvalConfig(model=str(twins / "tiny.gguf"), out_dir=str(out), lengths=[400], budgets=[40],
                     methods=["fullkv", "streamingllm", "snapkv", "h2o", "expected_attention-head"],
                     tasks=["niah_single", "vt"],
                     n_samples=1, ppl=False, n_ubatch=64, n_threads=1, progress=False, png=False)
    run_eval(cfg, log=lambda m: None)
    return out


def test_check_replays_the_eval_samples_and_agrees_on_fullkv(twins, eval_run, tmp_path):
    cfg = K.KVPressCheckConfig(results=str(eval_run), out_dir=str(tmp_path / "kvp"), hf_model=str(twins / "hf"),
                               n_threads=1, progress=False)
    data = K.run_kvpress_check(cfg, log=lambda m: None)
    ours = json.loads((eval_run / "results.json").read_text())
    n_ours = len([r for r in ours["records"] if r["kind"] == "ruler"])
    # every (sample, protocol, method, budget) of the eval run, once
    assert len(data["records"]) == n_ours == 2 * 2 * (1 + 4)
    for r in data["records"]:
        assert r["ours_prediction"] is not None
        if r["method"] == K.FULLKV:
            # the same fp32 weights and token ids: transformers and llama.cpp answer alike without compression
            assert r["same_answer"], (r["prediction"], r["ours_prediction"])
            assert r["kept_per_layer"] == [r["n_compressed"]] * 3
        else:
            assert r["kept_per_layer"] == [40] * 3
        if r["protocol"] == "query-agnostic":
            assert r["n_compressed"] < r["n_prompt"]
        else:
            assert r["n_compressed"] == r["n_prompt"]
    s = data["summary"]["query-aware"]
    assert s[K.FULLKV]["None"]["same_answer"] == 100 and s[K.FULLKV]["None"]["ours"] == s[K.FULLKV]["None"]["kvpress"]
    assert set(s) == {K.FULLKV, "streamingllm", "snapkv", "h2o", "expected_attention-head"}
    out = tmp_path / "kvp"
    md = (out / "results.md").read_text()
    assert "| snapkv | 40 |" in md and "Known differences" in md
    assert all((out / p).read_bytes().startswith(PNG_MAGIC) for p in data["plots"]) and len(data["plots"]) == 2
    assert json.loads((out / "results.json").read_text())["format"] == K.RESULTS_FORMAT


def test_check_refuses_what_the_run_does_not_have(twins, eval_run, tmp_path):
    def check(**kw):
        cfg = K.KVPressCheckConfig(results=str(eval_run), out_dir=str(tmp_path / "x"), hf_model=str(twins / "hf"),
                                   progress=False, **kw)
        K.KVPressCheck(cfg, log=lambda m: None).setup()

    with pytest.raises(K.KVPressCheckError, match="no task results for .*snapkv@128"):
        check(budgets=[128])
    with pytest.raises(K.KVPressCheckError, match="no kvpress press for polykv"):
        check(methods=["polykv"])
    with pytest.raises(K.KVPressCheckError, match="not in the eval run"):
        check(tasks=["cwe"])
    with pytest.raises(K.KVPressCheckError, match="not a finished"):
        K.KVPressCheck(K.KVPressCheckConfig(results=str(tmp_path / "nothing")), log=lambda m: None).setup()
    moved = json.loads((eval_run / "results.json").read_text())
    moved["config"]["model"] = str(tmp_path / "gone.gguf")
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    with pytest.raises(PolyKVError, match="model not found"):
        K.KVPressCheck(K.KVPressCheckConfig(results=str(tmp_path / "moved.json"), hf_model=str(twins / "hf")),
                       log=lambda m: None).setup()


def test_a_stopped_run_replays_the_samples_it_has(twins, eval_run, tmp_path):
    # the run as if it had been asked for 2 samples per task and stopped after the first of each
    stopped = json.loads((eval_run / "results.json").read_text())
    stopped["config"]["n_samples"], stopped["partial"] = 2, True
    (tmp_path / "stopped.json").write_text(json.dumps(stopped))

    def setup(**kw):
        check = K.KVPressCheck(K.KVPressCheckConfig(results=str(tmp_path / "stopped.json"), out_dir=str(tmp_path / "x"),
                                                    hf_model=str(twins / "hf"), progress=False, **kw),
                               log=lambda m: None)
        check.setup()
        return check

    assert sorted(s.key for s in setup().ev.samples) == sorted(s.key for s in setup(samples=1).ev.samples)
    assert {(s.task, s.index) for s in setup().ev.samples} == {("niah_single", 0), ("vt", 0)}
    with pytest.raises(K.KVPressCheckError, match="stopped before sample .*--samples N"):
        setup(samples=2)
    for bad in (0, 3):
        with pytest.raises(K.KVPressCheckError, match=r"--samples must be 1\.\.2"):
            setup(samples=bad)
    stopped["records"] = [r for r in stopped["records"] if r["task"] != "vt"]
    (tmp_path / "stopped.json").write_text(json.dumps(stopped))
    with pytest.raises(K.KVPressCheckError, match="before it had one sample of every task"):
        setup()


def test_a_stopped_check_is_written_and_resumes(twins, eval_run, tmp_path, monkeypatch):
    def cfg(out, **kw):
        return K.KVPressCheckConfig(results=str(eval_run), out_dir=str(out), hf_model=str(twins / "hf"),
                                    methods=["snapkv"], protocols=["query-aware"], n_threads=1, progress=False,
                                    png=False, **kw)

    whole = K.run_kvpress_check(cfg(tmp_path / "whole"), log=lambda m: None)
    assert len(whole["records"]) == 2 * 2 and not whole["partial"]  # 2 samples x (fullkv, snapkv)

    # stopped in the second prefill: the first one's records are on disk, marked partial
    greedy, calls = K.greedy_tokens, []

    def dies_on_third_answer(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return greedy(*a, **kw)

    monkeypatch.setattr(K, "greedy_tokens", dies_on_third_answer)
    with pytest.raises(KeyboardInterrupt):
        K.run_kvpress_check(cfg(tmp_path / "cut"), log=lambda m: None)
    monkeypatch.setattr(K, "greedy_tokens", greedy)
    stopped = json.loads((tmp_path / "cut" / "results.json").read_text())
    assert stopped["partial"] and len(stopped["records"]) == 2 and stopped["n_samples"] == 1
    assert "**Partial**" in (tmp_path / "cut" / "results.md").read_text()

    # resumed: the finished prefill is taken as it is (not re-run), the other one is run
    stopped["records"][0]["prediction"] = "kept from the stopped run"
    (tmp_path / "cut" / "results.json").write_text(json.dumps(stopped))
    logs: list[str] = []
    done = K.run_kvpress_check(cfg(tmp_path / "cut", resume=True), log=logs.append)
    assert any("1 of 2 prefills done" in m for m in logs)
    assert not done["partial"] and done["n_samples"] == 2
    assert done["records"][0]["prediction"] == "kept from the stopped run"

    def key(r):
        return (r["task"], r["index"], r["method"])

    assert sorted(map(key, done["records"])) == sorted(map(key, whole["records"]))
    by_key = {key(r): r for r in whole["records"]}
    for r in done["records"][2:]:
        assert r["prediction"] == by_key[key(r)]["prediction"] and r["kept_per_layer"] == by_key[key(r)]["kept_per_layer"]

    with pytest.raises(K.KVPressCheckError, match="other settings .*budgets"):
        K.run_kvpress_check(K.KVPressCheckConfig(
            results=str(eval_run), out_dir=str(tmp_path / "cut"), hf_model=str(twins / "hf"), methods=["snapkv"],
            budgets=[40, 40], protocols=["query-aware"], progress=False, png=False, resume=True), log=lambda m: None)


def test_cli_kvpress_check(cli_exe, twins, eval_run, tmp_path):
    r = run_cli(cli_exe, "kvpress-check", str(eval_run), "-o", str(tmp_path / "c"), "--hf", str(twins / "hf"),
                "--methods", "snapkv", "--protocol", "query-aware", "--no-progress", "--no-png", "-t", "1")
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "c" / "results.json").read_text())
    assert {r["method"] for r in data["records"]} == {K.FULLKV, "snapkv"}
    assert {r["protocol"] for r in data["records"]} == {"query-aware"}
    bad = run_cli(cli_exe, "kvpress-check", str(tmp_path / "missing"))
    assert bad.returncode == 2 and "not a finished" in bad.stderr and "Traceback" not in bad.stderr


def test_question_after_layers_of_different_lengths(twins):
    """PyramidKV leaves layers of different lengths; the question must still go in (query-agnostic)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(twins / "hf", dtype=torch.float32).eval()
    ids = torch.randint(3, 380, (1600,), generator=torch.Generator().manual_seed(2)).tolist()
    shared = K.SharedPrefill(model, {"pyramidkv": K.make_press(kvpress, "pyramidkv", K.ratio_for(700, 1600))})
    shared.run(ids)
    layers = shared.kept["pyramidkv"]
    assert len({k.shape[2] for k, _ in layers}) == 3
    question = [5, 6, 7, 8, 9]
    toks = list(K.greedy_tokens(model, K.cache_of(layers), len(ids), question=question, max_new_tokens=4,
                                stop=lambda t: False))
    # the same as feeding the question token by token by hand
    cache = K.cache_of(layers)
    with torch.no_grad():
        for i, t in enumerate(question):
            out = model(input_ids=torch.tensor([[t]]), past_key_values=cache,
                        position_ids=torch.tensor([[len(ids) + i]]))
    assert len(toks) == 4 and toks[0] == int(out.logits[0, -1].argmax())


def test_adaptive_methods_map_to_adakvpress():
    ada = K.make_press(kvpress, "adakv", 0.5)
    assert type(ada).__name__ == "AdaKVPress" and type(ada.press).__name__ == "SnapKVPress"
    assert ada.alpha_safeguard == 0.2  # our adaptive floor, budget // 5
    pooled = K.make_press(kvpress, "snapkv-adaptive@23", 0.5)
    assert type(pooled).__name__ == "AdaKVPress" and pooled.press.kernel_size == 23
    assert type(K.make_press(kvpress, "expected_attention-adaptive", 0.5).press).__name__ == "ExpectedAttentionPress"
    for unsupported in ("h2o-adaptive", "pyramidkv-adaptive", "kvzip-adaptive", "streamingllm-adaptive"):
        assert K.press_name(unsupported) is None
        with pytest.raises(K.KVPressCheckError, match="no kvpress press"):
            K.make_press(kvpress, unsupported, 0.5)


def test_adakv_masks_equal_kvpress_own_and_change_the_decode(twins):
    """AdaKVPress masks (head, token) pairs instead of evicting: the shared prefill keeps the masks kvpress's own
    hooks set, and decoding under them equals decoding after kvpress's own prefill (and differs without them)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    sdpa = AutoModelForCausalLM.from_pretrained(twins / "hf", dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(3, 380, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    budget = 40
    press = K.make_press(kvpress, "adakv", K.ratio_for(budget, len(ids)))
    shared = K.SharedPrefill(sdpa, {"adakv": press})
    shared.run(ids)
    assert all(layer.self_attn.masked_key_indices is None for layer in sdpa.model.layers)
    own_cache = DynamicCache()
    with torch.no_grad(), press(sdpa):
        sdpa(input_ids=torch.tensor([ids]), past_key_values=own_cache)
    own = [layer.self_attn.masked_key_indices for layer in sdpa.model.layers]
    n_kv = sdpa.config.num_key_value_heads
    for layer, (a, b) in enumerate(zip(own, shared.masked["adakv"])):
        pairs = {(int(h), int(t)) for h, t in zip(a[1], a[2])}
        assert pairs == {(int(h), int(t)) for h, t in zip(b[1], b[2])}, layer
        assert len(pairs) == n_kv * (len(ids) - budget)
    assert K.kept_per_layer(shared.kept["adakv"], shared.masked["adakv"]) == [budget] * 3
    step = dict(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[len(ids)]]))
    with torch.no_grad():
        own_next = sdpa(past_key_values=own_cache, **step).logits[0, -1]  # kvpress's masks are still on the modules
        with K.head_masks(sdpa, shared.masked["adakv"]):
            ours_next = sdpa(past_key_values=K.cache_of(shared.kept["adakv"]), **step).logits[0, -1]
        unmasked = sdpa(past_key_values=K.cache_of(shared.kept["adakv"]), **step).logits[0, -1]
    torch.testing.assert_close(ours_next, own_next)
    assert not torch.allclose(unmasked, ours_next, atol=1e-4)
    assert all(layer.self_attn.masked_key_indices is None for layer in sdpa.model.layers)


@pytest.mark.parametrize("method", ["kvzip-head", "kvzip-model-wide", "kvzip-plus-model-wide"])
def test_kvzip_replay_equals_kvpress_own_flow(twins, method):
    """KVzipPress runs its reconstruction passes after the prefill: replayed on a copy of the shared prefill's
    FullKV cache it leaves the cache and the masks of kvpress's own ``with press(model): model(ids)``."""
    from transformers import AutoModelForCausalLM, DynamicCache

    sdpa = AutoModelForCausalLM.from_pretrained(twins / "hf", dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(3, 380, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    budget = 40
    press = K.make_press(kvpress, method, K.ratio_for(budget, len(ids), counts_pruned=True))
    assert type(press).__name__ == "KVzipPress" and press.layerwise == (method == "kvzip-head")
    assert press.kvzip_plus_normalization == method.startswith("kvzip-plus")
    shared = K.SharedPrefill(sdpa, {})
    _, full = shared.run(ids)
    kept, masked = K.kvzip_cache(sdpa, press, ids, full)
    assert all(layer.self_attn.masked_key_indices is None for layer in sdpa.model.layers)
    assert all(layer.keys.shape[2] == len(ids) for layer in full.layers)  # the shared cache is left as it was
    own_cache = DynamicCache()
    with torch.no_grad(), press(sdpa):
        sdpa(input_ids=torch.tensor([ids]), past_key_values=own_cache)
    own = [layer.self_attn.masked_key_indices for layer in sdpa.model.layers]
    for layer in sdpa.model.layers:
        layer.self_attn.masked_key_indices = None
    for i, (a, b) in enumerate(zip(own, masked)):
        assert {(int(h), int(t)) for h, t in zip(a[1], a[2])} == {(int(h), int(t)) for h, t in zip(b[1], b[2])}, i
        torch.testing.assert_close(own_cache.layers[i].keys, kept[i][0])
        torch.testing.assert_close(own_cache.layers[i].values, kept[i][1])
    per_layer = K.kept_per_layer(kept, masked)
    assert sum(per_layer) == 3 * budget
    if method == "kvzip-head":
        assert per_layer == [budget] * 3
    else:  # chosen across the layers: this prompt's scores give them different shares
        assert len(set(per_layer)) > 1


def test_check_pairs_a_plan_of_ours_with_another_press(twins, eval_run, tmp_path):
    """``OURS=PRESS_METHOD``: kvpress's KVzip (model-wide) next to our snapkv results, in the same records."""
    cfg = K.KVPressCheckConfig(results=str(eval_run), out_dir=str(tmp_path / "kvz"), hf_model=str(twins / "hf"),
                               methods=["snapkv=kvzip-model-wide"], protocols=["query-aware"], n_threads=1,
                               progress=False, png=False)
    data = K.run_kvpress_check(cfg, log=lambda m: None)
    ours = {(r["task"], r["protocol"]): r for r in json.loads((eval_run / "results.json").read_text())["records"]
            if r["kind"] == "ruler" and r["method"] == "snapkv"}
    paired = [r for r in data["records"] if r["method"] == "snapkv=kvzip-model-wide"]
    assert len(paired) == 2 and data["presses"] == {"snapkv=kvzip-model-wide": "KVzipPress"}
    for r in paired:
        assert r["ours_prediction"] == ours[(r["task"], r["protocol"])]["prediction"]
        assert sum(r["kept_per_layer"]) == 3 * 40
    assert "| snapkv=kvzip-model-wide | 40 |" in (tmp_path / "kvz" / "results.md").read_text()
    for bad, msg in (("polykv=kvzip-model-wide", "no task results for polykv@40"),
                     ("snapkv=kvzip-layer", "no kvpress press")):
        with pytest.raises(K.KVPressCheckError, match=msg):
            K.KVPressCheck(K.KVPressCheckConfig(results=str(eval_run), hf_model=str(twins / "hf"), methods=[bad],
                                                progress=False), log=lambda m: None).setup()


def test_summary_has_paired_intervals_on_the_average_and_per_task():
    recs = []
    scores = {"a": ([1, 1, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0]), "b": ([1, 0, 1, 0, 1, 0], [1, 0, 1, 0, 1, 0])}
    for t, (ours, theirs) in scores.items():
        for i, (o, k) in enumerate(zip(ours, theirs)):
            recs.append({"protocol": "query-aware", "method": "snapkv", "budget": 64, "task": t, "index": i,
                         "score": k, "ours_score": o, "same_answer": o == k})
    c = K.summarize(recs)["query-aware"]["snapkv"]["64"]
    assert c["ours"] - c["kvpress"] == pytest.approx(100 * 5 / 6 / 2)
    lo, hi = c["diff_ci95"]
    assert 0 < lo < c["ours"] - c["kvpress"] < hi  # task a's gap is real on every draw
    assert c["tasks"]["b"]["diff_ci95"] == [0.0, 0.0]  # identical answers: no difference on any draw
    assert c["tasks"]["a"]["diff_ci95"][0] > 0
    lo_o, hi_o = c["ours_ci95"]
    assert lo_o <= c["ours"] <= hi_o
    recs[0]["ours_score"] = None  # a sample our run lacks: no interval rather than a wrong one
    assert "diff_ci95" not in K.summarize(recs)["query-aware"]["snapkv"]["64"]
