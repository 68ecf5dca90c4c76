"""Tests of the plan format v1 (polykv_cpp/plan.py): round trips, GGUF copy, validation, scaling, constructors."""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from polykv_cpp import plan as P  # noqa: E402
from polykv_cpp.errors import PlanError  # noqa: E402


# ----------------------------------------------------------------------------------------- fixtures


def mixed_plan(n_layer: int = 6, budget_avg: int = 64, b_min: int = 16) -> P.Plan:
    """A sensitivity-style plan: different patterns and budgets per layer, exact totals, one FullKV layer."""
    full_charge = 128
    pats = ["streamingllm", "h2o", "snapkv", "tova", "knorm", "fullkv"]
    # prefill: layer 5 is FullKV; the other 5 layers share n*avg - 128 = 256 tokens
    pre_budgets = [16, 40, 90, 50, 60]
    assert sum(pre_budgets) + full_charge == n_layer * budget_avg
    dec_budgets = [16, 32, 100, 80, 60, 96]  # decode: no FullKV, sums to 384
    assert sum(dec_budgets) == n_layer * budget_avg
    layers = []
    for i in range(n_layer):
        pat = pats[i]
        pre = P.PhasePlan(pat) if pat == "fullkv" else P.PhasePlan(pat, budget=pre_budgets[i], n_sink=4, window=8)
        if pat == "snapkv":
            pre.obs_window, pre.pool_kernel = 8, 5
        dec = P.PhasePlan("streamingllm", budget=dec_budgets[i], n_sink=4, window=None)
        layers.append(P.LayerPlan(i, pre, dec))
    prov = P.Provenance(model=P.ModelInfo(arch="qwen2", n_layer=n_layer, n_head=4, n_head_kv=2, head_dim=16,
                                          n_vocab=100, name="tiny"),
                        calibration={"description": "unit test", "n_texts": 3}, signals=["cosine", "entropy"],
                        date="2026-01-01T00:00:00+00:00", tool_version="polykv-cpp test", extra={"k": [1, 2]})
    return P.Plan(version=1, n_layer=n_layer, budget_avg=budget_avg, b_min=b_min, budget_rule="sensitivity",
                  layers=layers, provenance=prov, exact_total=True, full_charge=full_charge)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_small_gguf(path: Path, n_layer: int = 6, alignment: int | None = None, extra_kv=None) -> dict:
    """A small GGUF with many metadata types and F32/F16/I32/Q8_0 tensors. Returns the tensors' bytes."""
    w = gguf.GGUFWriter(path, arch="qwen2")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_name("tiny")
    w.add_uint32("qwen2.block_count", n_layer)
    w.add_uint32("qwen2.embedding_length", 64)
    w.add_uint32("qwen2.attention.head_count", 4)
    w.add_uint32("qwen2.attention.head_count_kv", 2)
    w.add_float32("qwen2.rope.freq_base", 1000000.0)
    w.add_float64("test.f64", 1.0 / 3.0)
    w.add_int8("test.i8", -5)
    w.add_uint16("test.u16", 65535)
    w.add_int64("test.i64", -(2 ** 40))
    w.add_uint64("test.u64", 2 ** 63 + 5)
    w.add_bool("test.flag", True)
    w.add_string("test.unicode", "Grüße, 世界 \u2603")
    w.add_key_value("tokenizer.ggml.tokens", ["<s>", "a", "ä", "b c"], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.scores", [0.0, -1.5, 2.25, 3.0], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.FLOAT32)
    w.add_key_value("tokenizer.ggml.token_type", [1, 2, 3, 1], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.INT32)
    for k, (v, t) in (extra_kv or {}).items():
        w.add_key_value(k, v, t)
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": rng.standard_normal((4, 64)).astype(np.float32),
        "output_norm.weight": rng.standard_normal(64).astype(np.float16),
        "pos.ids": np.arange(7, dtype=np.int32),
    }
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    # a quantized-typed tensor: Q8_0, 2 rows of 64 elements = 2 blocks of 34 bytes per row
    q8 = rng.integers(0, 256, size=(2, 68), dtype=np.uint8)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = {k: v.tobytes() for k, v in tensors.items()}
    out["blk.0.attn_q.weight"] = q8.tobytes()
    return out


def metadata(reader) -> dict:
    """All metadata except GGUF.* virtual fields, as (types, contents), in file order."""
    return {k: (list(f.types), f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


# ----------------------------------------------------------------------------------------- round trips


def test_dict_and_json_round_trip():
    p = mixed_plan().validate()
    d = p.to_dict()
    assert d["version"] == 1 and d["format"] == "polykv-plan"
    assert d["layers"][5]["prefill"] == {"pattern": "fullkv", "budget": "full"}
    assert P.Plan.from_dict(d) == p
    text = p.to_json()
    assert json.loads(text) == d
    assert P.Plan.from_json(text) == p
    assert P.Plan.from_json(p.to_json(indent=None)) == p
    # the JSON is plain data: a deep copy through json keeps equality, and a change is noticed
    d2 = json.loads(text)
    d2["layers"][1]["prefill"]["budget"] += 1
    assert P.Plan.from_dict(d2) != p


def test_prefill_slack_round_trips_rescales_and_is_checked():
    from dataclasses import replace

    p = replace(P.uniform_plan(4, "snapkv", 64), prefill_slack=2)
    assert "prefill_slack" not in mixed_plan().to_dict()  # plans without it are unchanged
    assert P.Plan.from_json(p.to_json()).prefill_slack == 2
    assert p.scaled(32).prefill_slack == 2 and "prefill slack 2" in p.summary()
    for bad in (0.5, 0, -1, 1e7, float("inf"), float("nan"), True, "2", None):
        d = p.to_dict()
        d["prefill_slack"] = bad  # null too: a plan without a slack leaves the key out
        with pytest.raises(P.PlanError, match="prefill_slack"):
            P.Plan.from_dict(d)
        if bad is not None:
            with pytest.raises(P.PlanError, match="prefill_slack"):
                replace(p, prefill_slack=bad).validate()


def test_share_plan_round_trip_and_resolution():
    n, avg, b_min = 4, 100, 10
    shares = [0.1, 0.2, 0.3, 0.4]
    layers = [P.LayerPlan(i, P.PhasePlan("h2o", share=s, window=4), P.PhasePlan("tova", share=0.25, window=1))
              for i, s in enumerate(shares)]
    p = P.Plan(1, n, avg, b_min, "sensitivity", layers).validate()
    assert P.Plan.from_json(p.to_json()) == p
    # b = b_min + (400 - 40) * share, exact
    assert p.token_budgets("prefill") == [46, 82, 118, 154]
    assert sum(p.token_budgets("decode")) == 400
    assert p.resolved_budgets("prefill", 100) == [46, 82, 100, 100]


def test_load_json_sidecar_and_errors(tmp_path):
    p = mixed_plan()
    f = tmp_path / "plan.json"
    f.write_text(p.to_json())
    assert P.load(f) == p
    with pytest.raises(PlanError, match="not found"):
        P.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        P.load(bad)
    with pytest.raises(PlanError, match="directory"):
        P.load(tmp_path)
    with pytest.raises(PlanError, match="6 layers but the model has 7"):
        P.load(f, n_layer=7)


# ----------------------------------------------------------------------------------------- GGUF


def test_write_gguf_copies_everything_and_adds_plan(tmp_path):
    src = tmp_path / "model.gguf"
    tensor_bytes = write_small_gguf(src)
    before = sha(src)
    plan = mixed_plan()
    dst = tmp_path / "out" / "model-plan.gguf"
    assert P.write_gguf(src, dst, plan) == dst
    assert sha(src) == before, "the source model must not change"

    r_src, r_dst = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    m_src, m_dst = metadata(r_src), metadata(r_dst)
    plan_types = m_dst.pop("polykv.plan")[0]
    ver_types, ver = m_dst.pop("polykv.version")
    assert plan_types == [gguf.GGUFValueType.STRING]
    assert ver_types == [gguf.GGUFValueType.UINT32] and ver == 1
    assert m_dst == m_src  # every original key, same type, same value
    assert list(m_dst) == list(m_src)  # same order
    assert r_dst.alignment == r_src.alignment
    assert [t.name for t in r_dst.tensors] == [t.name for t in r_src.tensors]
    for a, b in zip(r_src.tensors, r_dst.tensors):
        assert a.tensor_type == b.tensor_type
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.tobytes() == b.data.tobytes() == tensor_bytes[a.name]
        assert b.data_offset % r_dst.alignment == 0
    assert {t.tensor_type for t in r_dst.tensors} >= {gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16}

    assert P.read_gguf(dst) == plan
    assert P.load(dst) == plan
    assert P.read_gguf(src) is None
    with pytest.raises(PlanError, match="without a PolyKV plan"):
        P.load(src)


def test_write_gguf_custom_alignment_and_replaces_old_keys(tmp_path):
    src = tmp_path / "model.gguf"
    write_small_gguf(src, alignment=64, extra_kv={"polykv.stale": ("old", gguf.GGUFValueType.STRING)})
    first = tmp_path / "a.gguf"
    P.write_gguf(src, first, mixed_plan())
    second_plan = P.uniform_plan(6, "h2o", 48)
    second = tmp_path / "b.gguf"
    P.write_gguf(first, second, second_plan)
    r = gguf.GGUFReader(second)
    assert r.alignment == 64
    assert all(t.data_offset % 64 == 0 for t in r.tensors)
    keys = [k for k in r.fields if k.startswith("polykv.")]
    assert sorted(keys) == ["polykv.plan", "polykv.version"]  # stale key and the old plan are gone
    assert P.read_gguf(second) == second_plan
    assert P.read_gguf(first) != second_plan


def test_gguf_holds_a_query_agnostic_plan_beside_the_plan(tmp_path):
    src = tmp_path / "model.gguf"
    write_small_gguf(src)
    before = sha(src)
    main, qag = mixed_plan(), P.uniform_plan(6, "kvzip", 48, selection="head", allocation="prompt", b_min=4)
    both = P.write_gguf(src, tmp_path / "both.gguf", main, query_agnostic_plan=qag)
    assert sha(src) == before
    assert P.read_gguf(both) == main and P.load(both) == main  # every other path reads polykv.plan
    assert P.read_gguf(both, key=P.GGUF_KEY_PLAN_QUERY_AGNOSTIC) == qag
    meta = P.read_gguf_metadata(both)
    assert P.gguf_plan_key(meta, "query-agnostic") == P.GGUF_KEY_PLAN_QUERY_AGNOSTIC
    assert P.gguf_plan_key(meta, "query-aware") == P.GGUF_KEY_PLAN
    assert P.gguf_plan_key(P.read_gguf_metadata(src), "query-agnostic") is None
    with pytest.raises(PlanError, match="protocol must be one of"):
        P.gguf_plan_key(meta, "both")

    # replacing one protocol's plan keeps the other's
    new_main = P.uniform_plan(6, "h2o", 40)
    a = P.embed_plans(both, tmp_path / "a.gguf", plan=new_main)
    assert P.read_gguf(a) == new_main and P.read_gguf(a, key=P.GGUF_KEY_PLAN_QUERY_AGNOSTIC) == qag
    new_qag = P.uniform_plan(6, "streamingllm", 40)
    b = P.embed_plans(a, tmp_path / "b.gguf", query_agnostic_plan=new_qag)
    assert P.read_gguf(b) == new_main and P.read_gguf(b, key=P.GGUF_KEY_PLAN_QUERY_AGNOSTIC) == new_qag
    # the query-agnostic plan of a model without any plan is its only plan, the one stock tools read
    c = P.embed_plans(src, tmp_path / "c.gguf", query_agnostic_plan=new_qag)
    assert P.read_gguf(c) == new_qag and P.read_gguf(c, key=P.GGUF_KEY_PLAN_QUERY_AGNOSTIC) is None
    assert P.gguf_plan_key(P.read_gguf_metadata(c), "query-agnostic") == P.GGUF_KEY_PLAN
    with pytest.raises(PlanError, match="nothing to write"):
        P.embed_plans(src, tmp_path / "d.gguf")
    # a query-agnostic plan that does not fit the model is refused like the plan, and nothing is left
    with pytest.raises(PlanError, match="the query-agnostic plan: the plan is for 4 layers but the model"):
        P.write_gguf(src, tmp_path / "e.gguf", main, query_agnostic_plan=P.uniform_plan(4, "h2o", 40).validate())
    assert not (tmp_path / "e.gguf").exists()


def test_plan_write_and_validate_cli(tmp_path, capsys):
    src = tmp_path / "model.gguf"
    write_small_gguf(src)
    main_f, qag_f = tmp_path / "main.json", tmp_path / "qag.json"
    main_f.write_text(mixed_plan().to_json())
    qag_f.write_text(P.uniform_plan(6, "kvzip", 40, selection="head").to_json())
    ap = argparse.ArgumentParser()
    P.register_cli(ap.add_subparsers())
    out = tmp_path / "out.gguf"
    args = ap.parse_args(["plan", "write", str(src), str(out), "--plan", str(main_f), "--query-agnostic-plan",
                          str(qag_f), "-q"])
    assert args.func(args) == 0
    assert P.read_gguf(out, key=P.GGUF_KEY_PLAN_QUERY_AGNOSTIC) == P.load(qag_f)
    args = ap.parse_args(["plan", "validate", str(out)])
    capsys.readouterr()
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "OK: " in text and f"OK ({P.GGUF_KEY_PLAN_QUERY_AGNOSTIC}): " in text and "kvzip" in text
    from polykv_cpp import plan_view

    plan_view.register_cli(None)
    for extra, want, other in (([], "knorm", "kvzip"), (["--query-agnostic"], "kvzip", "knorm")):
        args = ap.parse_args(["plan", "show", str(out), "--no-signals", *extra])
        assert args.func(args) == 0
        text = capsys.readouterr().out
        assert want in text and other not in text
    args = ap.parse_args(["plan", "show", str(src), "--query-agnostic"])
    with pytest.raises(PlanError, match="holds no polykv.plan_query_agnostic plan"):
        args.func(args)
    args = ap.parse_args(["plan", "write", str(src), str(src), "--plan", str(main_f), "-q"])
    with pytest.raises(PlanError, match="refusing to overwrite the source"):
        args.func(args)


def test_write_gguf_refuses_source_as_destination(tmp_path):
    src = tmp_path / "model.gguf"
    write_small_gguf(src)
    before = sha(src)
    for dst in (src, tmp_path / "sub" / ".." / "model.gguf"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(PlanError, match="refusing to overwrite the source"):
            P.write_gguf(src, dst, mixed_plan())
    link = tmp_path / "hardlink.gguf"
    os.link(src, link)
    with pytest.raises(PlanError, match="refusing to overwrite the source"):
        P.write_gguf(src, link, mixed_plan())
    assert sha(src) == before


def test_write_gguf_rejects_mismatched_model_and_leaves_nothing(tmp_path):
    src = tmp_path / "model.gguf"
    write_small_gguf(src, n_layer=4)
    dst = tmp_path / "out.gguf"
    with pytest.raises(PlanError, match="6 layers but the model"):
        P.write_gguf(src, dst, mixed_plan())
    other = mixed_plan()
    other.provenance.model.n_head_kv = 4  # model has 2
    src6 = tmp_path / "model6.gguf"
    write_small_gguf(src6, n_layer=6)
    with pytest.raises(PlanError, match="n_head_kv"):
        P.write_gguf(src6, dst, other)
    with pytest.raises(PlanError, match="not found"):
        P.write_gguf(tmp_path / "nope.gguf", dst, mixed_plan())
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"hello world")
    with pytest.raises(PlanError, match="not a GGUF"):
        P.write_gguf(notgguf, dst, mixed_plan())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "model6.gguf", "x.gguf"]


def test_read_gguf_rejects_bad_polykv_keys(tmp_path):
    f = tmp_path / "m.gguf"
    write_small_gguf(f, extra_kv={"polykv.plan": ("{broken", gguf.GGUFValueType.STRING),
                                  "polykv.version": (1, gguf.GGUFValueType.UINT32)})
    with pytest.raises(PlanError, match="not valid JSON"):
        P.read_gguf(f)
    g = tmp_path / "v2.gguf"
    write_small_gguf(g, extra_kv={"polykv.plan": (mixed_plan().to_json(), gguf.GGUFValueType.STRING),
                                  "polykv.version": (2, gguf.GGUFValueType.UINT32)})
    with pytest.raises(PlanError, match="polykv.version is 2"):
        P.read_gguf(g)


def test_model_info_from_gguf(tmp_path):
    f = tmp_path / "m.gguf"
    write_small_gguf(f)
    info = P.ModelInfo.from_gguf(f)
    assert info == P.ModelInfo(arch="qwen2", n_layer=6, n_head=4, n_head_kv=2, head_dim=16, n_vocab=4, name="tiny")
    md = P.read_gguf_metadata(f)
    assert md["test.unicode"] == "Grüße, 世界 \u2603"
    assert md["test.u64"] == 2 ** 63 + 5 and md["test.i8"] == -5 and md["test.flag"] is True
    assert md["tokenizer.ggml.tokens"].length == 4


# ----------------------------------------------------------------------------------------- validation


def _bad(mutate, match, n_layer=None):
    p = mixed_plan()
    mutate(p)
    with pytest.raises(PlanError, match=match):
        p.validate(n_layer)


def test_valid_plan_passes():
    assert mixed_plan().validate(6) is not None


def test_validation_errors():
    _bad(lambda p: setattr(p.layers[2].prefill, "pattern", "magic"), r"layer 2 prefill: unknown pattern 'magic'")
    _bad(lambda p: setattr(p.layers[1].prefill, "pattern", "H2O"), r"layer 1 prefill: unknown pattern 'H2O'")
    _bad(lambda p: None, r"plan is for 6 layers but the model has 5", n_layer=5)
    _bad(lambda p: p.layers.pop(), r"lists 5 layers but n_layer is 6")
    _bad(lambda p: setattr(p.layers[3], "layer", 4), r"layer entry 3 has index 4")
    _bad(lambda p: setattr(p, "version", 2), r"version")

    def zero(p):
        p.layers[1].prefill.budget = 0
    _bad(zero, r"layer 1 prefill: budget 0 must be positive")

    def negative(p):
        p.layers[3].decode.budget = -8
    _bad(negative, r"layer 3 decode: budget -8 must be positive")

    def below_min(p):  # keep the total exact so that only b_min is violated
        p.layers[1].prefill.budget -= 30  # 40 -> 10 < b_min 16
        p.layers[2].prefill.budget += 30
    _bad(below_min, r"layer 1 prefill: budget 10 is below b_min 16")

    def wrong_sum(p):
        p.layers[2].prefill.budget += 1
    _bad(wrong_sum, r"prefill: budgets sum to 257 \+ 1 FullKV layers x 128 = 385, expected n_layer\*budget_avg = 384")

    def wrong_sum_decode(p):
        p.layers[0].decode.budget += 5
    _bad(wrong_sum_decode, r"decode: budgets sum to 389.*expected .* 384")

    def window_too_big(p):
        p.layers[1].prefill.window = 37  # n_sink 4 + 37 > 40
    _bad(window_too_big, r"layer 1 prefill: n_sink \+ window = 41 exceeds the budget 40")

    def obs_too_big(p):
        p.layers[2].prefill.obs_window = 90  # snapkv budget 90, sink 4
    _bad(obs_too_big, r"layer 2 prefill: n_sink \+ max\(window, obs_window\) = 94 exceeds the budget 90")

    def snap_without_obs(p):
        p.layers[2].prefill.obs_window = None
    _bad(snap_without_obs, r"layer 2 prefill: snapkv needs obs_window")

    def even_kernel(p):
        p.layers[2].prefill.pool_kernel = 4
    _bad(even_kernel, r"layer 2 prefill: pool_kernel must be an odd")

    def negative_sink(p):
        p.layers[0].decode.n_sink = -1
    _bad(negative_sink, r"layer 0 decode: n_sink must be an integer >= 0")

    def full_with_budget(p):
        p.layers[5].prefill.budget = 128
    _bad(full_with_budget, r"layer 5 prefill: a fullkv layer keeps everything")

    def missing_budget(p):
        p.layers[4].decode.budget = None
    _bad(missing_budget, r"layer 4 decode: streamingllm needs a budget")

    def both(p):
        p.layers[4].decode.share = 0.5
    _bad(both, r"layer 4 decode: give a budget or a share, not both")

    def no_charge(p):
        p.full_charge = None
    _bad(no_charge, r"prefill: the plan has FullKV layers but no full_charge")

    def bmin_too_big(p):
        p.b_min = 65
    _bad(bmin_too_big, r"b_min 65 is larger than budget_avg 64")

    def wrong_prov(p):
        p.provenance.model.n_layer = 7
    _bad(wrong_prov, r"provenance says the model has 7 layers")


def test_exact_total_can_be_switched_off():
    p = mixed_plan()
    p.layers[2].prefill.budget += 1
    with pytest.raises(PlanError):
        p.validate()
    p.exact_total = False
    p.validate()


def test_share_validation_errors():
    def share_plan(shares, b_min=10):
        layers = [P.LayerPlan(i, P.PhasePlan("h2o", share=s, window=4), P.PhasePlan("h2o", budget=100, window=4))
                  for i, s in enumerate(shares)]
        return P.Plan(1, len(shares), 100, b_min, "sensitivity", layers)

    share_plan([0.5, 0.5]).validate()
    with pytest.raises(PlanError, match="prefill: shares sum to 0.9"):
        share_plan([0.5, 0.4]).validate()
    with pytest.raises(PlanError, match="layer 1 prefill: share must be a finite number >= 0"):
        share_plan([1.5, -0.5]).validate()
    mixed = share_plan([0.5, 0.5])
    mixed.layers[1].prefill = P.PhasePlan("h2o", budget=100, window=4)
    with pytest.raises(PlanError, match="layer 1 prefill: gives a budget while other layers"):
        mixed.validate()
    # share 0 with b_min 0 resolves to a zero budget
    with pytest.raises(PlanError, match="layer 0 prefill: budget 0 must be positive"):
        share_plan([0.0, 1.0], b_min=0).validate()


def test_from_dict_type_errors():
    d = mixed_plan().to_dict()
    cases = [
        (lambda d: d["layers"][1]["prefill"].__setitem__("budget", 40.5), r"layer 1 prefill: budget must be an integer"),
        (lambda d: d["layers"][1]["prefill"].__setitem__("windw", 3), r"layer 1 prefill: unknown field\(s\) windw"),
        (lambda d: d["layers"][1].pop("decode"), r"layer 1: missing 'decode'"),
        (lambda d: d.__setitem__("version", 2), r"unsupported plan format version 2"),
        (lambda d: d.pop("version"), r"no integer 'version'"),
        (lambda d: d.__setitem__("format", "other"), r"not a PolyKV plan"),
        (lambda d: d.pop("budget_avg"), r"missing 'budget_avg'"),
        (lambda d: d.__setitem__("n_layer", "6"), r"'n_layer' must be an integer"),
        (lambda d: d.__setitem__("surprise", 1), r"unknown field\(s\) surprise"),
        (lambda d: d["provenance"].__setitem__("signals", "cosine"), r"signals must be a list"),
    ]
    for mutate, match in cases:
        dd = copy.deepcopy(d)
        mutate(dd)
        with pytest.raises(PlanError, match=match):
            P.Plan.from_dict(dd)
    with pytest.raises(PlanError, match="must be a JSON object"):
        P.Plan.from_json("[1, 2]")
    with pytest.raises(PlanError, match="not valid JSON"):
        P.Plan.from_json('{"version": 1,')


# ----------------------------------------------------------------------------------------- budgets


def test_largest_remainder_exact():
    assert P.largest_remainder([1, 1, 1], 10) == [4, 3, 3]
    assert P.largest_remainder([0.5, 0.25, 0.25], 7) == [3, 2, 2]  # 3.5, 1.75, 1.75
    assert P.largest_remainder([0, 0], 5) == [3, 2]
    assert sum(P.largest_remainder([0.1] * 10, 1001)) == 1001
    assert P.allocate_budgets(100, [1, 3], 10) == [30, 70]
    with pytest.raises(PlanError, match="needs at least"):
        P.allocate_budgets(15, [1, 1], 10)


@pytest.mark.parametrize("key", ["share", "prefill_slack", "allocation_cap"])
def test_integers_beyond_a_floats_range_get_a_plan_error(key):
    """Found by reading the code (session 59): JSON integers have no size limit, and a 400-digit share, prefill
    slack or allocation cap raised OverflowError from float() instead of PlanError (the native parser refuses the
    same number as out of range)."""
    big = "1" + "0" * 400
    phase = '{"pattern": "h2o", "budget": 8}'
    prefill = f'{{"pattern": "h2o", "share": {big}}}' if key == "share" else phase
    top = "" if key == "share" else f'"{key}": {big}, ' + ('"allocation": "prompt", ' if key == "allocation_cap" else "")
    text = (f'{{"version": 1, "n_layer": 1, "budget_avg": 8, "b_min": 1, "budget_rule": "t", {top}'
            f'"layers": [{{"layer": 0, "prefill": {prefill}, "decode": {phase}}}]}}')
    with pytest.raises(PlanError, match=key):
        P.Plan.from_json(text).validate()


def test_scaled_refuses_budgets_beyond_int32():
    """Found by the atheris fuzz (native/fuzz/regressions/budget-beyond-int32), as the native side by libFuzzer: a
    KV budget near 2^31 gave a layer more tokens than int32 holds, a plan that no longer validated."""
    p = P.pyramid_plan(2, 64)
    with pytest.raises(PlanError, match=r"more than a cache can index \(2\^31 - 1\)"):
        p.scaled(2**31 - 1)
    assert p.scaled(2**30 - 64).validate().budget_avg == 2**30 - 64


def test_scaled_exact_totals_and_b_min():
    p = mixed_plan()
    for n in (35, 40, 64, 100, 513):
        q = p.scaled(n)
        q.validate()
        assert q.budget_avg == n and q.b_min == p.b_min and q.exact_total
        pre = q.token_budgets("prefill")
        assert pre[5] is None  # FullKV stays FullKV
        assert sum(b for b in pre if b is not None) + q.full_charge == 6 * n
        assert sum(q.token_budgets("decode")) == 6 * n
        assert all(b >= p.b_min for b in pre if b is not None)
        assert q.patterns("prefill") == p.patterns("prefill")
        assert q.provenance.extra["scaled_from_budget_avg"] == 64
    # the part above b_min keeps its proportions: decode excess 0,16,84,64,44,80 (sum 288) -> at avg 112: 576
    q = p.scaled(112)
    assert q.token_budgets("decode") == [16, 48, 184, 144, 104, 176]
    for phase in ("prefill", "decode"):  # scaling to its own budget changes nothing
        assert p.scaled(64).token_budgets(phase) == p.token_budgets(phase)
    # windows shrink to fit small budgets
    u = P.uniform_plan(4, "snapkv", 256, n_sink=2, window=40, obs_window=48, b_min=0)
    small = u.scaled(20).validate()
    assert [(lp.prefill.budget, lp.prefill.window, lp.prefill.obs_window) for lp in small.layers] == [(20, 18, 18)] * 4
    with pytest.raises(PlanError, match="below the plan's b_min"):
        p.scaled(15)
    with pytest.raises(PlanError, match="too small for prefill"):
        p.scaled(20)  # 120 - 128 (FullKV charge) < 5 * 16
    assert sum(b for b in p.scaled(40, full_charge=40).token_budgets("prefill") if b) == 6 * 40 - 40


def test_caps_give_what_a_layer_cannot_hold_to_the_others():
    # 3 sliding-window layers (cap 512) and 1 global layer, equal weights, 4 x 1024 tokens
    assert P.allocate_budgets(4096, [1, 1, 1, 1], 128, caps=[512, 512, None, 512]) == [512, 512, 2560, 512]
    # caps that do not bind change nothing; a cap below b_min gives b_min
    assert P.allocate_budgets(1000, [1, 3], 10, caps=[900, None]) == P.allocate_budgets(1000, [1, 3], 10)
    assert P.allocate_budgets(100, [1, 1], 30, caps=[20, None]) == [30, 70]
    # capping one layer can push another over its cap: repeated until none passes
    assert P.allocate_budgets(900, [10, 1, 1], 0, caps=[100, 150, None]) == [100, 150, 650]
    # every layer capped: the sum falls short of the total (nothing can hold the rest)
    assert P.allocate_budgets(900, [1, 1], 0, caps=[100, 200]) == [100, 200]
    with pytest.raises(PlanError, match="caps for"):
        P.allocate_budgets(900, [1, 1], 0, caps=[100])
    u = P.uniform_plan(4, "snapkv", 512)
    q = u.scaled(1024, caps=[512, 512, None, 512]).validate()
    assert q.token_budgets("prefill") == q.token_budgets("decode") == [512, 512, 2560, 512] and q.exact_total
    assert u.scaled(1024, caps=[None] * 4) == u.scaled(1024)
    short = u.scaled(1024, caps=[512] * 4).validate()
    assert short.token_budgets("prefill") == [512] * 4 and not short.exact_total
    with pytest.raises(PlanError, match="caps for a plan of 4 layers"):
        u.scaled(1024, caps=[512])


def test_resolved_budgets():
    p = mixed_plan()
    assert p.resolved_budgets("prefill", 1000) == [16, 40, 90, 50, 60, 1000]
    assert p.resolved_budgets("prefill", 45) == [16, 40, 45, 45, 45, 45]
    assert p.resolved_budgets("decode", 2048) == [16, 32, 100, 80, 60, 96]
    with pytest.raises(PlanError, match="unknown phase"):
        p.resolved_budgets("generate", 10)
    with pytest.raises(PlanError, match="n_ctx must be a positive integer"):
        p.resolved_budgets("prefill", 0)


# ----------------------------------------------------------------------------------------- constructors


def test_uniform_plan():
    p = P.uniform_plan(8, "snapkv", 256, n_sink=4)
    assert p.budget_rule == "uniform" and p.n_layer == 8 and p.budget_avg == 256
    assert all(lp.prefill == P.PhasePlan("snapkv", budget=256, n_sink=4, window=32, obs_window=32, pool_kernel=7)
               for lp in p.layers)
    assert p.b_min == 36
    assert p.scaled(64).token_budgets("prefill") == [64] * 8  # stays uniform
    s = P.uniform_plan(4, "StreamingLLM", 128)
    assert s.patterns("decode") == ["streamingllm"] * 4 and s.layers[0].prefill.n_sink == 4
    d = P.uniform_plan(4, "h2o", 128, decode_pattern="fullkv")
    assert d.patterns("decode") == ["fullkv"] * 4 and d.resolved_budgets("decode", 999) == [999] * 4
    f = P.uniform_plan(3, "fullkv", 4096)
    assert f.full_charge == 4096 and f.resolved_budgets("prefill", 100) == [100] * 3
    with pytest.raises(PlanError, match="unknown pattern"):
        P.uniform_plan(4, "lru", 128)
    with pytest.raises(PlanError, match="exceeds the budget"):
        P.uniform_plan(4, "h2o", 16, window=32)
    with pytest.raises(PlanError, match="unknown pattern parameter"):
        P.uniform_plan(4, "h2o", 128, recent=3)


def test_pyramid_plan_matches_kvcache_factory_line():
    n, B, w, beta = 24, 512, 32, 20
    p = P.pyramid_plan(n, B, window=w, beta=beta)
    b = p.token_budgets("prefill")
    assert sum(b) == n * B
    assert b == sorted(b, reverse=True) and b[0] > b[-1]
    lo = (B - w) / beta
    hi = 2 * (B - w) - lo
    for i, x in enumerate(b):  # within rounding of KVCache-Factory's line
        assert abs(x - (w + hi - (hi - lo) * i / (n - 1))) < 1
    assert b[0] == 968 and b[-1] == 56
    assert p.b_min == w and p.budget_rule == "pyramid" and p.patterns("prefill") == ["pyramidkv"] * n
    p.validate(24)
    # scaling a pyramid gives the pyramid of the new budget
    assert p.scaled(128).token_budgets("prefill") == P.pyramid_plan(n, 128, window=w).token_budgets("prefill")
    one = P.pyramid_plan(1, 100)
    assert one.token_budgets("prefill") == [100]
    with pytest.raises(PlanError, match="must exceed the always-kept tokens"):
        P.pyramid_plan(4, 32)


# ----------------------------------------------------------------------------------------- CLI


def make_parser():
    parser = argparse.ArgumentParser(prog="polykv")
    sub = parser.add_subparsers(dest="cmd")
    P.register_cli(sub)
    return parser


def test_cli_validate(tmp_path, capsys):
    parser = make_parser()
    assert P.PLAN_SUBPARSERS is not None
    f = tmp_path / "p.json"
    f.write_text(mixed_plan().to_json())
    args = parser.parse_args(["plan", "validate", str(f)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: plan v1: 6 layers, budget_avg 64, b_min 16, rule sensitivity")
    args = parser.parse_args(["plan", "validate", str(f), "--n-layer", "7"])
    with pytest.raises(PlanError, match="6 layers but the model has 7"):
        args.func(args)
    g = tmp_path / "m.gguf"
    write_small_gguf(g, n_layer=6)
    out_g = tmp_path / "m-plan.gguf"
    P.write_gguf(g, out_g, mixed_plan())
    args = parser.parse_args(["plan", "validate", str(out_g)])
    assert args.func(args) == 0
    # another module can add a sub-command to `plan`
    show = P.PLAN_SUBPARSERS.add_parser("show")
    show.set_defaults(func=lambda a: 0)
    assert parser.parse_args(["plan", "show"]).func is not None


SHIPPED_PLAN_LAYERS = {"qwen2.5-coder-0.5b-instruct-q4_k_m": 24, "gemma-3-270m-q4_k_m": 18}


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "plans").glob("*.json")),
                         ids=lambda p: p.name)
def test_shipped_plans_validate_for_the_model_they_name(path):
    """Every plan file in plans/ loads and validates, is named after a packaged model and has that model's layer
    count, one entry per layer in order, and rescales to half its budget."""
    model = next((m for m in SHIPPED_PLAN_LAYERS if path.name.startswith(m + ".")), None)
    assert model is not None, f"{path.name} names no packaged model"
    plan = P.load(path)
    assert plan.n_layer == SHIPPED_PLAN_LAYERS[model]
    assert [lp.layer for lp in plan.layers] == list(range(plan.n_layer))
    half = plan.scaled(max(plan.budget_avg // 2, plan.b_min))
    half.validate(SHIPPED_PLAN_LAYERS[model])
    assert half.budget_avg == max(plan.budget_avg // 2, plan.b_min)
    for ph in ("prefill", "decode"):
        budgets = [b for b in half.token_budgets(ph) if b is not None]
        assert all(b >= 1 for b in budgets)


def test_a_lower_floor_keeps_the_budgets_and_their_proportions_below_the_old_floor():
    """Plan.with_floor: the same budgets at budget_avg; rescaled, b_min plus the proportions of what lies above it,
    worked out by hand; at the old floor the old plan is flat and the new one is not."""
    plan = P.uniform_plan(4, "snapkv", 128).span_split([64, None, 64, None], 1024)   # [43, 213, 43, 213], b_min 32
    low = plan.with_floor(8)
    assert low.b_min == 8
    for ph in ("prefill", "decode"):
        assert low.token_budgets(ph) == plan.token_budgets(ph)
        assert [pp.share for pp in low.phase_plans(ph)] == pytest.approx([35 / 480, 205 / 480] * 2)
    assert plan.scaled(32).token_budgets("prefill") == [32, 32, 32, 32]
    # 4 x 32 tokens: 4 x 8, and 96 split 35 : 205 -> 7 / 41 by largest remainder
    assert low.scaled(32).token_budgets("prefill") == [15, 49, 15, 49]
    assert P.Plan.from_json(low.to_json()).validate(n_layer=4).token_budgets("decode") == plan.token_budgets("decode")
    with pytest.raises(P.PlanError, match="below the new b_min 50"):
        plan.with_floor(50)
    with pytest.raises(P.PlanError, match="b_min must be"):
        plan.with_floor(-1)


def test_span_split_gives_every_layer_the_same_share_of_what_it_attends_to():
    """Plan.span_split: shares in proportion to budget x span (a sliding-window layer's window, else the context);
    rescaled, each layer keeps b_min plus its part of the rest, worked out by hand here."""
    windows = [64, None, 64, None]
    plan = P.uniform_plan(4, "snapkv", 128)
    assert plan.b_min == 32
    split = plan.span_split(windows, 1024)
    assert split.budget_rule == "uniform+span" and split.provenance.extra["span_n_ctx"] == 1024
    for ph in ("prefill", "decode"):
        assert [pp.share for pp in split.phase_plans(ph)] == pytest.approx([64 / 2176, 1024 / 2176] * 2)
        assert all(pp.budget is None for pp in split.phase_plans(ph))
    # 4 x 128 tokens: 4 x b_min, and 384 split 64 : 1024 -> 11.29 and 180.71 -> 11 / 181 by largest remainder
    assert split.token_budgets("prefill") == [43, 213, 43, 213]
    assert split.scaled(256, caps=windows).token_budgets("decode") == [58, 454, 58, 454]
    assert split.scaled(600, caps=windows).token_budgets("decode") == [64, 1136, 64, 1136]  # the window caps
    again = P.Plan.from_json(split.to_json()).validate(n_layer=4)
    assert again.token_budgets("prefill") == split.token_budgets("prefill")
    assert plan.span_split([None] * 4, 1024) is plan  # no sliding-window layer: nothing to split
    # a plan's own shape stays: weights are budget x span
    pyr = P.pyramid_plan(4, 128)
    pb = pyr.token_budgets("prefill")
    shares = [pp.share for pp in pyr.span_split(windows, 1024).phase_plans("prefill")]
    assert shares[1] / shares[3] == pytest.approx(pb[1] / pb[3])
    assert shares[0] / shares[1] == pytest.approx(pb[0] * 64 / (pb[1] * 1024))
    with pytest.raises(P.PlanError, match="3 windows"):
        plan.span_split([64, None, 64], 1024)
    with pytest.raises(P.PlanError, match="n_ctx"):
        plan.span_split(windows, 0)
    assert P.split_span("snapkv@15+4~span") == ("snapkv@15+4", True)
    assert P.split_span("snapkv") == ("snapkv", False)
