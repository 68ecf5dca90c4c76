"""FINCH-style probing of a streaming prompt (`Context.decode(..., probe=...)`): in chunked prefill, the probe's
queries rank each chunk before it is evicted, the probe leaves the cache, and the prompt's own last tokens compress
it when decoding starts.

Checked against transformers on the same weights (the tiny fp32 Qwen2 twin of test_polykv_native; layer 0 FullKV,
so layer 1 sees transformers' inputs): a 40-token prompt in ubatches of 32 with a 6-token probe goes in as 26 + 14
tokens; after the first piece the probe's attention rows in a forward pass of (prompt[:26] + probe) choose what
SnapKV keeps, then the last piece's rows over the kept tokens compress the rest.
"""

import numpy as np
import pytest

from polykv_cpp.api import Model
from polykv_cpp.errors import NativeError
from polykv_cpp.patterns import get_pattern, softmax_causal
from test_per_head import head_plan
from test_polykv_native import B_PREFILL, CFG, P, PHASE_PARAMS, hf_reference, tokens, twin  # noqa: F401

torch = pytest.importorskip("torch")

UBATCH = 32
W = 6                   # probe tokens: SnapKV's observation window here (PHASE_PARAMS)
C = UBATCH - W          # the first piece
LAYER = 1


def probe_of(toks):
    return toks[P - W:P]  # the prompt's last tokens, as `run --prompt-probe` takes them


def hf_probe_rows(hf, toks, heads=None):
    """Attention probabilities of the probe's rows over the first piece, [n_head(s), W, C], in a forward pass of
    the first piece followed by the probe (its softmax spans the piece and the probe, as the cache does)."""
    hf.config._attn_implementation = "eager"
    ids = toks[:C] + probe_of(toks)
    with torch.no_grad():
        att = hf(torch.tensor([ids]), output_attentions=True).attentions[LAYER][0].double().numpy()
    rows = att[:, C:, :C]
    if heads is not None:
        r = CFG.n_head // CFG.n_head_kv
        rows = rows[heads[0] * r:(heads[0] + 1) * r]
    return rows


def reference(hf, toks, hf_ref, heads=None):
    """Kept positions after the probe, and after the compression when decoding starts."""
    snapkv = get_pattern("snapkv", **PHASE_PARAMS["snapkv"])
    after_probe = np.arange(C)[snapkv.select(B_PREFILL, attn=hf_probe_rows(hf, toks, heads))]
    cand = np.concatenate([after_probe, np.arange(C, P)])
    logp, _ = hf_ref[LAYER]
    if heads is not None:
        r = CFG.n_head // CFG.n_head_kv
        logp = logp[heads[0] * r:(heads[0] + 1) * r]
    last = np.arange(C, P)
    rows = softmax_causal(logp[:, last][:, :, cand], q_pos=last, k_pos=cand)
    return after_probe, cand[snapkv.select(B_PREFILL, attn=rows)]


def stepwise(path, plan, toks, heads=(None,), flash_attn="auto"):
    """The probe run by hand: kept sets after the first piece, after the probe, and after the compression."""
    with Model(path) as model:
        model.set_plan(plan, prefill="chunked")
        with model.context(n_ctx=256, n_batch=UBATCH, n_ubatch=UBATCH, type_k="f32", type_v="f32",
                           flash_attn=flash_attn) as ctx:
            assert ctx.set_prompt_probing(True)
            ctx.decode(toks[:C])
            piece = [ctx.kept_positions(LAYER, h) for h in heads]
            freed = ctx.probe_prompt(probe_of(toks))
            probed = [ctx.kept_positions(LAYER, h) for h in heads]
            assert ctx.pos_max() == C - 1  # the probe left the cache
            ctx.decode(toks[C:P])
            ctx.compress_prompt()
            final = [ctx.kept_positions(LAYER, h) for h in heads]
            ctx.set_prompt_probing(False)
    return piece, freed, probed, final


def through_decode(path, plan, toks, heads=(None,), probe=True):
    """The same through `decode(prompt, probe=...)`, then the compression a decode step would start with."""
    with Model(path) as model:
        model.set_plan(plan, prefill="chunked")
        with model.context(n_ctx=256, n_batch=UBATCH, n_ubatch=UBATCH, type_k="f32", type_v="f32") as ctx:
            ctx.decode(toks[:P], probe=probe_of(toks) if probe else None)
            ctx.compress_prompt()
            return [ctx.kept_positions(LAYER, h) for h in heads]


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("selection", ["layer", "head"])
def test_the_probe_chooses_what_a_streaming_chunk_keeps(twin, tokens, hf_reference, selection, flash_attn):
    hf, path = twin
    heads = list(range(CFG.n_head_kv)) if selection == "head" else [None]
    plan = head_plan(LAYER, "snapkv", selection=selection)
    piece, freed, probed, final = stepwise(path, plan, tokens, heads, flash_attn)
    assert freed == C - B_PREFILL
    for i, h in enumerate(heads):
        after_probe, after_compression = reference(hf, tokens, hf_reference, None if h is None else [h])
        assert piece[i] == list(range(C)), "the first piece waits for the probe"
        assert probed[i] == after_probe.tolist(), f"after the probe, head {h}"
        assert final[i] == after_compression.tolist(), f"after the compression, head {h}"
    # the step decode(probe=...) takes is the same
    assert through_decode(path, plan, tokens, heads) == final


def test_probing_without_a_probe_evicts_as_plain_chunked_prefill(twin, tokens):
    """A prompt ubatch that no probe follows is evicted before the next one by its own rows: the kept sets are
    those of plain chunked prefill (which evicts right after it)."""
    _, path = twin
    plan = head_plan(LAYER, "snapkv", selection="layer")
    with Model(path) as model:
        model.set_plan(plan, prefill="chunked")
        kept = []
        for probing in (False, True):
            with model.context(n_ctx=256, n_batch=16, n_ubatch=16) as ctx:
                ctx.set_prompt_probing(probing)
                ctx.decode(tokens[:P])
                ctx.set_prompt_probing(False)
                ctx.compress_prompt()
                kept.append(ctx.kept_positions(LAYER))
    assert kept[0] == kept[1] and len(kept[0]) == B_PREFILL


def test_a_probe_changes_what_is_kept_and_stays_out_of_the_cache(twin, tokens):
    _, path = twin
    plan = head_plan(LAYER, "snapkv", selection="layer")
    probed = through_decode(path, plan, tokens)
    plain = through_decode(path, plan, tokens, probe=False)
    assert probed != plain  # the probe steers the selection (a test that could not fail otherwise)
    assert len(probed[0]) == len(plain[0]) == B_PREFILL
    assert max(probed[0]) == P - 1  # the prompt's last token; no probe position beyond it


def test_probing_is_refused_where_it_does_not_apply(twin, tokens):
    _, path = twin
    plan = head_plan(LAYER, "snapkv", selection="layer")
    with Model(path) as model:
        model.set_plan(plan, prefill="exact")
        with model.context(n_ctx=256, n_batch=UBATCH, n_ubatch=UBATCH) as ctx:
            assert not ctx.set_prompt_probing(True)  # exact prefill keeps the whole prompt anyway
            ctx.decode(tokens[:P], probe=probe_of(tokens))  # ignored: the same as without
            with pytest.raises(NativeError, match="no probing"):
                ctx.probe_prompt(probe_of(tokens))
        model.set_plan(plan, prefill="chunked")
        with model.context(n_ctx=256, n_batch=UBATCH, n_ubatch=UBATCH) as ctx:
            with pytest.raises(ValueError, match="leaves no room"):
                ctx.decode(tokens[:P], probe=tokens[:UBATCH])
            assert ctx.set_prompt_probing(True)
            ctx.decode(tokens[:C])
            with pytest.raises(NativeError, match="at least one token"):
                ctx.probe_prompt([])
            assert ctx.probe_prompt(probe_of(tokens)) > 0
            assert ctx.probe_prompt(probe_of(tokens)) == 0  # nothing fed since: nothing to score
    with Model(path) as model:
        with model.context(n_ctx=256) as ctx:
            assert not ctx.set_prompt_probing(True)  # no plan


def test_a_fullkv_plan_with_a_probe_gives_the_logits_of_no_plan(twin, tokens):
    from polykv_cpp import plan as plan_mod

    _, path = twin
    out = []
    with Model(path) as model:
        for plan in (None, plan_mod.uniform_plan(CFG.n_layer, "fullkv", 64)):
            model.set_plan(plan, prefill="chunked")
            with model.context(n_ctx=256, n_batch=UBATCH, n_ubatch=UBATCH, type_k="f32", type_v="f32") as ctx:
                ctx.decode(tokens[:P], probe=probe_of(tokens))
                first = ctx.logits()
                ctx.decode(tokens[P:P + 4])
                out.append((first, ctx.logits()))
    np.testing.assert_allclose(out[1][0], out[0][0], atol=1e-5)
    np.testing.assert_allclose(out[1][1], out[0][1], atol=1e-5)
