"""Chunked prefill keeps the same tokens however a caller's batches cut the prompt: a prompt is compressed after
every n_ubatch tokens counted from its start and after a token with logits (the caller's end of the prompt), not
after whatever piece a batch ends with. That is what makes a llama-server slot under load (its prompt shared out in
pieces between the slots' batches) keep what the same request keeps alone."""

import numpy as np
import pytest

from polykv_cpp.api import Model
from polykv_cpp.plan import uniform_plan
from tiny_models import TinyConfig, write_tiny_gguf

CFG = TinyConfig(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=384)
N_CTX, N_UB, BUDGET = 512, 32, 40
N_PROMPT, N_DECODE = 157, 3
PIECES = (7, 40, 1, 33, 19, 2, 31, 24)  # cuts at neither chunk boundaries nor each other's; sum 157


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("chunks") / "tiny.gguf", CFG, seed=5)


@pytest.fixture(scope="module")
def prompt():
    rng = np.random.default_rng(8)
    return [int(t) for t in rng.integers(3, CFG.n_vocab, size=N_PROMPT + N_DECODE)]


def cut(tokens, sizes):
    out, i = [], 0
    for n in sizes:
        out.append(tokens[i:i + n])
        i += n
    assert i == len(tokens)
    return out


def kept(ctx, heads, seq=0):
    return [[ctx.kept_positions(il, h, seq=seq) for h in heads] for il in range(CFG.n_layer)]


PLANS = [
    ("snapkv", "layer", 1.0),
    ("h2o", "head", 1.0),
    ("tova", "layer", 1.0),
    ("snapkv", "head", 2.0),  # slack: each chunk evicts to 2 x budget, the budget when decoding starts
]


def run(model, prompt, pieces, *, last_logits_each=False):
    """The prompt in `pieces` (logits only at its end unless last_logits_each), then decode steps."""
    heads = [None, 0, 1]
    with model.context(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_UB, flash_attn="off") as ctx:
        for k, piece in enumerate(pieces):
            ctx.decode(piece, last_logits=last_logits_each or k == len(pieces) - 1)
        logits = [ctx.logits()]
        after_prompt = kept(ctx, heads)
        for tok in prompt[N_PROMPT:]:
            ctx.decode([tok])
            logits.append(ctx.logits())
        return after_prompt, kept(ctx, heads), logits, ctx.kv_layer_stats()


@pytest.mark.parametrize("pattern,selection,slack", PLANS)
def test_a_prompt_fed_in_pieces_keeps_what_it_keeps_fed_at_once(path, prompt, pattern, selection, slack):
    with Model(path) as model:
        model.set_plan(uniform_plan(CFG.n_layer, pattern, BUDGET, selection=selection), prefill="chunked",
                       prefill_slack=slack)
        whole = run(model, prompt, [prompt[:N_PROMPT]])
        pieces = run(model, prompt, cut(prompt[:N_PROMPT], PIECES))
        assert pieces[0] == whole[0]  # after the prompt
        assert pieces[1] == whole[1]  # after the decode steps
        for got, want in zip(pieces[2], whole[2]):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        for st, st1 in zip(pieces[3], whole[3]):  # the same plan-sized caches: a piece never needs more room
            assert (st.capacity, st.used) == (st1.capacity, st1.used)
            assert st.used <= BUDGET


def test_pieces_that_end_with_logits_are_compressed_at_their_ends(path, prompt):
    """The caller's logits mark where its prompt ends: a piece that asks for them is compressed after itself, so
    pieces fed the old way (logits after each) keep other tokens than the prompt fed at once. This is the
    control of the test above: the cuts matter, and only the logits-free ones are ignored."""
    with Model(path) as model:
        model.set_plan(uniform_plan(CFG.n_layer, "snapkv", BUDGET), prefill="chunked")
        whole = run(model, prompt, [prompt[:N_PROMPT]])
        each = run(model, prompt, cut(prompt[:N_PROMPT], PIECES), last_logits_each=True)
        assert each[0] != whole[0]


def test_a_one_token_piece_without_logits_is_prompt_not_a_decode_step(path, prompt):
    """A prompt whose last piece is one token without logits (then a decode step) keeps what the prompt fed at
    once keeps: the lone token is not taken for a decode step, which would evict by the decode phase."""
    plan = uniform_plan(CFG.n_layer, "snapkv", BUDGET, decode_pattern="streamingllm")
    with Model(path) as model:
        model.set_plan(plan, prefill="chunked")
        whole = run(model, prompt, [prompt[:N_PROMPT]])
        lone = run(model, prompt, cut(prompt[:N_PROMPT], (N_UB * 2 + 5, 1) + (N_PROMPT - N_UB * 2 - 6,)))
        assert lone[0] == whole[0]
        with model.context(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_UB, flash_attn="off") as ctx:
            n = N_UB + 20  # a chunk (within the budget) and 20 tokens, no logits: the 20 wait for their chunk
            ctx.decode(prompt[:n], last_logits=False)
            assert all(st.used == n for st in ctx.kv_layer_stats())
            ctx.decode(prompt[n:n + 1])  # a decode step: the open chunk is compressed before it, then the step
            assert all(st.used == BUDGET for st in ctx.kv_layer_stats())


def test_sequences_fed_in_a_servers_interleaved_pieces_keep_what_each_keeps_alone(path):
    """Three sequences whose prompts come in pieces of several batches, each batch holding pieces of every
    unfinished prompt (as llama-server shares n_batch between its slots), then decode steps batched together:
    kept sets and logits equal each sequence fed alone in one call."""
    rng = np.random.default_rng(21)
    lens = (150, 97, 121)
    prompts = [[int(t) for t in rng.integers(3, CFG.n_vocab, size=n + N_DECODE)] for n in lens]
    heads = [None, 0, 1]
    plan = uniform_plan(CFG.n_layer, "snapkv", BUDGET, selection="head")
    kw = dict(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_UB, flash_attn="off")
    with Model(path) as model:
        model.set_plan(plan, prefill="chunked")
        alone = []
        for p, n in zip(prompts, lens):
            with model.context(**kw) as ctx:
                ctx.decode(p[:n])
                logits = [ctx.logits()]
                for tok in p[n:]:
                    ctx.decode([tok])
                    logits.append(ctx.logits())
                alone.append((kept(ctx, heads), logits))
        with model.context(n_seq_max=len(prompts), **kw) as ctx:
            fed = [0] * len(prompts)
            logits = {s: [] for s in range(len(prompts))}
            share = [13, 45, 9, 60, 1, 38, 27]  # tokens per sequence in each batch, in turn
            k = 0
            while any(f < n for f, n in zip(fed, lens)):
                batch, partial = {}, set()
                for s, n in enumerate(lens):
                    if fed[s] < n:
                        take = min(share[k % len(share)], n - fed[s])
                        k += 1
                        batch[s] = prompts[s][fed[s]:fed[s] + take]
                        fed[s] += take
                        if fed[s] < n:
                            partial.add(s)
                out = ctx.decode_sequences(batch, partial=partial)
                for s in out:
                    logits[s].append(ctx.logits(out[s]))
            for j in range(N_DECODE):
                out = ctx.decode_sequences({s: [p[n + j]] for s, (p, n) in enumerate(zip(prompts, lens))})
                for s in out:
                    logits[s].append(ctx.logits(out[s]))
            for s in range(len(prompts)):
                assert kept(ctx, heads, seq=s) == alone[s][0], f"sequence {s}"
                for got, want in zip(logits[s], alone[s][1]):
                    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_a_prompts_last_token_alone_is_prompt_even_after_a_full_chunk(path, prompt):
    """A prompt of 4 chunks and one token: its last ubatch is that token, with logits, after a chunk that asked for
    none. No token was sampled, so it is prompt (evicted by the prefill phase), as when the caller says so."""
    n = N_UB * 4 + 1
    plan = uniform_plan(CFG.n_layer, "snapkv", BUDGET, decode_pattern="streamingllm")
    heads = [None]
    with Model(path) as model:
        model.set_plan(plan, prefill="chunked")
        got = []
        for how in ("whole", "pieces", "said"):
            with model.context(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_UB, flash_attn="off") as ctx:
                if how == "whole":
                    ctx.decode(prompt[:n])
                elif how == "pieces":
                    ctx.decode(prompt[:n - 1], last_logits=False)
                    ctx.decode(prompt[n - 1:n])
                else:
                    ctx.decode(prompt[:n], phase="prefill")
                got.append(kept(ctx, heads))
        assert got[0] == got[2]
        assert got[1] == got[2]


def _load_pieces_check():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("pieces_check", Path(__file__).parents[1] / "scripts" / "pieces_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pieces_check_finds_no_difference_on_an_fp32_model(path, tmp_path, capsys):
    """scripts/pieces_check.py (the real-model figures in docs/results.md) on the tiny fp32 model: every set of
    pieces keeps what the prompt fed at once keeps."""
    pieces_check = _load_pieces_check()
    plan = tmp_path / "plan.json"
    plan.write_text(uniform_plan(CFG.n_layer, "snapkv", 300).to_json())
    assert pieces_check.main([str(path), "--plan", str(plan), "--flash-attn", "off"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("plan:")]
    assert len(lines) == 2
    # every layer evicted down to its 300 tokens, and kept the same 300 in pieces
    assert all(f"differ: 0 of {CFG.n_layer}" in line and f"not kept fed at once: 0 of {300 * CFG.n_layer} " in line
               for line in lines)


def test_pieces_check_last_sizes_reports_each_size(path, capsys):
    """`pieces_check.py --last-sizes`: one line per size of the last piece; on the fp32 model with flash attention
    off, stock llama.cpp's logits do not depend on where the prompt was cut."""
    pieces_check = _load_pieces_check()
    assert pieces_check.main([str(path), "--last-sizes", "1-9", "--flash-attn", "off"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stock")]
    assert [int(line.split("last piece of ")[1].split()[0]) for line in lines] == list(range(1, 10))
    assert all(line.endswith("difference| 0.0000") for line in lines)
    with pytest.raises(SystemExit):
        pieces_check.main([str(path)])  # neither --plan nor --last-sizes


@pytest.mark.parametrize("pattern,selection,slack", PLANS[:2])
def test_a_state_saved_inside_a_chunk_goes_on_as_the_prompt_fed_at_once(path, prompt, pattern, selection, slack):
    """llama-server saves a slot (its context checkpoints, its prompt cache) wherever a batch ended: the state
    records the open chunk, so the restored context cuts the rest of the prompt where the saved one would have."""
    with Model(path) as model:
        model.set_plan(uniform_plan(CFG.n_layer, pattern, BUDGET, selection=selection), prefill="chunked",
                       prefill_slack=slack)
        whole = run(model, prompt, [prompt[:N_PROMPT]])
        kw = dict(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_UB, flash_attn="off")
        with model.context(**kw) as ctx:
            ctx.decode(prompt[:N_UB + 19], last_logits=False)  # a chunk and 19 tokens of the next one
            saved = ctx.state_bytes()
        with model.context(**kw) as ctx:
            ctx.load_state_bytes(saved)
            ctx.decode(prompt[N_UB + 19:N_PROMPT])
            assert kept(ctx, [None, 0, 1]) == whole[0]
            np.testing.assert_allclose(ctx.logits(), whole[2][0], atol=1e-4, rtol=0)
