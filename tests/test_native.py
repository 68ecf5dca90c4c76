"""The cffi bindings and the high-level API against our libllama, on tiny random models written here."""

import subprocess
import sys

import numpy as np
import pytest

from polykv_cpp import _native
from polykv_cpp.api import Model, check_gguf_file
from polykv_cpp.errors import ModelLoadError, NativeError, PolyKVError
from tiny_models import TinyConfig, write_tiny_gguf


def test_struct_layouts_match_the_library():
    lib = _native.load()
    mp = lib.llama_model_default_params()
    # values llama.cpp sets in llama_model_default_params / llama_context_default_params: a shifted or
    # missing field in our cdef shows up as garbage here
    assert mp.n_gpu_layers == -1
    assert mp.vocab_only is False and mp.use_extra_bufts is True
    assert mp.load_mtp is False and mp.no_alloc is False
    cp = lib.llama_context_default_params()
    assert cp.n_ctx == 512 and cp.n_batch == 2048 and cp.n_ubatch == 512 and cp.n_seq_max == 1
    assert cp.n_threads == cp.n_threads_batch and cp.n_threads > 0
    assert cp.flash_attn_type == -1
    assert cp.type_k == 1 and cp.type_v == 1  # GGML_TYPE_F16
    assert cp.offload_kqv is True and cp.op_offload is True and cp.kv_unified is False
    assert cp.samplers == _native.ffi.NULL and cp.n_samplers == 0 and cp.ctx_other == _native.ffi.NULL
    assert cp.yarn_attn_factor == -1.0  # unset: the model's own value is taken


def test_version_names_the_pinned_commit():
    info = _native.version_info()
    assert info["llama_commit"] == "0c1e57098"
    assert info["polykv"] not in ("", "dev")


def test_model_properties_and_metadata(tiny_gguf):
    cfg = TinyConfig()
    with Model(tiny_gguf) as model:
        assert model.n_layer == cfg.n_layer
        assert model.n_head == cfg.n_head
        assert model.n_head_kv == cfg.n_head_kv
        assert model.n_embd == cfg.n_embd
        assert model.n_vocab == cfg.n_vocab
        assert model.meta("general.architecture") == "qwen2"
        assert model.meta("qwen2.block_count") == str(cfg.n_layer)
        assert model.meta("no.such.key") is None
        meta = model.metadata()
        assert meta["general.name"] == "tiny-qwen2"


def test_long_metadata_string_is_returned_whole(tmp_path):
    value = "x" * 5000 + "END"
    path = write_tiny_gguf(tmp_path / "m.gguf", extra_kv={"test.long": value})
    with Model(path) as model:
        assert model.meta("test.long") == value


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_chat_prompt_follows_the_models_template(tmp_path, tiny_gguf):
    path = write_tiny_gguf(tmp_path / "chat.gguf", extra_kv={"tokenizer.chat_template": CHATML})
    with Model(path) as model:
        # the ChatML layout, written out by hand
        assert model.chat_prompt([("system", "Be brief."), ("user", "long text " * 400 + "?")]) == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + "long text " * 400 +
            "?<|im_end|>\n<|im_start|>assistant\n")
        assert model.chat_prompt([("user", "hi")], add_assistant=False) == "<|im_start|>user\nhi<|im_end|>\n"
    with Model(tiny_gguf) as model, pytest.raises(PolyKVError, match="no chat template"):
        model.chat_prompt([("user", "hi")])
    odd = write_tiny_gguf(tmp_path / "odd.gguf", extra_kv={"tokenizer.chat_template": "{{ nothing we know }}"})
    with Model(odd) as model, pytest.raises(PolyKVError, match="does not support"):
        model.chat_prompt([("user", "hi")])


def test_tokenize_roundtrip(tiny_gguf):
    with Model(tiny_gguf) as model:
        text = "the word is on the way"
        toks = model.tokenize(text)
        assert toks[0] == 1  # BOS, add_bos is set in the tiny vocab
        assert len(toks) > 3
        assert model.detokenize(toks[1:]).strip() == text
        pieces = b"".join(model.token_to_piece(t) for t in toks[1:]).decode()
        assert pieces.strip() == text
        # bytes outside the vocabulary's pieces go through byte fallback
        assert model.detokenize(model.tokenize("ünï", add_special=False)).strip() == "ünï"


def test_greedy_generation_is_deterministic_and_matches_argmax(tiny_gguf):
    with Model(tiny_gguf) as model:
        prompt = model.tokenize("the cat and the dog")
        with model.context(n_ctx=256) as ctx:
            out1 = list(ctx.generate_tokens(prompt, max_tokens=12, stop_at_eog=False))
        with model.context(n_ctx=256) as ctx:
            # recompute by hand: argmax of the logits after each step
            ctx.decode(prompt)
            manual = []
            for _ in range(12):
                tok = int(np.argmax(ctx.logits()))
                manual.append(tok)
                ctx.decode([tok])
        assert out1 == manual
        assert len(set(out1)) > 1


def test_sampling_with_seed_is_reproducible(tiny_gguf):
    with Model(tiny_gguf) as model:
        outs = []
        for seed in (7, 7, 8):
            with model.context(n_ctx=256) as ctx:
                outs.append(ctx.generate("the", max_tokens=16, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0,
                                         seed=seed, stop_at_eog=False))
        assert outs[0] == outs[1]
        assert outs[0] != outs[2]


def test_streaming_equals_full_text(tiny_gguf):
    with Model(tiny_gguf) as model, model.context(n_ctx=256) as ctx:
        full = ctx.generate("a word", max_tokens=10, stop_at_eog=False)
        ctx.clear()
        streamed = "".join(ctx.generate("a word", max_tokens=10, stop_at_eog=False, stream=True))
        assert streamed == full and len(full) > 0


def test_all_logits_equal_incremental_logits(tiny_gguf):
    with Model(tiny_gguf) as model, model.context(n_ctx=256) as ctx:
        toks = model.tokenize("the cat is on the way to the word")
        ctx.decode(toks, all_logits=True)
        batch_logits = [ctx.logits(i) for i in range(len(toks))]
        ctx.clear()
        for i, t in enumerate(toks):
            ctx.decode([t])
            np.testing.assert_allclose(ctx.logits(), batch_logits[i], rtol=1e-4, atol=1e-4)


def test_memory_seq_rm_and_state_roundtrip(tiny_gguf):
    with Model(tiny_gguf) as model, model.context(n_ctx=256) as ctx:
        toks = model.tokenize("the cat and the dog was on the way")
        ctx.decode(toks)
        assert ctx.pos_max() == len(toks) - 1
        state = ctx.state_bytes()
        ref = ctx.logits()
        ctx.decode(model.tokenize("of", add_special=False))
        assert ctx.seq_rm(0, len(toks), -1)
        assert ctx.pos_max() == len(toks) - 1
        ctx.clear()
        assert ctx.pos_max() == -1
        ctx.load_state_bytes(state)
        assert ctx.pos_max() == len(toks) - 1
        assert ctx.n_past == len(toks)
        # after restore, decoding the same next token gives the same logits as without the detour
        nxt = int(np.argmax(ref))
        ctx.decode([nxt])
        a = ctx.logits()
        ctx.clear()
        ctx.decode(toks + [nxt])
        np.testing.assert_allclose(a, ctx.logits(), rtol=1e-4, atol=1e-4)


def test_context_overflow_is_an_exception(tiny_gguf):
    with Model(tiny_gguf) as model, model.context(n_ctx=256) as ctx:
        with pytest.raises(NativeError, match="context is full"):
            ctx.decode([5] * 300)


@pytest.mark.parametrize("content,match", [
    (None, "not found"),
    (b"", "not a GGUF"),
    (b"PK\x03\x04 not a gguf at all", "not a GGUF"),
])
def test_bad_model_paths_raise(tmp_path, content, match):
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=match):
        Model(path)


def test_directory_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="not a file"):
        check_gguf_file(tmp_path)


@pytest.mark.parametrize("cut", [0.02, 0.5, 0.97])
def test_truncated_gguf_raises_and_interpreter_survives(tiny_gguf, tmp_path, cut):
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: int(len(data) * cut)])
    # run in a child first: a crash there must not take down the test session
    code = ("import sys\nfrom polykv_cpp.api import Model\nfrom polykv_cpp.errors import ModelLoadError\n"
            f"try:\n    Model({str(bad)!r})\nexcept ModelLoadError as e:\n    print('ERR', e)\n    sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "failed to load model" in proc.stdout
    with pytest.raises(ModelLoadError, match="failed to load model"):
        Model(bad)


def test_corrupt_metadata_raises(tiny_gguf, tmp_path):
    data = bytearray(tiny_gguf.read_bytes())
    data[8:16] = (2**40).to_bytes(8, "little")  # absurd tensor count
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="failed to load model"):
        Model(bad)


def test_closed_objects_raise(tiny_gguf):
    model = Model(tiny_gguf)
    ctx = model.context(n_ctx=256)
    ctx.close()
    with pytest.raises(NativeError, match="closed"):
        ctx.decode([1])
    model.close()
    with pytest.raises(NativeError, match="closed"):
        model.n_layer


def test_gpu_layers_default_follows_llama_cpp_environment(monkeypatch, tiny_gguf):
    """`Model(path)` offloads what LLAMA_ARG_N_GPU_LAYERS says (llama.cpp's tools read it too), else nothing;
    a value that is not an integer is an error that names the variable."""
    from polykv_cpp.api import default_gpu_layers

    monkeypatch.delenv("LLAMA_ARG_N_GPU_LAYERS", raising=False)
    assert default_gpu_layers() == 0
    monkeypatch.setenv("LLAMA_ARG_N_GPU_LAYERS", "99")
    assert default_gpu_layers() == 99
    with Model(tiny_gguf) as model:  # a CPU build runs everything on the CPU whatever the count
        assert model.n_layer > 0
    monkeypatch.setenv("LLAMA_ARG_N_GPU_LAYERS", "all")
    with pytest.raises(NativeError, match="LLAMA_ARG_N_GPU_LAYERS"):
        Model(tiny_gguf)


def test_native_plan_errors_are_text_even_when_the_input_is_cut_inside_a_character(tiny_gguf):
    """The JSON parser's error message quotes the bytes it read last, which can end inside a multi-byte UTF-8
    character: the message stays valid text (PlanError, not UnicodeDecodeError), and it is this thread's own."""
    import threading

    from polykv_cpp.errors import PlanError

    with Model(tiny_gguf) as model:
        for text in ('{"version": 1, "n_layer": \u00e9\u00e9}', '{"v": "\u20ac', '\u00e9'):
            with pytest.raises(PlanError) as e:
                model._set_native_plan(text, 0)
            assert "invalid plan" in str(e.value)
        errors = {}

        def fail(tag, text):
            try:
                model._set_native_plan(text, 0)
            except PlanError as err:
                errors[tag] = str(err)

        threads = [threading.Thread(target=fail, args=(i, '{"version": %d}' % (2 + i))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(f"version {2 + i}" in errors[i] for i in range(4)), errors
