"""Repetition penalty and DRY in the sampler chain (`SamplerSettings`, `LogitPenalties`, `run --dry-*`), against
plain Python references of both rules on a tiny random model."""

import numpy as np
import pytest

from conftest import run_cli
from polykv_cpp.api import LogitPenalties, Model, SamplerSettings


def dry_reference(history, n_vocab, multiplier, base, allowed_length, last_n):
    """DRY's penalties as its author describes them (p-e-w, oobabooga/text-generation-webui #5677), no sequence
    breakers: a token t that would extend a sequence already seen in the last ``last_n`` tokens, that is, the
    history's longest suffix of length n that also occurs earlier followed by t, loses
    ``multiplier * base ** (n - allowed_length)`` when n >= allowed_length (the earlier occurrence may overlap the
    suffix; only tokens inside the window count)."""
    h = list(history[-last_n:])
    penalty = np.zeros(n_vocab)
    if len(h) <= allowed_length:
        return penalty
    longest: dict[int, int] = {}
    for end in range(len(h) - 1):  # an earlier occurrence ending at h[end], followed by h[end + 1]
        n = 0
        while end - n >= 0 and h[end - n] == h[len(h) - 1 - n]:
            n += 1
        if n >= allowed_length:
            t = h[end + 1]
            longest[t] = max(longest.get(t, 0), n)
    for t, n in longest.items():
        penalty[t] = multiplier * base ** (n - allowed_length)
    return penalty


def repeat_penalty_reference(logits, history, penalty, last_n):
    out = logits.astype(np.float64).copy()
    for t in set(history[-last_n:]):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


@pytest.fixture(scope="module")
def tiny_model(tiny_gguf):
    with Model(tiny_gguf) as m:
        yield m


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dry_penalties_equal_the_reference(tiny_model, seed):
    rng = np.random.default_rng(seed)
    # few distinct tokens and a copied stretch, so that suffixes repeat at many lengths
    history = rng.integers(3, 6, 150).tolist()
    history += history[40:70] + rng.integers(3, 6, 5).tolist() + history[60:66]
    n_vocab = tiny_model.n_vocab
    settings = SamplerSettings(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=120,
                               dry_sequence_breakers=())
    pen = LogitPenalties(tiny_model, settings, n_ctx=512)
    pen.accept(history)
    logits = rng.normal(0, 2, n_vocab).astype(np.float32)
    got = logits.astype(np.float64) - pen.apply(logits)
    want = dry_reference(history, n_vocab, 0.8, 1.75, 2, 120)
    assert (want > 0).sum() >= 3 and want.max() > 0.8 * 1.75 ** 3  # long repeats are present
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    pen.close()


def test_dry_window_and_off_switch(tiny_model):
    """A repeat older than ``dry_penalty_last_n`` tokens goes free; multiplier 0 changes nothing."""
    history = [5, 6, 7, 8] + [9, 10, 11] * 3 + [5, 6]  # "5 6" -> 7 repeats only from the start
    logits = np.zeros(tiny_model.n_vocab, dtype=np.float32)
    whole = LogitPenalties(tiny_model, SamplerSettings(dry_multiplier=1.0, dry_sequence_breakers=()), n_ctx=64)
    whole.accept(history)
    assert whole.apply(logits)[7] == pytest.approx(-1.0)  # n = 2 = allowed length: multiplier * base ** 0
    short = LogitPenalties(tiny_model, SamplerSettings(dry_multiplier=1.0, dry_penalty_last_n=8,
                                                       dry_sequence_breakers=()), n_ctx=64)
    short.accept(history)
    assert short.apply(logits)[7] == 0.0
    off = LogitPenalties(tiny_model, SamplerSettings(), n_ctx=64)
    off.accept(history)
    np.testing.assert_array_equal(off.apply(logits), logits)


def test_repeat_penalty_equals_the_reference(tiny_model):
    rng = np.random.default_rng(3)
    history = rng.integers(3, 60, 100).tolist()
    logits = rng.normal(0, 3, tiny_model.n_vocab).astype(np.float32)
    pen = LogitPenalties(tiny_model, SamplerSettings(repeat_penalty=1.3, repeat_last_n=40), n_ctx=256)
    pen.accept(history)
    want = repeat_penalty_reference(logits, history, 1.3, 40)
    assert not np.allclose(want, logits)
    np.testing.assert_allclose(pen.apply(logits), want, rtol=1e-6)


def repeated_trigrams(tokens, start):
    """Positions i >= start whose trigram tokens[i-2:i+1] occurred earlier in `tokens`."""
    seen, hits = set(), []
    for i in range(2, len(tokens)):
        g = tuple(tokens[i - 2:i + 1])
        if g in seen and i >= start:
            hits.append(i)
        seen.add(g)
    return hits


def test_dry_breaks_the_greedy_loop_of_a_random_model(tiny_model):
    """Greedy decoding of a random model repeats trigrams; DRY with a large multiplier (allowed length 2, no
    breakers) keeps every generated token from completing a trigram seen before."""
    prompt = tiny_model.tokenize("the cat sat on the mat and")
    runs = {}
    for name, kw in {"plain": {}, "dry": {"dry_multiplier": 1e3, "dry_sequence_breakers": ()}}.items():
        with tiny_model.context(n_ctx=256) as ctx:
            gen = list(ctx.generate_tokens(prompt, max_tokens=80, sampler=SamplerSettings(**kw), stop_at_eog=False))
        runs[name] = prompt + gen
    assert len(repeated_trigrams(runs["plain"], len(prompt))) >= 3
    assert repeated_trigrams(runs["dry"], len(prompt)) == []


def test_sampler_settings_reject_bad_values():
    for kw in ({"repeat_penalty": 0.0}, {"repeat_penalty": float("nan")}, {"dry_multiplier": -1.0},
               {"dry_multiplier": 0.8, "dry_base": 0.5}, {"dry_allowed_length": -1}, {"dry_penalty_last_n": -2},
               {"repeat_last_n": -5}):
        with pytest.raises(ValueError):
            SamplerSettings(**kw)


def test_run_takes_llama_cpp_penalty_flags(cli_exe, tiny_gguf):
    ok = run_cli(cli_exe, "run", str(tiny_gguf), "-p", "the cat", "-n", "8", "--dry-multiplier", "0.8",
                 "--repeat-penalty", "1.1", "--no-echo")
    assert ok.returncode == 0, ok.stderr
    bad = run_cli(cli_exe, "run", str(tiny_gguf), "-p", "the cat", "-n", "8", "--dry-multiplier", "-1")
    assert bad.returncode != 0
    assert "--dry-multiplier must be >= 0" in bad.stderr and "Traceback" not in bad.stderr
