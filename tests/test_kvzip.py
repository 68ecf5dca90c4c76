"""KVzip (`kvzip` prefill pattern, `Context.compress_prompt_kvzip`) against the numpy reference.

The reference takes the attention transformers computes on the same weights for each reconstruction sequence
(prompt + repeat instruction + the 8 tokens before the chunk + one chunk of the prompt): the rows of the instruction and the chunk, over the
prompt's keys. The native pass feeds the same tokens after the prompt, chunk by chunk, and removes them again;
the positions each layer (or KV head) keeps after the compression and after each decode step (SnapKV decode)
equal the reference's, and a plan that keeps everything gives the no-plan logits: the pass leaves no trace.
"""

import numpy as np
import pytest

from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.errors import NativeError, PlanError
from polykv_cpp.patterns import pattern_from_phase_plan, simulate, simulate_heads
from test_per_head import decode_recording
from test_polykv_native import B_DECODE, B_PREFILL, CFG, N, P, PHASE_PARAMS, hf_reference, tokens, twin  # noqa: F401

torch = pytest.importorskip("torch")

PREFIX = [5, 6, 7]  # a three-token "repeat" instruction of the tiny vocabulary
CHUNK = 16          # the 40-token prompt is reconstructed in chunks of 16, 16 and 8
OVERLAP = 8         # each chunk after the first starts with the 8 prompt tokens before it


@pytest.fixture(scope="module")
def recon_attn(twin, tokens):
    """Per layer: [n_head, n_recon, P], every chunk's reconstruction queries' attention on the prompt keys."""
    hf, _ = twin
    hf.config._attn_implementation = "eager"
    prompt = tokens[:P]
    rows = {il: [] for il in range(CFG.n_layer)}
    for c0 in range(0, P, CHUNK):
        overlap = prompt[max(0, c0 - OVERLAP):c0]  # a later chunk starts with the tokens before it
        seq = prompt + PREFIX + overlap + prompt[c0:c0 + CHUNK]
        with torch.no_grad():
            out = hf(torch.tensor([seq]), output_attentions=True)
        for il, att in enumerate(out.attentions):
            rows[il].append(att[0, :, P:, :P].double().numpy())
    return {il: np.concatenate(r, axis=1) for il, r in rows.items()}


def kvzip_plan(il: int, selection: str = "layer", budget: int = B_PREFILL, decode_budget: int = B_DECODE,
               pool_kernel: int | None = None, pool_shift: int | None = None) -> plan_mod.Plan:
    """Layer il: kvzip prefill, SnapKV decode; the other layer FullKV."""
    layers = []
    for j in range(CFG.n_layer):
        if j == il:
            pre = plan_mod.PhasePlan("kvzip", budget=budget, n_sink=1, window=2, selection=selection,
                                     pool_kernel=pool_kernel, pool_shift=pool_shift)
            dec = plan_mod.PhasePlan("snapkv", budget=decode_budget, selection=selection, **PHASE_PARAMS["snapkv"])
        else:
            pre, dec = plan_mod.PhasePlan("fullkv"), plan_mod.PhasePlan("fullkv")
        layers.append(plan_mod.LayerPlan(j, pre, dec))
    return plan_mod.Plan(version=1, n_layer=CFG.n_layer, budget_avg=budget, b_min=1, budget_rule="test",
                         layers=layers, exact_total=False).validate()


def run_kvzip(path, plan, toks, layer, *, flash_attn="on", n_ubatch=512, chunk=CHUNK):
    """Kept positions of `layer` per KV head after the KVzip compression and after each decode step; logits."""
    with Model(path) as model:
        model.set_plan(plan, prefill="exact")
        with model.context(n_ctx=256, n_batch=n_ubatch, n_ubatch=n_ubatch, flash_attn=flash_attn,
                           type_k="f32", type_v="f32") as ctx:
            ctx.decode(toks[:P])
            ctx.compress_prompt_kvzip(toks[:P], prefix=PREFIX, chunk=chunk)
            kept = [[ctx.kept_positions(layer, h) for h in range(CFG.n_head_kv)]]
            logits = [ctx.logits()]
            steps = decode_recording(ctx, toks[P:], layer)
    return kept + steps[0], np.array(logits + steps[1])


def reference(hf_ref, recon, plan, layer):
    logp, keys = hf_ref[layer]
    pp = plan.layers[layer]
    kw = dict(prefill=pattern_from_phase_plan(pp.prefill), prefill_budget=B_PREFILL,
              decode=pattern_from_phase_plan(pp.decode), decode_budget=B_DECODE, keys=keys, recon_attn=recon[layer])
    if pp.prefill.selection in ("head", "adaptive"):
        return simulate_heads(logp, P, CFG.n_head_kv, adaptive=pp.prefill.selection == "adaptive", **kw)
    return [simulate(logp, P, **kw)] * CFG.n_head_kv


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("selection", ["layer", "head", "adaptive"])
@pytest.mark.parametrize("layer", [0, 1])
def test_kvzip_kept_positions_equal_reference(twin, tokens, hf_reference, recon_attn, layer, selection, flash_attn):
    _, path = twin
    plan = kvzip_plan(layer, selection)
    kept, _ = run_kvzip(path, plan, tokens, layer, flash_attn=flash_attn)
    ref = reference(hf_reference, recon_attn, plan, layer)
    for h in range(CFG.n_head_kv):
        assert kept[0][h] == ref[h].prefill_kept.tolist(), f"head {h} after the KVzip compression"
        for step in range(N):
            assert kept[step + 1][h] == ref[h].decode_kept[step].tolist(), f"head {h} after decode step {step + 1}"


@pytest.mark.parametrize("shift", [None, 2])
@pytest.mark.parametrize("selection", ["layer", "head"])
def test_pooled_kvzip_keeps_what_the_pooled_reference_keeps(twin, tokens, hf_reference, recon_attn, selection, shift):
    """`pool_kernel` 5 max-pools the reconstruction scores over neighbouring positions (with `pool_shift` 2: the 4
    after a token and none before), natively as in the reference; the kept set differs from the unpooled one."""
    _, path = twin
    layer = 1
    plan = kvzip_plan(layer, selection, pool_kernel=5, pool_shift=shift)
    kept, _ = run_kvzip(path, plan, tokens, layer)
    ref = reference(hf_reference, recon_attn, plan, layer)
    unpooled = reference(hf_reference, recon_attn, kvzip_plan(layer, selection), layer)
    for h in range(CFG.n_head_kv):
        assert kept[0][h] == ref[h].prefill_kept.tolist(), f"head {h} after the KVzip compression"
    assert any(ref[h].prefill_kept.tolist() != unpooled[h].prefill_kept.tolist() for h in range(CFG.n_head_kv))


@pytest.mark.parametrize("prefill", ["exact", "portable"])
@pytest.mark.parametrize("selection", ["layer", "head"])
def test_kvzip_scores_equal_the_reference_maximum(twin, tokens, recon_attn, selection, prefill):
    """`Context.kept_scores`: with room for the whole prompt, each token's score is the largest probability any
    reconstruction query of the layer's (or the KV head's) query heads gave it, as transformers computes it. A
    portable context keeps both kinds for every layer, except layer-wide scores of a per-head layer."""
    _, path = twin
    plan = kvzip_plan(1, selection, budget=P + N, decode_budget=P + N)
    r = CFG.n_head // CFG.n_head_kv
    with Model(path) as model:
        model.set_plan(plan, prefill=prefill)
        # flash attention off: its f16 softmax in layer 0 moves layer 1's probabilities by about 1e-3
        with model.context(n_ctx=256, type_k="f32", type_v="f32", flash_attn="off") as ctx:
            ctx.decode(tokens[:P])
            ctx.compress_prompt_kvzip(tokens[:P], prefix=PREFIX, chunk=CHUNK)
            assert ctx.kept_positions(1) == list(range(P))
            if selection == "layer":
                np.testing.assert_allclose(ctx.kept_scores(1), recon_attn[1].max(axis=(0, 1)), rtol=1e-4, atol=1e-6)
            else:
                with pytest.raises(NativeError, match="keeps no layer scores"):
                    ctx.kept_scores(1)
            if selection == "head" or prefill == "portable":
                for h in range(CFG.n_head_kv):
                    want = recon_attn[1][h * r:(h + 1) * r].max(axis=(0, 1))
                    np.testing.assert_allclose(ctx.kept_scores(1, h), want, rtol=1e-4, atol=1e-6)
            else:
                with pytest.raises(NativeError, match="keeps no head 0 scores"):
                    ctx.kept_scores(1, 0)
            assert len(ctx.kept_scores(0)) == len(ctx.kept_positions(0)) == P  # FullKV layer: positions, no scores
            assert not np.any(ctx.kept_scores(0))


def test_one_scored_portable_state_serves_every_kvzip_plan(twin, tokens):
    """`score_prompt_kvzip` in a portable context, then `snapshot()`: the state carries the pass's scores, so a
    portable context of another KVzip plan (other budget, other selection, per-prompt budgets) that restores it and
    compresses keeps what its own pass keeps, with the same logits. A snapshot taken before the pass carries no
    scores (the plan's warning case: sinks and recent tokens)."""
    _, path = twin
    kw = dict(n_ctx=256, type_k="f32", type_v="f32", flash_attn="off")
    plans = [kvzip_plan(1, "layer"), kvzip_plan(1, "head", budget=12, decode_budget=12),
             plan_mod.Plan.from_dict({**kvzip_plan(1, "head").to_dict(), "allocation": "prompt"})]

    def after(ctx):
        kept = [[ctx.kept_positions(il, h) for h in range(CFG.n_head_kv)] for il in range(CFG.n_layer)]
        ctx.decode([tokens[P]])
        return kept, ctx.logits().copy()

    with Model(path) as model:
        model.set_plan(plans[0], prefill="portable")
        with model.context(**kw) as ctx:
            ctx.decode(tokens[:P])
            unscored = ctx.snapshot()
            ctx.score_prompt_kvzip(tokens[:P], prefix=PREFIX, chunk=CHUNK)
            assert ctx.kept_positions(1) == list(range(P))  # scored, not compressed
            scored = ctx.snapshot()
        model.set_plan(plans[1], prefill="exact")  # an exact per-head context keeps no layer scores
        with model.context(**kw) as ctx:
            ctx.decode(tokens[:P])
            ctx.score_prompt_kvzip(tokens[:P], prefix=PREFIX, chunk=CHUNK)
            scored_heads = ctx.snapshot()
        for plan in plans:
            model.set_plan(plan, prefill="portable")
            with model.context(**kw) as ctx:
                ctx.decode(tokens[:P])
                ctx.compress_prompt_kvzip(tokens[:P], prefix=PREFIX, chunk=CHUNK)
                want = after(ctx)
            with model.context(**kw) as ctx:
                ctx.restore(scored)
                ctx.compress_prompt()
                got = after(ctx)
            assert got[0] == want[0]
            np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-6)
            if plan is plans[0]:
                model.set_plan(plan, prefill="exact")
                with model.context(**kw) as ctx:  # per-head scores serve a per-layer plan: the largest of the heads'
                    ctx.restore(scored_heads)
                    ctx.compress_prompt()
                    assert after(ctx)[0] == want[0]
                model.set_plan(plan, prefill="portable")
                with model.context(**kw) as ctx:  # no scores: what an unscored kvzip layer keeps, not the pass's
                    ctx.restore(unscored)
                    ctx.compress_prompt()
                    assert after(ctx)[0] != want[0]


@pytest.mark.slow
def test_kvzip_prefix_closes_the_user_turn(default_model):
    """The default reconstruction prefix of a chat model: the instruction, then its template's end of the user
    turn and assistant header (kvpress's KVzipPress builds it the same way)."""
    with Model(default_model) as model:
        text = model.detokenize(model.kvzip_prefix(), unparse_special=True)
    assert text == "\n\nRepeat the previous context exactly.<|im_end|>\n<|im_start|>assistant\n"


def test_kvzip_scores_differ_from_the_prompt_attention(hf_reference, recon_attn):
    """The reference itself: the reconstruction pass chooses other tokens than the prompt's own attention
    (H2O's column sums), so the equality above tests the pass, not a prompt score under another name."""
    logp, _ = hf_reference[1]
    kv = simulate(logp, P, prefill="kvzip", prefill_budget=B_PREFILL, decode=None, decode_budget=B_DECODE,
                  recon_attn=recon_attn[1])
    h2o = simulate(logp, P, prefill=pattern_from_phase_plan(plan_mod.PhasePlan("h2o", budget=B_PREFILL, window=0)),
                   prefill_budget=B_PREFILL, decode=None, decode_budget=B_DECODE)
    assert kv.prefill_kept.tolist() != h2o.prefill_kept.tolist()


@pytest.mark.parametrize("n_ubatch", [512, 8])
def test_kvzip_pass_leaves_no_trace(twin, tokens, n_ubatch):
    """Budget above the prompt: the pass runs (in ubatches of 8 too) and removes its tokens; every logit after it
    equals the no-plan run's, the first one included (the prompt's logits are kept across the pass)."""
    _, path = twin
    plan = kvzip_plan(1, "head", budget=P + N + 4, decode_budget=P + N + 4)
    _, got = run_kvzip(path, plan, tokens, 1, n_ubatch=n_ubatch)
    from test_polykv_native import run_native

    _, want = run_native(path, None, tokens, 1, n_ubatch=n_ubatch)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_question_after_a_kvzip_compression_is_kept(twin, tokens):
    """Query-agnostic use: the context is compressed by KVzip, then a question (not scored by the pass) is fed
    and the prompt compressed again at the first answer token: the question stays, context tokens make room."""
    _, path = twin
    plan = kvzip_plan(1, "head")
    q = tokens[P:P + 5]
    with Model(path) as model:
        model.set_plan(plan, prefill="exact")
        with model.context(n_ctx=256, type_k="f32", type_v="f32") as ctx:
            ctx.decode(tokens[:P])
            ctx.compress_prompt_kvzip(tokens[:P], prefix=PREFIX, chunk=CHUNK)
            before = [ctx.kept_positions(1, h) for h in range(CFG.n_head_kv)]
            ctx.decode(q)
            ctx.compress_prompt()
            for h in range(CFG.n_head_kv):
                kept = ctx.kept_positions(1, h)
                assert len(kept) == B_PREFILL
                assert kept[-5:] == list(range(P, P + 5))
                assert set(kept[:-5]) < set(before[h])


def test_per_prompt_kvzip_plan_on_q8_0_caches(tmp_path, tokens):
    """The shipped query-agnostic plan's shape (per-head KVzip in every layer, budgets re-split per prompt,
    follow-ups kept) on q8_0 K/V: the pass runs, every head keeps its share of the same total, the kept sets stay
    close to the f16 run's (scores come from quantized keys), the question is kept after the compression, and the
    caches take about 1.0625/2 of f16's bytes. A model whose heads hold whole q8_0 blocks (32 dimensions)."""
    from tiny_models import TinyConfig, write_tiny_gguf

    cfg = TinyConfig(n_layer=CFG.n_layer, n_embd=128, n_head=4, n_head_kv=2, n_ff=128, n_vocab=CFG.n_vocab)
    path = write_tiny_gguf(tmp_path / "d32.gguf", cfg, seed=3)
    layers = [plan_mod.LayerPlan(j, plan_mod.PhasePlan("kvzip", budget=B_PREFILL, n_sink=1, window=0, selection="head"),
                                 plan_mod.PhasePlan("snapkv", budget=B_DECODE, selection="head", **PHASE_PARAMS["snapkv"]))
              for j in range(cfg.n_layer)]
    plan = plan_mod.Plan(version=1, n_layer=cfg.n_layer, budget_avg=B_PREFILL, b_min=2, budget_rule="test",
                         layers=layers, exact_total=False, allocation="prompt", followup="keep").validate()
    q = tokens[P:P + 4]
    runs = {}
    for kv_type in ("f16", "q8_0"):
        with Model(path) as model:
            model.set_plan(plan, prefill="exact")
            with model.context(n_ctx=256, flash_attn="on", type_k=kv_type, type_v=kv_type) as ctx:
                ctx.decode(tokens[:P])
                ctx.compress_prompt_kvzip(tokens[:P], prefix=PREFIX, chunk=CHUNK)
                kept = [[ctx.kept_positions(il, h) for h in range(cfg.n_head_kv)] for il in range(cfg.n_layer)]
                ctx.decode(q)
                ctx.compress_prompt()
                after = [[ctx.kept_positions(il, h) for h in range(cfg.n_head_kv)] for il in range(cfg.n_layer)]
                logits = ctx.logits()
                runs[kv_type] = kept, after, logits, sum(s.bytes for s in ctx.kv_layer_stats())
    (kept_f, _, _, bytes_f), (kept_q, after_q, logits_q, bytes_q) = runs["f16"], runs["q8_0"]
    pool = cfg.n_layer * cfg.n_head_kv * B_PREFILL  # each layer's share is whole tokens per head: rounded down
    for kept in (kept_q, kept_f):
        assert pool - cfg.n_layer * cfg.n_head_kv < sum(len(k) for heads in kept for k in heads) <= pool
        assert all(len({len(k) for k in heads}) == 1 for heads in kept)  # a layer's heads keep one count
    assert all(len(k) >= 2 for heads in kept_q for k in heads)
    pairs = [(set(a), set(b)) for ha, hb in zip(kept_q, kept_f) for a, b in zip(ha, hb)]
    assert sum(len(a & b) for a, b in pairs) / sum(len(b) for _, b in pairs) >= 0.75
    for heads, before in zip(after_q, kept_q):
        for h, k in enumerate(heads):
            assert k == before[h] + list(range(P, P + 4))  # the question on top of the compressed context
    assert np.isfinite(logits_q).all()
    assert 0.4 < bytes_q / bytes_f < 0.6


def test_kvzip_misuse_is_reported(twin, tokens):
    _, path = twin
    with pytest.raises(PlanError, match="prefill pattern only"):
        plan_mod.uniform_plan(CFG.n_layer, "kvzip", 64, decode_pattern="kvzip")
    assert plan_mod.uniform_plan(CFG.n_layer, "kvzip", 64).layers[0].decode.pattern == plan_mod.DECODE_AFTER_PREFILL_ONLY
    bad = kvzip_plan(1).to_json().replace('"snapkv"', '"kvzip"')
    with Model(path) as model:
        with pytest.raises(PlanError, match="prefill pattern only"):
            model.set_plan(bad)
        model.set_plan(kvzip_plan(1))  # chunked prefill: no whole prompt to score
        with model.context(n_ctx=256) as ctx:
            ctx.decode(tokens[:P])
            with pytest.raises(NativeError, match="exact prefill"):
                ctx.compress_prompt_kvzip(tokens[:P], prefix=PREFIX)
        model.set_plan(kvzip_plan(1), prefill="exact")
        with model.context(n_ctx=256) as ctx:
            ctx.decode(tokens[:P])
            with pytest.raises(NativeError, match="prompt's 40 tokens"):
                ctx.compress_prompt_kvzip(tokens[:P - 1], prefix=PREFIX)
            big_prefix = list(range(3, 3 + ctx.n_ctx - P))  # no room left for a chunk
            with pytest.raises(NativeError, match="no room"):
                ctx.compress_prompt_kvzip(tokens[:P], prefix=big_prefix)


def test_run_command_runs_the_reconstruction_pass(tmp_path, twin, cli_exe):
    """`polykv-cpp run` with a kvzip plan scores the prompt by the pass and says so (exact prefill: its default for
    such a plan, the same answer as --prefill-mode exact); with --prefill-mode chunked it warns that kvzip layers
    fall back to their sinks and recent tokens."""
    from conftest import run_cli

    _, path = twin
    plan_path = tmp_path / "kvzip.json"
    plan_path.write_text(kvzip_plan(1, "head").to_json())
    prompt = " ".join(["the and to of a in is it you that he was for on are as with his they at be"] * 3)
    r = run_cli(cli_exe, "run", path, "--plan", plan_path, "--prefill-mode", "exact", "-p", prompt, "-n", "4",
                "--no-echo", "-c", "512")
    assert r.returncode == 0, r.stderr
    assert "exact prefill, KVzip reconstruction pass" in r.stderr
    auto = run_cli(cli_exe, "run", path, "--plan", plan_path, "-p", prompt, "-n", "4", "--no-echo", "-c", "512")
    assert auto.returncode == 0, auto.stderr
    assert "exact prefill (the plan's KVzip pass or per-prompt budgets need the whole prompt), KVzip" in auto.stderr
    assert auto.stdout == r.stdout
    r = run_cli(cli_exe, "run", path, "--plan", plan_path, "--prefill-mode", "chunked", "-p", prompt, "-n", "4",
                "--no-echo", "-c", "512")
    assert r.returncode == 0, r.stderr
    assert "kvzip layers need --prefill-mode exact" in r.stderr


def test_kvzip_prefix_without_a_chat_template(twin):
    """A model without a chat template gets the bare instruction (api.KVZIP_PREFIX)."""
    from polykv_cpp.api import KVZIP_PREFIX

    _, path = twin
    with Model(path) as model:
        assert model.meta("tokenizer.chat_template") is None
        assert model.kvzip_prefix() == model.tokenize(KVZIP_PREFIX, add_special=False, parse_special=False)
