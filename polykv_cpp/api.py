"""A small high-level API over our libllama, for scripts and desktop apps.

    from polykv_cpp import Model
    with Model("model.gguf") as model, model.context(n_ctx=4096) as ctx:
        for piece in ctx.generate("def fib(n):", max_tokens=64, stream=True):
            print(piece, end="", flush=True)

Native memory is freed by `close()` / the context managers (and, as a fallback, when objects are
garbage-collected). Every failure of a native call is raised as a `PolyKVError` subclass carrying the
message llama.cpp logged; bad paths and files that are not GGUF are rejected before they reach llama.cpp.
"""

from __future__ import annotations

import codecs
import os
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from polykv_cpp import _native
from polykv_cpp._native import ffi
from polykv_cpp.errors import ModelLoadError, NativeError, PlanError, PolyKVError

GGUF_MAGIC = b"GGUF"
PREFILL_MODES = {"chunked": 0, "exact": 1, "portable": 2}
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
# ggml_type ids of the KV cache types llama.cpp accepts for -ctk/-ctv
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
# bytes per element of those types (block size / block bytes)
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                 "q5_0": 22 / 32, "q5_1": 24 / 32}


def check_gguf_file(path: str | os.PathLike) -> Path:
    """Reject what llama.cpp should never see: a missing path, a directory, a file that is not GGUF."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelLoadError(f"model path is not a file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{p} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    return p


# llama.cpp's default DRY sequence breakers (common.h): a repetition never runs across one of them
DRY_SEQUENCE_BREAKERS = ("\n", ":", "\"", "*")


@dataclass
class SamplerSettings:
    """llama.cpp's sampler chain, in common_sampler's order: repetition penalties -> DRY -> (greedy when
    temperature <= 0; otherwise top-k -> top-p -> min-p -> temperature -> seeded draw).

    ``repeat_penalty`` (1.0 = off) over the last ``repeat_last_n`` tokens is llama.cpp's ``--repeat-penalty``.
    ``dry_multiplier`` (0 = off) turns on DRY ("Don't Repeat Yourself", p-e-w, oobabooga/text-generation-webui
    #5677; llama.cpp's ``--dry-*`` flags): a token that would extend a sequence already seen in the last
    ``dry_penalty_last_n`` tokens (-1: the whole context) by more than ``dry_allowed_length`` tokens loses
    ``dry_multiplier * dry_base ** (length - dry_allowed_length)`` of its logit; matches stop at the
    ``dry_sequence_breakers``. Both see the prompt's tokens too (llama.cpp's tools accept them into the sampler);
    one generation call's history is not carried into the next call.
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = 0xFFFFFFFF
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DRY_SEQUENCE_BREAKERS

    def __post_init__(self):
        if not self.repeat_penalty > 0:
            raise ValueError(f"repeat_penalty must be > 0 (1.0 = off), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1 (-1 = the whole context), got {self.repeat_last_n}")
        if not self.dry_multiplier >= 0:
            raise ValueError(f"dry_multiplier must be >= 0 (0 = off), got {self.dry_multiplier}")
        if self.dry_multiplier > 0 and not self.dry_base >= 1:
            raise ValueError(f"dry_base must be >= 1, got {self.dry_base}")
        if self.dry_allowed_length < 0:
            raise ValueError(f"dry_allowed_length must be >= 0, got {self.dry_allowed_length}")
        if self.dry_penalty_last_n < -1:
            raise ValueError(f"dry_penalty_last_n must be >= -1 (-1 = the whole context), got "
                             f"{self.dry_penalty_last_n}")

    @property
    def penalizes(self) -> bool:
        """Whether the chain keeps a token history (repetition penalty or DRY)."""
        return self.repeat_penalty != 1.0 or self.dry_multiplier > 0

    def build(self, lib, vocab=None, n_ctx: int = 0):
        """The chain; ``vocab`` (a ``llama_vocab *``) and ``n_ctx`` (what -1 windows mean) serve the penalties."""
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        self.add_penalties(lib, chain, vocab, n_ctx)
        if self.temperature <= 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        if self.top_k > 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(self.top_k))
        if 0 < self.top_p < 1:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(self.top_p, 1))
        if 0 < self.min_p < 1:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(self.min_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(self.temperature))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(self.seed & 0xFFFFFFFF))
        return chain

    def add_penalties(self, lib, chain, vocab=None, n_ctx: int = 0) -> None:
        """Add the repetition penalty and DRY samplers (those that are on) to ``chain``."""
        if self.repeat_penalty != 1.0:
            last_n = n_ctx if self.repeat_last_n == -1 else self.repeat_last_n
            n_vocab = lib.llama_vocab_n_tokens(vocab) if vocab is not None else 0
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_penalties(n_vocab, last_n, self.repeat_penalty,
                                                                                0.0, 0.0))
        if self.dry_multiplier > 0:
            if vocab is None:
                raise ValueError("DRY needs the model's vocabulary")
            last_n = n_ctx if self.dry_penalty_last_n == -1 else self.dry_penalty_last_n
            breakers = [ffi.new("char[]", b.encode()) for b in self.dry_sequence_breakers]
            arr = ffi.new("const char *[]", breakers) if breakers else ffi.NULL
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dry(
                vocab, self.dry_multiplier, self.dry_base, self.dry_allowed_length, last_n, arr, len(breakers)))


def _token_data_array(logits: np.ndarray):
    """A ``llama_token_data_array`` over ``logits`` (kept alive by the returned numpy array)."""
    n = len(logits)
    arr = np.zeros(n, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
    arr["id"] = np.arange(n)
    arr["logit"] = logits
    data = ffi.cast("llama_token_data *", ffi.from_buffer(arr))
    return arr, ffi.new("llama_token_data_array *", {"data": data, "size": n, "selected": -1, "sorted": False})


class LogitPenalties:
    """llama.cpp's repetition penalty and DRY (`SamplerSettings`' fields) applied to logits held in Python, for
    callers that draw tokens themselves: ``accept`` every token of the history (prompt and generated), then
    ``apply`` to each step's logits. Needs the model's vocabulary; ``n_ctx`` is what -1 windows mean."""

    def __init__(self, model: "Model", settings: SamplerSettings, n_ctx: int):
        self._lib = model._lib
        self._chain = self._lib.llama_sampler_chain_init(self._lib.llama_sampler_chain_default_params())
        settings.add_penalties(self._lib, self._chain, model._vocab, n_ctx)

    def accept(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            self._lib.llama_sampler_accept(self._chain, int(tok))

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """The penalized logits (a new float32 array; ``logits`` is not changed)."""
        arr, cur = _token_data_array(logits)
        self._lib.llama_sampler_apply(self._chain, cur)
        out = np.empty(len(logits), dtype=np.float32)
        out[arr["id"]] = arr["logit"]
        return out

    def close(self) -> None:
        if self._chain is not None:
            self._lib.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self):
        self.close()


@dataclass
class LayerStats:
    """One layer's KV cache under a PolyKV plan (`llama_polykv_layer_stats`)."""

    layer: int
    group: int
    pattern_prefill: str
    pattern_decode: str
    budget_prefill: int  # -1: everything (FullKV)
    budget_decode: int
    capacity: int
    used: int
    n_evicted: int
    bytes: int
    bytes_fullkv: int  # what stock llama.cpp's tools allocate for the layer (sliding-window layers: window + ubatch)
    cell_pad: int  # capacity is a multiple of it: 32 cells on the CPU, 256 on a GPU


def layer_stats(lib, ctx_ptr) -> list[LayerStats]:
    """`llama_polykv_get_layer_stats` of a llama_context (ours or another binding's, same library)."""
    n = lib.llama_polykv_get_layer_stats(ctx_ptr, ffi.NULL, 0)
    if n <= 0:
        return []
    buf = ffi.new("struct llama_polykv_layer_stats[]", n)
    lib.llama_polykv_get_layer_stats(ctx_ptr, buf, n)
    name = lib.llama_polykv_pattern_str
    return [LayerStats(layer=s.layer, group=s.group,
                       pattern_prefill=ffi.string(name(s.pattern_prefill)).decode(),
                       pattern_decode=ffi.string(name(s.pattern_decode)).decode(),
                       budget_prefill=s.budget_prefill, budget_decode=s.budget_decode, capacity=s.capacity,
                       used=s.used, n_evicted=s.n_evicted, bytes=s.bytes, bytes_fullkv=s.bytes_fullkv,
                       cell_pad=lib.llama_polykv_layer_cell_pad(ctx_ptr, s.layer))
            for s in buf]


def default_gpu_layers() -> int:
    """``LLAMA_ARG_N_GPU_LAYERS`` (the variable llama.cpp's own tools read), else 0: the CPU."""
    text = os.environ.get("LLAMA_ARG_N_GPU_LAYERS", "").strip()
    if not text:
        return 0
    try:
        return int(text)
    except ValueError:
        raise NativeError(f"LLAMA_ARG_N_GPU_LAYERS={text!r} is not an integer") from None


class Model:
    """A GGUF model loaded by our libllama."""

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int | None = None, vocab_only: bool = False,
                 use_mmap: bool = True):
        """``n_gpu_layers``: layers offloaded to the GPU (99: all); None reads ``LLAMA_ARG_N_GPU_LAYERS`` as
        llama.cpp's tools do, else 0. ``LLAMA_ARG_REPACK=0`` and ``LLAMA_ARG_LOAD_MODE=none`` act as in
        llama.cpp's tools (no CPU weight repacking; no mmap)."""
        self.path = check_gguf_file(path)
        self._lib = _native.load()
        params = self._lib.llama_model_default_params()
        params.n_gpu_layers = default_gpu_layers() if n_gpu_layers is None else n_gpu_layers
        params.vocab_only = vocab_only
        if os.environ.get("LLAMA_ARG_REPACK", "").strip().lower() in ("0", "false", "off", "no"):
            params.use_extra_bufts = False  # llama.cpp's --no-repack: no CPU extra buffer types (repack, AMX)
        if not use_mmap or os.environ.get("LLAMA_ARG_LOAD_MODE", "").strip().lower() == "none":
            params.load_mode = 0
        mark = _native.log_mark()
        self._ptr = self._lib.llama_model_load_from_file(str(self.path).encode(), params)
        if self._ptr == ffi.NULL:
            detail = _native.log_since(mark) or "no detail logged"
            raise ModelLoadError(f"failed to load model {self.path}: {detail}")
        self._vocab = self._lib.llama_model_get_vocab(self._ptr)
        #: the prefill slack set_plan chose; None before: the library's own (LLAMA_POLYKV_PREFILL_SLACK, the plan's)
        self.prefill_slack: float | None = None

    # ---- lifetime -------------------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_ptr", ffi.NULL) != ffi.NULL:
            self._lib.llama_model_free(self._ptr)
            self._ptr = ffi.NULL

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    @property
    def ptr(self):
        if self._ptr == ffi.NULL:
            raise NativeError("model is closed")
        return self._ptr

    # ---- properties -----------------------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return self._lib.llama_model_n_layer(self.ptr)

    @property
    def n_head(self) -> int:
        return self._lib.llama_model_n_head(self.ptr)

    @property
    def n_head_kv(self) -> int:
        return self._lib.llama_model_n_head_kv(self.ptr)

    @property
    def n_embd(self) -> int:
        return self._lib.llama_model_n_embd(self.ptr)

    @property
    def n_ctx_train(self) -> int:
        return self._lib.llama_model_n_ctx_train(self.ptr)

    @property
    def n_vocab(self) -> int:
        return self._lib.llama_vocab_n_tokens(self._vocab)

    @property
    def n_params(self) -> int:
        return self._lib.llama_model_n_params(self.ptr)

    @property
    def size_bytes(self) -> int:
        return self._lib.llama_model_size(self.ptr)

    @property
    def description(self) -> str:
        buf = ffi.new("char[]", 256)
        self._lib.llama_model_desc(self.ptr, buf, 256)
        return ffi.string(buf).decode("utf-8", "replace")

    def attention_windows(self) -> list[int | None]:
        """Per layer, the most tokens it attends to: the window of a sliding-window layer (Gemma 3: 15 of 18
        layers, 512 tokens), None for a layer that sees the whole context. `Plan.scaled(N, caps=...)` takes it."""
        windows = [self._lib.llama_polykv_model_layer_window(self.ptr, il) for il in range(self.n_layer)]
        return [w if w > 0 else None for w in windows]

    def meta(self, key: str) -> str | None:
        """A metadata value as llama.cpp renders it (`llama_model_meta_val_str`); None if absent."""
        size = 256
        while True:
            buf = ffi.new("char[]", size)
            n = self._lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return ffi.string(buf, n).decode("utf-8", "replace")
            size = n + 1

    def metadata(self) -> dict[str, str]:
        out = {}
        for i in range(self._lib.llama_model_meta_count(self.ptr)):
            kbuf = ffi.new("char[]", 256)
            self._lib.llama_model_meta_key_by_index(self.ptr, i, kbuf, 256)
            size = self._lib.llama_model_meta_val_str_by_index(self.ptr, i, ffi.NULL, 0) + 1
            vbuf = ffi.new("char[]", max(size, 1))
            self._lib.llama_model_meta_val_str_by_index(self.ptr, i, vbuf, size)
            out[ffi.string(kbuf).decode()] = ffi.string(vbuf).decode("utf-8", "replace")
        return out

    # ---- vocabulary -----------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = ffi.new("llama_token[]", cap)
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            if n == -(2**31):
                raise NativeError("tokenization overflow")
            cap = -n
            buf = ffi.new("llama_token[]", cap)
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[0:n])

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        buf = ffi.new("char[]", 64)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return ffi.buffer(buf, n)[:]

    def detokenize(self, tokens: Sequence[int], *, remove_special: bool = False,
                   unparse_special: bool = False) -> str:
        arr = ffi.new("llama_token[]", list(tokens))
        cap = max(16, 8 * len(tokens))
        buf = ffi.new("char[]", cap)
        n = self._lib.llama_detokenize(self._vocab, arr, len(tokens), buf, cap, remove_special, unparse_special)
        if n < 0:
            cap = -n
            buf = ffi.new("char[]", cap)
            n = self._lib.llama_detokenize(self._vocab, arr, len(tokens), buf, cap, remove_special, unparse_special)
        return ffi.buffer(buf, n)[:].decode("utf-8", "replace")

    def chat_prompt(self, messages: Sequence[tuple[str, str]], *, add_assistant: bool = True) -> str:
        """`messages` ((role, content) pairs) in the model's own chat template (`tokenizer.chat_template`),
        ending with the assistant's turn opened when `add_assistant`. llama.cpp formats it
        (`llama_chat_apply_template`), which knows its built-in templates only, not arbitrary Jinja:
        a model without a template, or with one llama.cpp does not recognise, raises PolyKVError."""
        tmpl = self._lib.llama_model_chat_template(self.ptr, ffi.NULL)
        if tmpl == ffi.NULL:
            raise PolyKVError(f"{self.path}: the model has no chat template (tokenizer.chat_template)")
        keep = [(ffi.new("char[]", role.encode()), ffi.new("char[]", content.encode())) for role, content in messages]
        chat = ffi.new("llama_chat_message[]", len(keep))
        for i, (role, content) in enumerate(keep):
            chat[i].role = role
            chat[i].content = content
        size = 2 * sum(len(content) for _, content in messages) + 256
        while True:
            buf = ffi.new("char[]", size)
            n = self._lib.llama_chat_apply_template(tmpl, chat, len(keep), add_assistant, buf, size)
            if n < 0:
                raise PolyKVError(f"{self.path}: llama.cpp does not support this model's chat template")
            if n <= size:
                return ffi.buffer(buf, n)[:].decode("utf-8", "replace")
            size = n

    def kvzip_prefix(self) -> list[int]:
        """Tokens of KVzip's reconstruction prefix: :data:`KVZIP_INSTRUCTION`, then the end of the user's turn
        and the assistant's header of the model's chat template, so that the model reads the repeated context
        as its own answer (as kvpress's KVzipPress builds it); :data:`KVZIP_PREFIX` for a model without a chat
        template llama.cpp knows."""
        marker = "\x1fpolykv-kvzip\x1f"
        try:
            turn = self.chat_prompt([("user", marker)])
        except PolyKVError:
            return self.tokenize(KVZIP_PREFIX, add_special=False, parse_special=False)
        header = turn.split(marker, 1)[1]
        return (self.tokenize(KVZIP_INSTRUCTION, add_special=False, parse_special=False)
                + self.tokenize(header, add_special=False, parse_special=True))

    # ---- PolyKV plan ----------------------------------------------------------------------------------
    def set_plan(self, plan=None, *, kv_budget: int = 0, use_gguf: bool = False, prefill: str = "chunked",
                 prefill_slack: float | None = None, protocol: str = "query-aware") -> None:
        """Choose the PolyKV plan of contexts created afterwards.

        `plan`: a `polykv_cpp.plan.Plan`, a JSON string, or a path (JSON sidecar or GGUF); None with
        `use_gguf=False` means no plan (FullKV, stock llama.cpp); `use_gguf=True` uses the plan stored in the
        model file (the `polykv.plan` key; with `protocol="query-agnostic"` its `polykv.plan_query_agnostic` where
        it has one: `resolve_plan`) and fails if there is none. `kv_budget` > 0 rescales the plan to
        that average number of tokens per layer (b_min and proportions kept). `prefill`: "chunked" (default:
        a prompt streams through caches of budget + one ubatch, evicted after every ubatch) or "exact" (the
        whole prompt is kept in caches of n_ctx cells and compressed once when decoding starts; no memory is
        saved, the kept sets are those of the reference for prompts of any length) or "portable" (exact, plus
        one cache per layer keeping the score state of every pattern: `state_bytes()` saved after a prompt
        loads into a portable context of this model with any other plan, so that one prefill serves many
        plans; used by the evaluation; costs the score branch of every pattern in every layer).
        `prefill_slack` s >= 1 (chunked only): while a prompt streams, each layer keeps up to s x its prefill
        budget (caches of s x budget + one ubatch cells) and the prompt is compressed to the budget when
        decoding starts, scored by its last tokens (the question): a bounded middle between chunked and exact.
        None: the plan's own `prefill_slack` (docs/plan-format.md), else 1. `Model.prefill_slack` is the slack
        contexts created afterwards take (1 outside chunked prefill).
        """
        from polykv_cpp import plan as plan_mod

        if prefill not in PREFILL_MODES:
            raise PlanError(f"prefill must be one of {', '.join(PREFILL_MODES)} (got {prefill!r})")
        self._lib.llama_polykv_set_model_prefill_mode(self.ptr, PREFILL_MODES[prefill])
        if prefill_slack is not None and not prefill_slack >= 1.0:
            raise PlanError(f"prefill slack must be a number >= 1 (got {prefill_slack})")
        if prefill_slack is not None and prefill_slack != 1.0 and prefill != "chunked":
            raise PlanError("--prefill-slack applies to the chunked prefill (exact keeps the whole prompt anyway)")
        self._set_prefill_slack(1.0)

        if kv_budget < 0:
            raise PlanError(f"--kv-budget must be positive (got {kv_budget})")
        if kv_budget > 2**31 - 1:
            raise PlanError(f"--kv-budget {kv_budget} is larger than any context (at most 2^31 - 1 tokens)")
        plan = self.resolve_plan(plan, use_gguf=use_gguf, protocol=protocol)
        if plan is None:
            if kv_budget:
                raise PlanError("--kv-budget rescales a plan: give --plan FILE or --plan-from-gguf too")
            self._set_native_plan("", 0)
            return
        if prefill == "chunked":
            slack = plan_mod.chunked_prefill_slack(plan, prefill_slack)
            self._set_prefill_slack(slack)
            if plan.allocation != "plan" and not slack > 1:
                warnings.warn("the plan re-splits its budgets per prompt (\"allocation\": \"prompt\"): chunked "
                              "prefill re-splits what each layer holds when the prompt ends (its budget x the prefill "
                              "slack), so with a slack of 1 it keeps the plan's budgets; use prefill=\"exact\" "
                              "(--prefill-mode exact) or a prefill slack > 1", stacklevel=2)
        self._set_native_plan(plan.to_json(), kv_budget)

    def gguf_plan_key(self, protocol: str = "query-aware") -> str | None:
        """The metadata key of the plan this model file holds for `protocol` (`polykv_cpp.plan.gguf_plan_key`),
        None if it holds none."""
        from polykv_cpp import plan as plan_mod

        return plan_mod.gguf_plan_key({k: self.meta(k) for k in plan_mod.GGUF_PLAN_KEYS.values()}, protocol)

    def resolve_plan(self, plan=None, *, use_gguf: bool = False, protocol: str = "query-aware"):
        """The `polykv_cpp.plan.Plan` that `set_plan(plan, use_gguf=...)` would use, validated for this model (None:
        no plan). `protocol` chooses among the model file's plans (`use_gguf`): "query-agnostic" (the prompt is
        compressed before its question exists) takes `polykv.plan_query_agnostic` where the file has one,
        everything else `polykv.plan` (`gguf_plan_key`)."""
        from polykv_cpp import plan as plan_mod

        if use_gguf:
            if plan is not None:
                raise PlanError("give either a plan or use_gguf=True, not both")
            key = self.gguf_plan_key(protocol)
            if key is None:
                raise PlanError(f"{self.path} holds no PolyKV plan (no '{plan_mod.GGUF_KEY_PLAN}' key); "
                                "make one with `polykv-cpp calibrate` or pass --plan FILE")
            try:
                plan = plan_mod.Plan.from_json(self.meta(key))
            except PlanError as e:
                raise PlanError(f"{self.path}: {key}: {e}") from None
        elif plan is None:
            return None
        if isinstance(plan, (str, os.PathLike)) and not (isinstance(plan, str) and plan.lstrip().startswith("{")):
            plan = plan_mod.load(plan)
        elif isinstance(plan, str):
            plan = plan_mod.Plan.from_json(plan)
        return plan.validate(n_layer=self.n_layer)

    def _set_prefill_slack(self, slack: float) -> None:
        self._lib.llama_polykv_set_model_prefill_slack(self.ptr, float(slack))
        self.prefill_slack = float(slack)

    def _set_native_plan(self, text: str, kv_budget: int) -> None:
        if self._lib.llama_polykv_set_model_plan(self.ptr, text.encode(), kv_budget) != 0:
            raise PlanError(ffi.string(self._lib.llama_polykv_last_error()).decode("utf-8", "replace"))

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    def context(self, **kwargs) -> Context:
        return Context(self, **kwargs)


@dataclass
class Snapshot:
    """`Context.snapshot()`: the llama.cpp state (KV cache) plus the logits of the last token."""

    state: bytes
    logits: np.ndarray | None
    pending: list[int] = field(default_factory=list)


#: KVzip's reconstruction instruction (the paper's and kvpress's wording), fed before the prompt's tokens are
#: repeated; `Model.kvzip_prefix()` closes it with the chat template's assistant header
KVZIP_INSTRUCTION = "\n\nRepeat the previous context exactly."
#: the prefix of a model without a chat template
KVZIP_PREFIX = KVZIP_INSTRUCTION + "\n\n"


class Context:
    """An inference context (KV cache + compute buffers) over a `Model`.

    ``swa_full`` (models with sliding-window layers, without a plan): None keeps llama.cpp's C API default, a
    full-size cache in those layers (as llama-cpp-python); False gives them their window + one ubatch, as llama.cpp's
    tools do by default (less memory; results differ in rounding once a prompt outgrows that cache). A plan's
    sliding-window layers hold at most their window + one ubatch either way.
    """

    def __init__(self, model: Model, *, n_ctx: int = 4096, n_batch: int = 2048, n_ubatch: int = 512,
                 n_threads: int | None = None, flash_attn: str = "auto", type_k: str = "f16",
                 type_v: str = "f16", n_seq_max: int = 1, swa_full: bool | None = None):
        self.model = model
        self._lib = model._lib
        params = self._lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_ubatch, n_batch)
        self.n_ubatch = params.n_ubatch
        params.n_seq_max = n_seq_max
        threads = n_threads or max(1, os.cpu_count() or 1)
        params.n_threads = threads
        params.n_threads_batch = threads
        if flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {sorted(FLASH_ATTN)}, not {flash_attn!r}")
        params.flash_attn_type = FLASH_ATTN[flash_attn]
        for name, value in (("type_k", type_k), ("type_v", type_v)):
            if value not in KV_TYPES:
                raise ValueError(f"{name} must be one of {sorted(KV_TYPES)}, not {value!r}")
        params.type_k = KV_TYPES[type_k]
        params.type_v = KV_TYPES[type_v]
        self.type_k, self.type_v = type_k, type_v
        if swa_full is not None:
            params.swa_full = swa_full
        self.swa_full = bool(params.swa_full)
        params.no_perf = False
        mark = _native.log_mark()
        self._ptr = self._lib.llama_init_from_model(model.ptr, params)
        if self._ptr == ffi.NULL:
            detail = _native.log_since(mark) or "no detail logged"
            raise NativeError(f"failed to create a context (n_ctx={n_ctx}): {detail}")
        self.n_batch = self._lib.llama_n_batch(self._ptr)
        self._batch = self._lib.llama_batch_init(self.n_batch, 0, 1)
        self._n_past = 0
        self._pending: list[int] = []  # last sampled token, decoded lazily with the next input
        self._restored_logits: np.ndarray | None = None  # logits of a restored snapshot, until the next decode

    # ---- lifetime -------------------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_ptr", ffi.NULL) != ffi.NULL:
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self._ptr)
            self._ptr = ffi.NULL

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    @property
    def ptr(self):
        if self._ptr == ffi.NULL:
            raise NativeError("context is closed")
        return self._ptr

    @property
    def n_ctx(self) -> int:
        return self._lib.llama_n_ctx(self.ptr)

    @property
    def n_past(self) -> int:
        """Number of positions of sequence 0 held so far (the next token's position)."""
        return self._n_past

    # ---- memory -----------------------------------------------------------------------------------------
    def clear(self) -> None:
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self.ptr), True)
        self._n_past = 0
        self._pending = []
        self._restored_logits = None

    def seq_rm(self, seq_id: int = 0, p0: int = -1, p1: int = -1) -> bool:
        ok = bool(self._lib.llama_memory_seq_rm(self._lib.llama_get_memory(self.ptr), seq_id, p0, p1))
        if ok and seq_id in (0, -1):
            self._n_past = self.pos_max() + 1
        return ok

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy sequence `src` into `dst` (llama_memory_seq_cp). With a plan, `dst` then holds what `src`'s
        layers keep of [p0, p1), and what it held before is replaced."""
        self._lib.llama_memory_seq_cp(self._lib.llama_get_memory(self.ptr), src, dst, p0, p1)
        if dst == 0:
            self._n_past = self.pos_max() + 1

    def pos_max(self, seq_id: int = 0) -> int:
        return self._lib.llama_memory_seq_pos_max(self._lib.llama_get_memory(self.ptr), seq_id)

    def snapshot(self) -> "Snapshot":
        """The cache (as `state_bytes`) and the logits of the last token, to `restore` later (here or into a
        context of the same model; a portable PolyKV state into any portable context). llama.cpp's state
        holds no logits, so they are kept next to it: generation can go on right after `restore`."""
        last = self.logits() if self._n_past else None
        return Snapshot(self.state_bytes(), last, list(self._pending))

    def restore(self, snap: "Snapshot") -> None:
        self.clear()
        self.load_state_bytes(snap.state)
        self._restored_logits = None if snap.logits is None else snap.logits.copy()
        self._pending = list(snap.pending)

    def state_bytes(self) -> bytes:
        size = self._lib.llama_state_get_size(self.ptr)
        buf = ffi.new("uint8_t[]", size)
        n = self._lib.llama_state_get_data(self.ptr, buf, size)
        return ffi.buffer(buf, n)[:]

    def load_state_bytes(self, data: bytes) -> None:
        mark = _native.log_mark()
        n = self._lib.llama_state_set_data(self.ptr, data, len(data))
        if n == 0:
            detail = _native.log_since(mark)
            raise NativeError("failed to restore the context state" + (f": {detail}" if detail else ""))
        self._n_past = self.pos_max() + 1

    def save_state_file(self, path: str | Path, tokens: Sequence[int]) -> None:
        """llama.cpp's session file (`llama_state_save_file`, what `llama-completion --prompt-cache` writes): the
        cache as it is, compressed by the plan, and `tokens`, the tokens fed so far. As the stock tools do, save
        before the prompt's last token and feed that token after loading: the file holds no logits."""
        toks = ffi.new("llama_token[]", max(1, len(tokens)))
        toks[0:len(tokens)] = list(tokens)
        mark = _native.log_mark()
        if not self._lib.llama_state_save_file(self.ptr, str(path).encode(), toks, len(tokens)):
            detail = _native.log_since(mark)
            raise NativeError(f"failed to save the state to {path}" + (f": {detail}" if detail else ""))

    def load_state_file(self, path: str | Path, max_tokens: int | None = None) -> list[int]:
        """Load a session file (`save_state_file`, or a stock tool's prompt cache) into this context; returns its
        tokens. A file from another model, plan or context size is refused with llama.cpp's or our message."""
        if not Path(path).is_file():
            raise NativeError(f"state file not found: {path}")
        cap = max_tokens if max_tokens is not None else self.n_ctx
        toks = ffi.new("llama_token[]", max(1, cap))
        n = ffi.new("size_t *")
        mark = _native.log_mark()
        if not self._lib.llama_state_load_file(self.ptr, str(path).encode(), toks, cap, n):
            detail = _native.log_since(mark)
            raise NativeError(f"failed to load the state from {path}" + (f": {detail}" if detail else ""))
        self._n_past = self.pos_max() + 1
        self._pending = []
        self._restored_logits = None
        return list(toks[0:n[0]])

    # ---- evaluation -------------------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], *, all_logits: bool = False, probe: Sequence[int] | None = None,
               phase: str | None = None, last_logits: bool = True) -> None:
        """Append `tokens` to sequence 0, in chunks of n_batch; logits for the last token (or all).

        `last_logits` False: no logits at all, the tokens are a piece of a prompt that goes on in the next call.
        With a plan and chunked prefill a prompt is compressed after every n_ubatch tokens counted from its start
        and after a token with logits, so a prompt fed in pieces without logits keeps what it keeps fed at once.

        `phase` (with a plan): what the tokens are, "prefill" (prompt) or "decode" (generated tokens, e.g. several
        verified at once in speculative decoding: one decode step); None guesses from each ubatch, as the stock
        tools get it (a ubatch of one token with logits is a decode step unless it ends a prompt fed without
        logits). `generate_tokens` says which.

        `probe`: tokens that steer what a streaming prompt keeps (FINCH: Corallo & Papotti 2024, "Prompt-guided
        Key-Value Cache Compression"), typically the prompt's own last tokens (its question). With a plan and
        chunked prefill, `tokens` go in pieces of n_ubatch - len(probe); after every piece but the last the probe
        is decoded after it, each layer ranks the prompt by the attention the probe's queries give it, keeps its
        streaming budget (budget x prefill slack), and the probe leaves the cache. The last piece holds the
        question itself, which scores the prompt's compression when decoding starts, as without a probe. Costs a
        decode of the probe per piece. Ignored without a plan and in exact prefill (which keeps the whole prompt
        until the question anyway). Limits: the probe's queries see only the prompt kept so far, at positions
        right after it, so they approximate the question's attention in the whole prompt; one sequence.
        """
        tokens = self._pending + list(tokens)
        self._pending = []
        if not tokens:
            raise ValueError("decode() needs at least one token")
        if phase not in (None, "prefill", "decode"):
            raise ValueError(f"phase {phase!r}: expected 'prefill', 'decode' or None")
        if phase is not None and self.polykv_active:  # for this call; guessed again after it
            self.set_phase(phase)
            try:
                self.decode(tokens, all_logits=all_logits, probe=probe, last_logits=last_logits)
            finally:
                self.set_phase(None)
            return
        self._restored_logits = None
        if self._n_past + len(tokens) > self.n_ctx:
            raise NativeError(f"context is full: {self._n_past} + {len(tokens)} tokens > n_ctx {self.n_ctx}")
        probe = [int(t) for t in probe] if probe else []
        if probe and len(probe) >= self.n_ubatch:
            raise ValueError(f"a probe of {len(probe)} tokens leaves no room in a ubatch of {self.n_ubatch}")
        if probe and len(tokens) > self.n_ubatch - len(probe) and self.set_prompt_probing(True):
            step = self.n_ubatch - len(probe)
            try:
                for start in range(0, len(tokens), step):
                    self._decode_batches(tokens[start:start + step], all_logits, last_logits)
                    if start + step < len(tokens) and self._n_past + len(probe) <= self.n_ctx:
                        self.probe_prompt(probe)
            finally:
                self.set_prompt_probing(False)
        else:
            self._decode_batches(tokens, all_logits, last_logits)

    def _decode_batches(self, tokens: list[int], all_logits: bool, last_logits: bool = True) -> None:
        batch = self._batch
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            last_chunk = start + self.n_batch >= len(tokens)
            batch.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = self._n_past + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if all_logits or (last_logits and last_chunk and i == len(chunk) - 1) else 0
            mark = _native.log_mark()
            rc = self._lib.llama_decode(self.ptr, batch)
            if rc != 0:
                detail = _native.log_since(mark) or "no detail logged"
                raise NativeError(f"llama_decode failed (code {rc}) at position {self._n_past}: {detail}")
            self._n_past += len(chunk)

    def decode_sequences(self, tokens_by_seq: Mapping[int, Sequence[int]], *,
                         partial: Collection[int] = ()) -> dict[int, int]:
        """Append tokens to several sequences in one llama_decode call, at most n_batch tokens in all (a context
        created with ``n_seq_max`` > their ids); each sequence continues at its own next position. Returns, per
        sequence, the batch index of its last token, for `logits(i)`. With a plan every sequence has caches of its
        own, each with the plan's budgets; a prompt takes ubatches of its own, while decode steps (one token of a
        sequence that is generating) share ubatches (`shared_ubatches`): all of a call, or those listed before its
        prompts (llama-server's order). The sequences in `partial` get no logits:
        their tokens are a piece of a prompt that goes on in a later call (as a server feeds a slot's prompt
        under load)."""
        items = []
        for seq, toks in tokens_by_seq.items():
            if not toks:
                raise ValueError(f"sequence {seq} has no tokens")
            start = self.pos_max(seq) + 1
            items += [(tok, start + i, seq, i == len(toks) - 1 and seq not in partial) for i, tok in enumerate(toks)]
        if len(items) > self.n_batch:
            raise ValueError(f"{len(items)} tokens do not fit one batch of {self.n_batch}")
        batch = self._batch
        batch.n_tokens = len(items)
        out: dict[int, int] = {}
        for i, (tok, pos, seq, last) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = tok, pos, 1, seq
            batch.logits[i] = 1 if last else 0
            if last:
                out[seq] = i
        mark = _native.log_mark()
        rc = self._lib.llama_decode(self.ptr, batch)
        if rc != 0:
            detail = _native.log_since(mark) or "no detail logged"
            raise NativeError(f"llama_decode failed (code {rc}) for sequences {sorted(tokens_by_seq)}: {detail}")
        self._restored_logits = None
        if 0 in tokens_by_seq:
            self._n_past = self.pos_max() + 1
        return out

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits of output `i` of the last decode() (-1: the last token); a copy."""
        if self._restored_logits is not None and i == -1:
            return self._restored_logits.copy()
        ptr = self._lib.llama_get_logits_ith(self.ptr, i)
        if ptr == ffi.NULL:
            raise NativeError(f"no logits for output {i}")
        n_vocab = self.model.n_vocab
        return np.frombuffer(ffi.buffer(ptr, 4 * n_vocab), dtype=np.float32).copy()

    def generate_tokens(self, prompt_tokens: Sequence[int], *, max_tokens: int = 128,
                        sampler: SamplerSettings | None = None, stop_at_eog: bool = True,
                        probe: Sequence[int] | None = None) -> Iterator[int]:
        """Decode the prompt (with `probe`: see `decode`), then yield up to `max_tokens` sampled token ids.

        An empty prompt continues from the logits already there (after a decode or `load_state_bytes`).
        """
        settings = sampler or SamplerSettings()
        chain = settings.build(self._lib, self.model._vocab, self.n_ctx)
        try:
            if settings.penalizes:
                for tok in prompt_tokens:
                    self._lib.llama_sampler_accept(chain, int(tok))
            if prompt_tokens or self._pending:
                # a prompt, or only the token sampled last time (a generation that goes on)
                self.decode(prompt_tokens, probe=probe, phase="prefill" if prompt_tokens else "decode")
            elif self._n_past == 0:
                raise ValueError("generate_tokens() needs prompt tokens in an empty context")
            for i in range(max_tokens):
                if self._restored_logits is not None:
                    tok = self._sample_from(chain, self._restored_logits)
                else:
                    tok = self._lib.llama_sampler_sample(chain, self.ptr, -1)
                if stop_at_eog and self.model.is_eog(tok):
                    return
                if i + 1 < max_tokens:
                    self.decode([tok], phase="decode")
                else:
                    self._pending = [tok]
                yield tok
        finally:
            self._lib.llama_sampler_free(chain)

    def _sample_from(self, chain, logits: np.ndarray) -> int:
        """What llama_sampler_sample does, on logits held here (after `restore`)."""
        arr, cur = _token_data_array(logits)
        self._lib.llama_sampler_apply(chain, cur)
        if cur.selected < 0 or cur.selected >= cur.size:
            raise NativeError("the sampler selected no token")
        tok = int(cur.data[cur.selected].id)
        self._lib.llama_sampler_accept(chain, tok)
        return tok

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, seed: int = 0xFFFFFFFF,
                 stream: bool = False, stop_at_eog: bool = True, probe: Sequence[int] | int | None = None,
                 sampler: SamplerSettings | None = None, **penalties):
        """Generate a continuation of `prompt` (text or token ids) after the tokens already in the context.

        `probe`: token ids, or n for the prompt's last n tokens: they steer what a streaming prompt keeps (`decode`).
        `penalties`: `SamplerSettings`' repetition penalty and DRY fields (`repeat_penalty=1.1`, `dry_multiplier=0.8`);
        `sampler`: complete settings instead of the sampling arguments.
        Returns the text, or with stream=True an iterator of text pieces (UTF-8 safe).
        """
        tokens = self.model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if isinstance(probe, int):
            probe = tokens[-probe:] if probe > 0 else None
        if sampler is not None and penalties:
            raise ValueError("give either sampler= or the sampling arguments, not both")
        settings = sampler or SamplerSettings(temperature, top_k, top_p, min_p, seed, **penalties)
        pieces = self._pieces(self.generate_tokens(tokens, max_tokens=max_tokens, sampler=settings,
                                                   stop_at_eog=stop_at_eog, probe=probe))
        return pieces if stream else "".join(pieces)

    def _pieces(self, token_iter: Iterator[int]) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        for tok in token_iter:
            text = decoder.decode(self.model.token_to_piece(tok))
            if text:
                yield text
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail

    # ---- PolyKV -------------------------------------------------------------------------------------------
    @property
    def polykv_active(self) -> bool:
        return bool(self._lib.llama_polykv_is_active(self.ptr))

    def set_phase(self, phase: str | None) -> None:
        """The phase the next ubatches are evicted for, until set again: "prefill", "decode", or None (guessed per
        ubatch: one token with logits after a ubatch with logits is a decode step). `decode(..., phase=...)` sets it for one call."""
        code = {None: -1, "prefill": 0, "decode": 1}.get(phase)
        if code is None:
            raise ValueError(f"phase {phase!r}: expected 'prefill', 'decode' or None")
        if self._lib.llama_polykv_set_phase(self.ptr, code) != 0:
            raise NativeError(ffi.string(self._lib.llama_polykv_last_error()).decode("utf-8", "replace"))

    def decode_timing(self) -> tuple[float, int]:
        """(milliseconds, steps): host time the evictions after decode steps took since the context was created
        (reading the scores, selecting, freeing and compacting cells; not the wait for the computation), and the
        decode steps it covers. Without a plan: (0.0, 0)."""
        ms = ffi.new("double *")
        n = ffi.new("int64_t *")
        if self._lib.llama_polykv_get_decode_timing(self.ptr, ms, n) != 0:
            return 0.0, 0
        return float(ms[0]), int(n[0])

    def shared_ubatches(self) -> tuple[int, int]:
        """(ubatches, tokens): the ubatches that held decode steps of several sequences since the context was
        created (one token per sequence, as `decode_sequences` of generated tokens or llama-server's slots send,
        also ahead of other sequences' prompts in the same batch, shares ubatches of up to 16 sequences: the weights
        are read once, attention runs per sequence on its own caches), and the tokens in them. (0, 0) with one
        sequence or without a plan."""
        n = ffi.new("int64_t[2]")
        if self._lib.llama_polykv_get_shared_ubatches(self.ptr, n, n + 1) != 0:
            return 0, 0
        return int(n[0]), int(n[1])

    def device_repacks(self) -> int:
        """Evictions of per-head layers whose cache moves ran as one graph on the caches' own device (a GPU, an RPC
        server: one round trip instead of two per moved token, layer and tensor) since the context was created; 0
        on host memory unless ``LLAMA_POLYKV_DEVICE_REPACK=1``, or without a plan."""
        n = ffi.new("int64_t *")
        if self._lib.llama_polykv_get_device_repacks(self.ptr, n) != 0:
            return 0
        return int(n[0])

    def set_prompt_probing(self, on: bool) -> bool:
        """FINCH probing (chunked prefill with a plan): while on, each prompt ubatch keeps its tokens until
        `probe_prompt` scores them (or, without a probe, until the next prompt ubatch evicts by the chunk's own last
        tokens, as without probing), and the prompt is compressed to the budget when decoding starts. Returns False
        where it does not apply (no plan, exact prefill). `decode(..., probe=...)` turns it on and off itself."""
        if not self.polykv_active:
            return False
        return self._lib.llama_polykv_set_prompt_probing(self.ptr, on) == 0

    def probe_prompt(self, probe: Sequence[int]) -> int:
        """While probing: decode `probe` after the prompt fed so far, rank the prompt by the attention its queries
        give it, remove it, and bring every layer to its streaming budget. Needs len(probe) free cells: feed the
        prompt in pieces of at most n_ubatch - len(probe) tokens. Returns the number of cells freed."""
        probe = [int(t) for t in probe]
        buf = ffi.new("llama_token[]", max(1, len(probe)))
        buf[0:len(probe)] = probe
        mark = _native.log_mark()
        n = self._lib.llama_polykv_probe_prompt(self.ptr, buf, len(probe))
        if n < 0:
            detail = _native.log_since(mark)
            msg = ffi.string(self._lib.llama_polykv_last_error()).decode("utf-8", "replace")
            raise NativeError(msg + (f" ({detail})" if detail else ""))
        return int(n)

    def compress_prompt(self) -> int:
        """In exact/portable prefill or with a prefill slack: compress the prompt fed so far now (each layer to
        its prefill budget)
        instead of at the first decode step, e.g. before a question that must not steer the selection.
        Returns the number of cells freed."""
        n = self._lib.llama_polykv_compress_prompt(self.ptr)
        if n < 0:
            raise NativeError(ffi.string(self._lib.llama_polykv_last_error()).decode("utf-8", "replace"))
        return int(n)

    def compress_prompt_kvzip(self, prompt_tokens: Sequence[int], *, prefix: Sequence[int] | None = None,
                              chunk: int | None = None) -> int:
        """KVzip (Kim et al. 2025): score the prompt in the cache by a reconstruction pass, then compress it.

        For plans whose prefill pattern is ``kvzip``, in exact/portable prefill, after the prompt and before the
        first generated token. The model reads ``prefix`` (default: `Model.kvzip_prefix()`, "repeat the previous
        context" and the assistant's header) and the prompt's tokens again, ``chunk`` tokens at a time after the
        prompt (default: as many as n_ctx leaves room for; a chunk after the first starts with the 8 tokens
        before it); each prompt token keeps the largest attention a reconstruction query gave it; the
        reconstruction tokens leave the cache after each chunk. The prompt's logits are kept for the next
        token. Costs about one more prefill of the prompt. Returns the number of cells freed.
        """
        return self._kvzip_pass("compress_prompt_kvzip", prompt_tokens, prefix, chunk)

    def score_prompt_kvzip(self, prompt_tokens: Sequence[int], *, prefix: Sequence[int] | None = None,
                           chunk: int | None = None) -> None:
        """KVzip's reconstruction pass alone (arguments as `compress_prompt_kvzip`): the prompt is scored and stays
        whole until `compress_prompt()` or the first decode step compresses it. A `snapshot()` taken now carries the
        scores: restored into a portable context with any plan (another budget, other KVzip layers), its
        `compress_prompt()` keeps what that plan's own pass would keep, so one pass serves many plans."""
        self._kvzip_pass("score_prompt_kvzip", prompt_tokens, prefix, chunk)

    def _kvzip_pass(self, name: str, prompt_tokens: Sequence[int], prefix: Sequence[int] | None,
                    chunk: int | None) -> int:
        tokens = [int(t) for t in prompt_tokens]
        if self._pending:
            raise NativeError(f"{name}: a sampled token is pending; call it right after the prompt")
        if len(tokens) != self._n_past:
            raise NativeError(f"{name}: give the prompt's {self._n_past} tokens (got {len(tokens)})")
        pre = list(prefix) if prefix is not None else self.model.kvzip_prefix()
        room = self.n_ctx - len(tokens) - len(pre)
        n_chunk = min(chunk or room, room, len(tokens))
        if n_chunk < 1:
            raise NativeError(f"{name}: n_ctx {self.n_ctx} leaves no room for a reconstruction chunk "
                              f"after {len(tokens)} prompt and {len(pre)} prefix tokens")
        last = self.logits() if self._n_past else None
        pre_buf = ffi.new("llama_token[]", max(1, len(pre)))
        pre_buf[0:len(pre)] = pre
        tok_buf = ffi.new("llama_token[]", max(1, len(tokens)))
        tok_buf[0:len(tokens)] = tokens
        mark = _native.log_mark()
        fn = getattr(self._lib, f"llama_polykv_{name}")
        n = fn(self.ptr, pre_buf, len(pre), tok_buf, len(tokens), n_chunk)
        if n < 0:
            detail = _native.log_since(mark)
            msg = ffi.string(self._lib.llama_polykv_last_error()).decode("utf-8", "replace")
            raise NativeError(msg + (f" ({detail})" if detail else ""))
        self._restored_logits = last
        return int(n)

    def kv_layer_stats(self) -> list[LayerStats]:
        """Per-layer KV memory: capacity, used cells, evictions, bytes (empty without a plan)."""
        return layer_stats(self._lib, self.ptr)

    def kept_positions(self, layer: int, head: int | None = None, seq: int = 0) -> list[int]:
        """Positions layer `layer` keeps now, sorted (raises without a plan).

        ``head``: the positions one KV head keeps. A layer that selects per head keeps one set per KV head;
        without ``head`` it returns their union. A layer that selects per layer gives its one set for any head.
        ``seq``: the sequence (contexts of several sequences keep one cache per sequence).
        """
        if seq != 0:
            h = -1 if head is None else int(head)
            n = self._lib.llama_polykv_seq_get_kept_positions(self.ptr, seq, layer, h, ffi.NULL, 0)
            if n < 0:
                raise NativeError(ffi.string(self._lib.llama_polykv_last_error()).decode("utf-8", "replace"))
            buf = ffi.new("llama_pos[]", max(n, 1))
            self._lib.llama_polykv_seq_get_kept_positions(self.ptr, seq, layer, h, buf, n)
            return list(buf[0:n])
        if head is None:
            n = self._lib.llama_polykv_get_kept_positions(self.ptr, layer, ffi.NULL, 0)
        else:
            n = self._lib.llama_polykv_get_kept_positions_head(self.ptr, layer, head, ffi.NULL, 0)
        if n < 0:
            if not self.polykv_active:
                raise NativeError("no PolyKV plan is active in this context")
            raise NativeError(f"layer {layer} has no KV head {head}")
        buf = ffi.new("llama_pos[]", max(n, 1))
        if head is None:
            self._lib.llama_polykv_get_kept_positions(self.ptr, layer, buf, n)
        else:
            self._lib.llama_polykv_get_kept_positions_head(self.ptr, layer, head, buf, n)
        return list(buf[0:n])

    def kept_scores(self, layer: int, head: int | None = None) -> np.ndarray:
        """The score layer `layer`'s prefill pattern ranks each kept token by, in the order of
        `kept_positions(layer, head)` (float32): H2O's accumulated attention, SnapKV's pooled window attention,
        TOVA's last row, KVzip's reconstruction maximum, minus the key norm for K-norm; before sinks and windows
        are protected. ``head``: one KV head's scores (per-head layers, and every layer of a portable context);
        None: the layer's. Raises where the layer keeps no such scores."""
        h = -1 if head is None else int(head)
        n = self._lib.llama_polykv_get_kept_scores(self.ptr, layer, h, ffi.NULL, 0)
        if n < 0:
            if not self.polykv_active:
                raise NativeError("no PolyKV plan is active in this context")
            raise NativeError(f"layer {layer} keeps no {'layer' if head is None else f'head {head}'} scores")
        buf = ffi.new("float[]", max(n, 1))
        self._lib.llama_polykv_get_kept_scores(self.ptr, layer, h, buf, n)
        return np.frombuffer(ffi.buffer(buf, 4 * n), dtype=np.float32).copy()

    def layer_per_head(self, layer: int) -> bool:
        """True if layer `layer` keeps one token set per KV head (a plan phase with ``selection: head``)."""
        r = self._lib.llama_polykv_layer_per_head(self.ptr, layer)
        if r < 0:
            raise NativeError(f"no PolyKV plan is active in this context, or layer {layer} has no KV cache")
        return r == 1

    def perf(self) -> dict[str, float]:
        data = self._lib.llama_perf_context(self.ptr)
        return {
            "prompt_ms": data.t_p_eval_ms, "prompt_tokens": data.n_p_eval,
            "eval_ms": data.t_eval_ms, "eval_tokens": data.n_eval, "graphs_reused": data.n_reused,
        }
