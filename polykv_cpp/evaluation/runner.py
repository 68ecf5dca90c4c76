"""The evaluation sweep: methods x budgets x protocols over tasks, perplexity/KL and LongBench.

One call of `run_eval(config)` loads the model once, builds every sample once, runs FullKV, the
single-pattern baselines, PyramidKV and the calibrated plan(s) at each average budget, scores them and writes
`results.json`, `results.md` and PNG plots into `config.out_dir` (see `report.py`).

What is reused (and reported under `reuse` in the JSON):

* the model (loaded once) and one context per (method, budget), cleared between samples;
* tokenization: every sample is tokenized once (part 1 = instruction + context, part 2 = question + answer
  prefix); all runs and both protocols feed the same token ids;
* FullKV: one run per sample serves every budget and both protocols (without eviction the two protocols
  compute the same cache: they feed the same tokens, only the batch split differs);
* nothing evicted = FullKV: a (method, budget) whose every layer keeps at least all tokens of a sample
  (prompt + answer) is not run for that sample; the FullKV result is copied and marked `reused_from`;
* prefill state shared by the two protocols: with chunked prefill the cache evicts after every ubatch, so the
  cache after the last full ubatch of part 1 (`P = floor(len(part1) / n_ubatch) * n_ubatch` tokens) is the
  same in both protocols. It is computed once, saved (`state_bytes`), and the second protocol restarts from it
  (`load_state_bytes`); only the remaining `len(part1) - P` tokens and the question are computed twice.
* perplexity: the FullKV log-probabilities of the scored tokens are computed once per text and length and
  kept in memory for the KL of every other run.

Results are saved after every (method, budget) and every perplexity unit; `resume=True` continues an
interrupted run with the same configuration.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polykv_cpp.errors import PlanError, PolyKVError
from polykv_cpp.evaluation import scoring, tasks as T
from polykv_cpp.plan import uses_kvzip

FULLKV = "fullkv"
#: uniform single-pattern baselines: one token set per layer, and the per-KV-head variants ("snapkv-head": every
#: KV head keeps its own budget tokens by its own scores; the papers' own granularity)
LAYER_BASELINES = ("streamingllm", "h2o", "snapkv", "tova", "knorm", "pyramidkv", "kvzip", "expected_attention")
HEAD_BASELINES = tuple(f"{m}-head" for m in ("h2o", "snapkv", "tova", "knorm", "pyramidkv", "kvzip",
                                             "expected_attention"))
#: the layer's budget split across its KV heads by score (Ada-KV); "adakv" is SnapKV's, kvpress's AdaKVPress default
ADAPTIVE_BASELINES = ("adakv",) + tuple(f"{m}-adaptive" for m in ("h2o", "snapkv", "tova", "knorm", "pyramidkv",
                                                                  "kvzip", "expected_attention"))
BASELINES = LAYER_BASELINES + HEAD_BASELINES + ADAPTIVE_BASELINES
DEFAULT_METHODS = (FULLKV, "streamingllm", "h2o", "snapkv", "tova", "knorm", "pyramidkv", "polykv")
#: cells kept free after the longest sample when a method uses KVzip: its reconstruction pass feeds the prompt
#: again in chunks of (at most) this many tokens after it
KVZIP_ROOM = 512


def is_baseline(method: str) -> bool:
    """A uniform baseline: a name of :data:`BASELINES`, optionally with another pooling kernel (``snapkv@23``) and
    budgets split by span (``snapkv@15+4~span``, :meth:`polykv_cpp.plan.Plan.span_split`)."""
    from polykv_cpp import plan as plan_mod

    method = plan_mod.split_span(method)[0]
    if method.partition("@")[0] not in BASELINES:
        return False
    try:
        plan_mod.split_method(method)
    except PlanError:
        return False
    return True


PROTOCOLS = ("query-agnostic", "query-aware")
PREFILL_MODES = ("exact", "chunked")
PREFILL_TEXT = {
    "exact": "exact (compress once): every method keeps the whole prompt and compresses it once, when the answer "
             "starts (query-aware) or right after the context (query-agnostic), as SnapKV, PyramidKV and kvpress "
             "do; the prompt of a sample is prefilled once and its cache and attention statistics are shared by "
             "every method and budget (portable state)",
    "chunked": "chunked (the runtime's default): the prompt streams through caches of budget + one ubatch and is "
               "compressed after every ubatch; every (method, budget) prefills every sample itself",
}
SLACK_TEXT = ("; with prefill slack {s:g}: while the prompt streams each layer keeps up to {s:g} x its budget, "
              "and the prompt is compressed to the budget when it ends (query-aware: when the answer starts, the "
              "question in the observation window; query-agnostic: after the context, before the question)")
PROBE_TEXT = ("; query-aware prompts are probed by their last {n} tokens (the question): after every chunk of "
              "n_ubatch - {n} tokens they are decoded after it, score it, and leave the cache (run's default)")
# the portable state keeps the attention rows of this many last queries (native POLYKV_PORTABLE_OBS_WINDOW)
PORTABLE_OBS_WINDOW = 64
PROTOCOL_TEXT = {
    "query-aware": "the question is part of the compressed prompt (one prefill of context + question), as in "
                   "LongBench prompts; SnapKV-like patterns see the question in their observation window",
    "query-agnostic": "the context is prefilled and compressed first, then the question is fed as a second "
                      "batch (evicted to the budget when the answer starts), then the answer is generated; what a "
                      "chat user with a long document gets",
    "teacher-forced": "perplexity/KL: prefill of length - ppl_tokens tokens (compressed as the prefill mode "
                      "says), then ppl_tokens tokens fed one at a time (decode phase) and scored",
}
BUDGET_TEXT = ("budget = average tokens kept per layer (sum over layers = n_layer x budget), sinks and windows "
               "included; each (method, budget) also lists its KV bytes and the budget as a share of the context")
RESULTS_FORMAT = "polykv-eval-results"
RESULTS_VERSION = 1


class EvalError(PolyKVError):
    pass


class _Unsupported(Exception):
    pass


@dataclass
class EvalConfig:
    model: str
    out_dir: str = "polykv-eval"
    plans: list[str] = field(default_factory=list)  # "[NAME=]FILE" (JSON sidecar or GGUF with a plan)
    plan_from_gguf: str = "auto"  # auto | yes | no: the plan stored in the model file, as method "polykv"
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    budgets: list[int] = field(default_factory=lambda: [128, 256, 512, 1024])
    lengths: list[int] = field(default_factory=lambda: [4096, 8192])
    tasks: list[str] = field(default_factory=lambda: list(T.RULER_TASKS))
    n_samples: int = 2
    protocols: list[str] = field(default_factory=lambda: list(PROTOCOLS))
    haystack: str | None = None  # None: each task's default (text for needles, noise for vt)
    ppl: bool = True
    ppl_texts: list[str] = field(default_factory=list)  # files/dirs; empty = builtin texts
    n_ppl_texts: int = 2
    ppl_tokens: int = 256
    longbench: list[str] = field(default_factory=list)
    longbench_dir: str | None = None
    longbench_samples: int = 5
    seed: int = 0
    n_gpu_layers: int = -1  # -1: all layers when the build has a GPU backend, else 0
    n_threads: int | None = None
    n_ctx: int | None = None  # None: the longest sample + answer, rounded up to 256
    n_batch: int = 2048
    n_ubatch: int = 512
    prefill: str = "exact"  # exact | chunked (see PREFILL_TEXT)
    prefill_slack: float | None = None  # chunked only: a streaming prompt keeps up to slack x budget per layer;
    # None: each plan's own (its prefill_slack, else 1)
    prompt_probe: int = 0  # chunked, query-aware: the prompt's last N tokens probe each chunk (FINCH); 0: off
    flash_attn: str = "auto"
    type_k: str = "f16"
    type_v: str = "f16"
    chat_template: str = "auto"  # auto | none | chatml | chatml-qwen | gemma | llama3
    max_new_tokens: int | None = None  # override of the per-task answer budgets
    reuse: bool = True  # False: recompute everything (the check that reuse changes nothing)
    resume: bool = False
    state_cache: str | None = None  # directory of prompt states kept across evaluations (exact prefill only)
    png: bool = True
    progress: bool = True

    def validate(self) -> None:
        if not self.budgets or any(b < 1 for b in self.budgets):
            raise EvalError("budgets must be positive integers")
        if not self.lengths or any(n < 16 for n in self.lengths):
            raise EvalError("lengths must be integers >= 16")
        bad = [p for p in self.protocols if p not in PROTOCOLS]
        if bad or not self.protocols:
            raise EvalError(f"unknown protocol(s) {bad} (known: {', '.join(PROTOCOLS)})")
        for t in self.tasks:
            if t not in T.RULER_TASKS:
                raise EvalError(f"unknown task {t!r} (known: {', '.join(T.RULER_TASKS)})")
        for t in self.longbench:
            if t not in T.LONGBENCH_TASKS:
                raise EvalError(f"unknown LongBench task {t!r} (known: {', '.join(T.LONGBENCH_TASKS)})")
        if self.n_samples < 0 or self.ppl_tokens < 1:
            raise EvalError("--samples must be >= 0 and --ppl-tokens >= 1")
        if self.ppl and self.ppl_tokens >= min(self.lengths):
            raise EvalError(f"--ppl-tokens {self.ppl_tokens} must be below the shortest length {min(self.lengths)}")
        if self.prefill not in PREFILL_MODES:
            raise EvalError(f"unknown prefill mode {self.prefill!r} (known: {', '.join(PREFILL_MODES)})")
        if self.plan_from_gguf not in ("auto", "yes", "no"):
            raise EvalError("plan_from_gguf must be auto, yes or no")
        if self.prefill_slack is not None and not self.prefill_slack >= 1.0:
            raise EvalError(f"--prefill-slack must be a number >= 1 (got {self.prefill_slack})")
        if self.prefill_slack not in (None, 1.0) and self.prefill != "chunked":
            raise EvalError("--prefill-slack needs --prefill chunked (exact keeps the whole prompt anyway)")
        if self.prompt_probe < 0 or (self.prompt_probe and self.prefill != "chunked"):
            raise EvalError("--prompt-probe N needs N >= 0 and --prefill chunked (exact keeps the whole prompt)")
        if self.prompt_probe >= self.n_ubatch:
            raise EvalError(f"--prompt-probe {self.prompt_probe} must be below the ubatch ({self.n_ubatch})")
        if self.state_cache and self.prefill != "exact":
            raise EvalError("--state-cache needs --prefill exact (chunked prefill has no shareable prompt state)")
        if self.chat_template != "auto" and self.chat_template not in T.CHAT_FORMATS:
            raise EvalError(f"unknown chat template {self.chat_template!r} "
                            f"(auto, {', '.join(T.CHAT_FORMATS)})")


@dataclass
class Run:
    """One (method, budget): the plan it sets (None = FullKV, stock cache)."""

    method: str
    budget: int | None
    plan: Any = None
    status: str = "pending"  # ok | skipped: ... | unsupported: ...
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.method}@{'full' if self.budget is None else self.budget}"


def read_answer(tokens: Iterable[int], model: Any, sample: T.Sample) -> tuple[str, int]:
    """The answer text of generated `tokens` (our detokenizer) and how many were read: reading stops at the
    first line break after the answer's first non-blank text when `sample.stop_at_newline`."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    text, n = "", 0
    for tok in tokens:
        n += 1
        text += dec.decode(model.token_to_piece(tok))
        if sample.stop_at_newline and "\n" in text.lstrip():
            break
    return text + dec.decode(b"", final=True), n


def record_key(r: dict[str, Any]) -> str:
    return f"{r['kind']}/{r['task']}/{r['length']}/{r['index']}/{r['protocol']}/{r['method']}/{r['budget']}"


# --------------------------------------------------------------------------------------------- helpers


def resolve_model(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    from polykv_cpp import models

    if name_or_path in models.MODELS:
        return models.fetch(name_or_path, progress=True)
    raise EvalError(f"model not found: {name_or_path} (a GGUF path, or one of: {', '.join(models.MODELS)})")


def gpu_layers(requested: int) -> tuple[int, str]:
    from polykv_cpp import _native

    has_gpu = _native.has_gpu()
    if requested < 0:
        n = 999 if has_gpu else 0
    else:
        n = requested
    if n > 0 and has_gpu:
        return n, f"GPU offload (n_gpu_layers={n})"
    return n, "CPU" + (" (no GPU backend in this build; -ngl ignored)" if n > 0 else "")


def _plan_hash(plan: Any) -> str | None:
    if plan is None:
        return None
    d = plan.to_dict()
    d.pop("provenance", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def keeps_everything(plan: Any, n_tokens: int, n_ctx: int) -> bool:
    """True when no layer of `plan` can evict anything in a sequence of `n_tokens` tokens (None = FullKV)."""
    if plan is None:
        return True
    return all(min(plan.resolved_budgets(ph, n_ctx)) >= n_tokens for ph in ("prefill", "decode"))


def _file_id(p: Path) -> dict[str, Any]:
    st = p.stat()
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(1 << 20))
    return {"path": str(p.resolve()), "size": st.st_size, "sha256_first_mib": h.hexdigest()[:16]}


class PromptStateCache:
    """Portable prompt states on disk, so that later evaluations of the same samples skip their prefill.

    A file holds the FullKV portable state after part 1 and after part 2 of one prompt (what the two protocols
    load) with the last logits. Its name hashes the prompt's token ids and `identity` (model file, library build,
    context size, batch sizes, cache types, flash attention, GPU layers), so a state is only loaded into a context
    that would have computed it. Size: the FullKV cache of the prompt plus the attention statistics, twice (about
    150 MB per 4K prompt of Qwen2.5-Coder-0.5B).

    KVzip's scored states (:meth:`load_scored`) live beside them: the prompt after its reconstruction pass, with
    the scores every KVzip plan compresses by, named by the tokens, the reconstruction prefix and the chunk size as
    well, so later evaluations of other KVzip plans skip the pass too (about 75 MB per 4K prompt).
    """

    def __init__(self, directory: Path, identity: dict[str, Any]):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.identity = json.dumps(identity, sort_keys=True, default=_json_default)

    def _named(self, key: bytes, suffix: str = "") -> Path:
        h = hashlib.sha256(self.identity.encode())
        h.update(key)
        return self.dir / f"{h.hexdigest()[:32]}{suffix}.npz"

    def path(self, part1: Sequence[int], part2: Sequence[int]) -> Path:
        return self._named(_ids(part1) + b"|" + _ids(part2))

    def scored_path(self, prompt: Sequence[int], prefix: Sequence[int], chunk: int) -> Path:
        return self._named(b"kvzip|" + _ids(prefix) + f"|{int(chunk)}|".encode() + _ids(prompt), "-kvzip")

    def load(self, part1: Sequence[int], part2: Sequence[int]) -> tuple[Any, Any] | None:
        return self._load(self.path(part1, part2), ("s1", "s2"))  # type: ignore[return-value]

    def save(self, part1: Sequence[int], part2: Sequence[int], s1: Any, s2: Any) -> None:
        self._save(self.path(part1, part2), {"s1": s1, "s2": s2})

    def load_scored(self, prompt: Sequence[int], prefix: Sequence[int], chunk: int) -> Any | None:
        """The prompt's state after KVzip's reconstruction pass (`Context.score_prompt_kvzip`), or None."""
        got = self._load(self.scored_path(prompt, prefix, chunk), ("scored",))
        return got[0] if got else None

    def save_scored(self, prompt: Sequence[int], prefix: Sequence[int], chunk: int, snap: Any) -> None:
        self._save(self.scored_path(prompt, prefix, chunk), {"scored": snap})

    @staticmethod
    def _load(path: Path, keys: tuple[str, ...]) -> tuple[Any, ...] | None:
        from polykv_cpp.api import Snapshot

        if not path.exists():
            return None
        try:
            with np.load(path) as z:
                return tuple(Snapshot(z[f"{k}_state"].tobytes(), z[f"{k}_logits"] if z[f"{k}_has_logits"] else None,
                                      [int(t) for t in z[f"{k}_pending"]])
                             for k in keys)
        except (OSError, ValueError, KeyError):
            return None  # a damaged or partial file: compute it again and overwrite it

    @staticmethod
    def _save(path: Path, snaps: dict[str, Any]) -> None:
        arrays: dict[str, np.ndarray] = {}
        for k, snap in snaps.items():
            arrays[f"{k}_pending"] = np.asarray(snap.pending, dtype=np.int64)
            arrays[f"{k}_state"] = np.frombuffer(snap.state, dtype=np.uint8)
            arrays[f"{k}_has_logits"] = np.asarray(snap.logits is not None)
            arrays[f"{k}_logits"] = np.zeros(0, np.float32) if snap.logits is None else snap.logits
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)


def _ids(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int64).tobytes()


class _Writer:
    """Atomic JSON writes of the partial results."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, data: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=_json_default))
        os.replace(tmp, self.path)


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


# ----------------------------------------------------------------------------------------------- runner


class Evaluator:
    """Holds the model, the samples and the records of one evaluation (see `run_eval`)."""

    def __init__(self, cfg: EvalConfig, log: Callable[[str], None] | None = None):
        cfg.validate()
        self.cfg = cfg
        self.log = log or (lambda msg: print(f"[polykv-cpp eval] {msg}", file=sys.stderr))
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.records: dict[str, dict[str, Any]] = {}
        self._resumed_runs: dict[tuple[Any, Any], dict[str, Any]] = {}  # runs of the results a resume loads
        self.notes: list[str] = []
        self.reuse = {"tokenization": "", "fullkv_protocols_shared": 0, "copied_from_fullkv": 0,
                      "prefix_tokens_shared": 0, "prefix_tokens_total": 0, "ppl_fullkv_reference_runs": 0,
                      "contexts_created": 0, "prompt_tokens_shared": 0, "prompt_tokens_reused": 0,
                      "prompt_states_loaded": 0, "kvzip_passes_shared": 0,
                      "kvzip_passes_loaded": 0}
        self.state_cache: PromptStateCache | None = None
        self.runs: list[Run] = []
        self.model = None
        self.samples: list[T.Sample] = []
        self.prompts: dict[str, T.Prompt] = {}
        self.ppl_units: list[tuple[T.TextSource, int]] = []
        self.longbench_status: dict[str, str] = {}
        self.t_start = time.time()

    # ---- set-up ---------------------------------------------------------------------------------------
    def setup(self) -> None:
        from polykv_cpp import plan as plan_mod

        cfg = self.cfg
        self.load_model()
        m = self.model

        # plans: calibrated plan(s) by name
        self.plans: dict[str, Any] = {}
        self.plan_origin: dict[str, str] = {}
        for spec in cfg.plans:
            name, sep, path = spec.partition("=")
            if not sep or "/" in name or name.endswith((".json", ".gguf")):
                name, path = "polykv", spec
            if name == FULLKV or is_baseline(name):
                raise EvalError(f"plan name {name!r} is taken by a baseline; use another NAME=FILE")
            self.plans[name] = plan_mod.load(path, n_layer=self.n_layer)
            self.plan_origin[name] = str(path)
        if "polykv" not in self.plans and cfg.plan_from_gguf != "no":
            text = m.meta(plan_mod.GGUF_KEY_PLAN)
            if text:
                self.plans["polykv"] = plan_mod.Plan.from_json(text).validate(n_layer=self.n_layer)
                self.plan_origin["polykv"] = f"{self.model_path} (polykv.plan key)"
            elif cfg.plan_from_gguf == "yes":
                raise EvalError(f"{self.model_path} holds no PolyKV plan (no polykv.plan key)")
        key = plan_mod.GGUF_KEY_PLAN_QUERY_AGNOSTIC
        if "polykv-query-agnostic" not in self.plans and cfg.plan_from_gguf != "no":
            text = m.meta(key)
            if text:
                self.plans["polykv-query-agnostic"] = plan_mod.Plan.from_json(text).validate(n_layer=self.n_layer)
                self.plan_origin["polykv-query-agnostic"] = f"{self.model_path} ({key} key)"
        methods = list(dict.fromkeys(cfg.methods + [n for n in self.plans if n not in cfg.methods]))
        for meth in methods:
            if meth != FULLKV and not is_baseline(meth) and meth not in self.plans:
                if meth == "polykv":
                    self.notes.append("polykv: no calibrated plan (give --plan FILE or a model with a "
                                      "polykv.plan key); the calibrated plan is not evaluated")
                    continue
                raise EvalError(f"unknown method {meth!r}: a baseline ({', '.join((FULLKV, *BASELINES))}; "
                                f"'@K' sets the pooling kernel of {', '.join(plan_mod.POOLED_PATTERNS)}, e.g. "
                                "snapkv@23; '~span' splits its budgets by what each layer attends to, e.g. "
                                "snapkv~span) or a plan name given with --plan NAME=FILE")
        self.methods = [x for x in methods if x == FULLKV or is_baseline(x) or x in self.plans]
        self.plan_methods = [x for x in self.methods if x in self.plans]

        self._build_samples()
        if cfg.state_cache:
            self.state_cache = PromptStateCache(Path(cfg.state_cache), self._state_identity())
        self._check_resume()
        self._make_runs()

    def load_model(self) -> None:
        """The model, its chat format and the prompt builder (the samples need only these)."""
        from polykv_cpp.api import Model

        cfg = self.cfg
        self.model_path = resolve_model(cfg.model)
        self.n_gpu_layers, self.device = gpu_layers(cfg.n_gpu_layers)
        self.model = Model(self.model_path, n_gpu_layers=self.n_gpu_layers)
        m = self.model
        self.n_layer = m.n_layer
        self.windows = m.attention_windows()
        self.arch = m.meta("general.architecture") or "?"
        chat = cfg.chat_template
        if chat == "auto":
            chat = T.detect_chat_format(m.meta("tokenizer.chat_template"))
        self.chat = chat
        self.builder = T.PromptBuilder(lambda t, a, p: m.tokenize(t, add_special=a, parse_special=p), chat)

    def build_samples(self) -> None:
        """Load the model and build every sample and prompt, as `setup` does, without plans or runs."""
        self.load_model()
        self._build_samples()

    def _measure(self, s: T.Sample) -> int:
        return self.builder.count(s) + s.max_new_tokens

    def _build_samples(self) -> None:
        cfg = self.cfg
        t0 = time.time()
        stop_nl = self.chat == "none"
        if cfg.n_samples and cfg.tasks:
            self.samples += T.generate_ruler(cfg.tasks, cfg.lengths, cfg.n_samples, cfg.seed, self._measure,
                                             haystack=cfg.haystack, max_new_tokens=cfg.max_new_tokens,
                                             stop_at_newline=stop_nl)
        if cfg.longbench:
            lb, self.longbench_status = T.load_longbench(cfg.longbench, cfg.longbench_samples,
                                                         data_dir=cfg.longbench_dir, length=max(cfg.lengths))
            for task, st in self.longbench_status.items():
                if st.startswith("unavailable"):
                    self.log(f"LongBench {task}: {st}")
                    self.notes.append(f"LongBench {task}: {st}")
            self.samples += lb
        for s in self.samples:
            self.prompts[s.key] = self.builder.build(s, max_prompt=s.length - s.max_new_tokens)
        n_tok = sum(p.n_prompt for p in self.prompts.values())
        self.reuse["tokenization"] = (f"{len(self.samples)} samples ({n_tok} prompt tokens) generated and tokenized "
                                      f"once in {time.time() - t0:.1f} s; every run and both protocols feed these "
                                      "same token ids")
        # perplexity units
        if cfg.ppl:
            srcs = T.user_texts(cfg.ppl_texts) if cfg.ppl_texts else T.builtin_texts()[:cfg.n_ppl_texts]
            if not srcs:
                self.notes.append("perplexity: no builtin text found on this machine; give --ppl-text FILE")
            self._ppl_tokens: dict[tuple[str, int], list[int]] = {}
            tok = self.builder.tokenize
            for src in srcs:
                for L in cfg.lengths:
                    ids = T.text_tokens(src, L, tok)
                    if ids is None:
                        self.notes.append(f"perplexity: text {src.name!r} is shorter than {L} tokens; skipped at "
                                          "that length")
                        continue
                    self._ppl_tokens[(src.name, L)] = ids
                    self.ppl_units.append((src, L))
        need = [p.n_prompt + s.max_new_tokens for s, p in ((s, self.prompts[s.key]) for s in self.samples)]
        need += [L for _, L in self.ppl_units]
        longest = max(need, default=max(cfg.lengths))
        if any("kvzip" in m for m in cfg.methods) or any(uses_kvzip(p) for p in getattr(self, "plans", {}).values()):
            longest += KVZIP_ROOM
        self.n_ctx = cfg.n_ctx or int(math.ceil((longest + 1) / 256) * 256)
        if self.n_ctx < longest:
            raise EvalError(f"--ctx-size {self.n_ctx} is below the longest sample ({longest} tokens)")

    def fingerprint(self) -> dict[str, Any]:
        cfg = self.cfg
        return {"model": _file_id(self.model_path), "seed": cfg.seed, "chat": self.chat, "prefill": cfg.prefill,
                **({"prefill_slack": cfg.prefill_slack} if cfg.prefill_slack not in (None, 1.0) else {}),
                **({"prompt_probe": cfg.prompt_probe} if cfg.prompt_probe else {}),
                "n_ubatch": cfg.n_ubatch,
                "n_batch": cfg.n_batch, "type_k": cfg.type_k, "type_v": cfg.type_v, "flash_attn": cfg.flash_attn,
                "haystack": cfg.haystack, "max_new_tokens": cfg.max_new_tokens, "ppl_tokens": cfg.ppl_tokens,
                "ppl_texts": sorted({s.name for s, _ in self.ppl_units}),
                "plans": {n: _plan_hash(p) for n, p in self.plans.items()}}

    def _state_identity(self) -> dict[str, Any]:
        """What a portable prompt state depends on besides the tokens: model, library and context layout."""
        from polykv_cpp import _native

        cfg = self.cfg
        lib = _native.lib_dir() / _native.LIB_NAMES.get(sys.platform, "libllama.so")
        return {"model": _file_id(self.model_path), "library": {**_file_id(lib), "mtime": lib.stat().st_mtime},
                "n_ctx": self.n_ctx, "n_batch": cfg.n_batch, "n_ubatch": cfg.n_ubatch, "type_k": cfg.type_k,
                "type_v": cfg.type_v, "flash_attn": cfg.flash_attn, "n_gpu_layers": self.n_gpu_layers}

    def _check_resume(self) -> None:
        path = self.out / "results.json"
        if not self.cfg.resume or not path.exists():
            return
        try:
            old = json.loads(path.read_text())
        except ValueError as e:
            raise EvalError(f"cannot resume: {path} is not JSON ({e})") from None
        fp, old_fp = self.fingerprint(), old.get("fingerprint", {})
        diff = sorted(k for k in set(fp) | set(old_fp) if k != "plans" and fp.get(k) != old_fp.get(k))
        # a plan may be added to a finished sweep (its runs are new); a plan name must keep its plan
        old_plans = old_fp.get("plans", {})
        diff += [f"plan {n!r}" for n, h in fp.get("plans", {}).items() if n in old_plans and old_plans[n] != h]
        if diff:
            raise EvalError(f"cannot resume: {path} was made with another configuration (differs in "
                            f"{', '.join(diff)}); use another --out or run without --resume")
        for r in old.get("records", []):
            self.records[record_key(r)] = r
        self._resumed_runs = {(r.get("method"), r.get("budget")): r for r in old.get("runs", [])}
        self.log(f"resuming: {len(self.records)} results loaded from {path}")

    def _make_runs(self) -> None:
        from polykv_cpp import plan as plan_mod

        cfg = self.cfg
        runs: list[Run] = []
        if FULLKV in self.methods:
            runs.append(Run(FULLKV, None, None))
        for meth in self.methods:
            if meth == FULLKV:
                continue
            for b in cfg.budgets:
                run = Run(meth, b)
                try:
                    name, by_span = plan_mod.split_span(meth)
                    base, selection, params = (plan_mod.split_method(name) if is_baseline(meth)
                                               else (meth, "layer", {}))
                    if base == "pyramidkv" and is_baseline(meth):
                        run.plan = plan_mod.pyramid_plan(self.n_layer, b, selection=selection, **params)
                    elif is_baseline(meth):
                        run.plan = plan_mod.method_plan(self.n_layer, name, b)
                    else:
                        run.plan = self._plan_at(self.plans[meth], b)
                        run.plan.validate(n_layer=self.n_layer)
                    if by_span and is_baseline(meth):
                        run.plan = self._plan_at(run.plan.span_split(self.windows, self.n_ctx), b)
                except PlanError as e:
                    run.status = f"skipped: {e}"
                runs.append(run)
        if cfg.prefill == "exact":
            for r in runs:
                w = max((pp.obs_window or 0 for lp in (r.plan.layers if r.plan else [])
                         for pp in (lp.prefill, lp.decode) if pp.pattern in plan_mod.OBS_WINDOW_PATTERNS), default=0)
                if w > PORTABLE_OBS_WINDOW and r.status == "pending":
                    r.status = (f"skipped: obs_window {w} > {PORTABLE_OBS_WINDOW} cannot share the prefill "
                                "(run with --prefill chunked)")
        for r in runs:  # KV bytes and seconds of runs finished before a resume
            old = self._resumed_runs.get((r.method, r.budget))
            if old:
                r.info.update({k: v for k, v in old.items() if k not in ("method", "budget", "status")})
        # one probe: can this model run a PolyKV plan at all (gemma3 and other archs are refused)?
        probe = next((r for r in runs if r.plan is not None and r.status == "pending"), None)
        if probe is not None:
            reason = self._probe_plan_support(probe.plan)
            if reason:
                msg = (f"the native PolyKV cache does not support this model ({self.arch}): {reason}. Only FullKV "
                       "is evaluated.")
                self.log(msg)
                self.notes.append(msg)
                for r in runs:
                    if r.plan is not None and r.status == "pending":
                        r.status = f"unsupported: {reason}"
        self.runs = runs

    def _plan_at(self, plan: Any, budget: int) -> Any:
        """`plan` at an average of `budget` tokens per layer: as written at its own budget (unless a sliding-window
        layer holds more than its window), else rescaled, sliding-window layers capped at their window."""
        over = any(w and b is not None and b > w for ph in ("prefill", "decode")
                   for b, w in zip(plan.token_budgets(ph), self.windows))
        if budget == plan.budget_avg and not over:
            return plan
        return plan.scaled(budget, full_charge=self.n_ctx, caps=self.windows)

    def _probe_plan_support(self, plan: Any) -> str | None:
        from polykv_cpp.errors import NativeError

        m = self.model
        try:
            m.set_plan(plan, prefill=self.cfg.prefill)  # the runs' own mode: no chunked-only warnings when exact
            ctx = m.context(n_ctx=min(self.n_ctx, 512), n_batch=64, n_ubatch=64, n_threads=self.cfg.n_threads)
            ctx.close()
            return None
        except (NativeError, PlanError) as e:
            return str(e).splitlines()[0][:300]
        finally:
            m.set_plan(None)

    # ---- contexts ------------------------------------------------------------------------------------
    def _context(self, run: Run, prefill: str = "chunked"):
        """A context for `run` (chunked), or a portable one (`prefill="portable"`; FullKV = a FullKV plan)."""
        from polykv_cpp import plan as plan_mod

        cfg = self.cfg
        plan = run.plan
        if plan is None and prefill == "portable":
            plan = plan_mod.uniform_plan(self.n_layer, plan_mod.FULLKV, self.n_ctx)
        slack = self._prefill_slack(run) if prefill == "chunked" else None
        self.model.set_plan(plan, prefill=prefill, prefill_slack=slack)
        if prefill == "chunked" and plan is not None:
            run.info["prefill_slack"] = slack
            if cfg.prompt_probe:
                run.info["prompt_probe"] = cfg.prompt_probe
        self.reuse["contexts_created"] += 1
        # swa_full False: FullKV's sliding-window layers hold what llama.cpp's tools give them (a plan's never more)
        return self.model.context(n_ctx=self.n_ctx, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch,
                                  n_threads=cfg.n_threads, flash_attn=cfg.flash_attn, type_k=cfg.type_k,
                                  type_v=cfg.type_v, swa_full=False)

    def _prefill_slack(self, run: Run) -> float:
        """The slack of `run`'s chunked prefill: --prefill-slack, else its plan's own, else 1."""
        from polykv_cpp.plan import chunked_prefill_slack

        return chunked_prefill_slack(run.plan, self.cfg.prefill_slack)

    def _kv_info(self, run: Run, ctx) -> None:
        from polykv_cpp.api import KV_TYPE_BYTES
        from polykv_cpp.cli import kv_cache_bytes

        stats = ctx.kv_layer_stats()
        full = kv_cache_bytes(self.model, self.n_ctx, KV_TYPE_BYTES[self.cfg.type_k], KV_TYPE_BYTES[self.cfg.type_v],
                              None if ctx.swa_full else ctx.n_ubatch)
        if stats:
            run.info["kv_bytes"] = int(sum(s.bytes for s in stats))
            run.info["kv_bytes_fullkv"] = int(sum(s.bytes_fullkv for s in stats))
        else:
            run.info["kv_bytes"] = full
            run.info["kv_bytes_fullkv"] = full

    # ---- generation ----------------------------------------------------------------------------------
    def _generate(self, ctx, tokens: list[int], sample: T.Sample, probe: list[int] | None = None) -> tuple[str, int]:
        it = ctx.generate_tokens(tokens, max_tokens=sample.max_new_tokens, probe=probe)
        try:
            return read_answer(it, self.model, sample)
        finally:
            it.close()

    def _record(self, sample: T.Sample, protocol: str, run: Run, pred: str, n_gen: int, **extra: Any
                ) -> dict[str, Any]:
        s = scoring.score(sample.metric, pred, sample.answers, first_line=sample.task in T.LONGBENCH_FIRST_LINE,
                          meta=sample.meta)
        r = {"kind": sample.kind, "task": sample.task, "length": sample.length, "index": sample.index,
             "protocol": protocol, "method": run.method, "budget": run.budget,
             "n_prompt": self.prompts[sample.key].n_prompt, "n_generated": n_gen, "prediction": pred,
             "answers": sample.answers, "score": s, **extra}
        self.records[record_key(r)] = r
        return r

    def _done(self, sample: T.Sample, protocol: str, run: Run) -> bool:
        k = f"{sample.kind}/{sample.task}/{sample.length}/{sample.index}/{protocol}/{run.method}/{run.budget}"
        return k in self.records

    def _fullkv_record(self, sample: T.Sample, protocol: str) -> dict[str, Any] | None:
        k = f"{sample.kind}/{sample.task}/{sample.length}/{sample.index}/{protocol}/{FULLKV}/None"
        return self.records.get(k)

    def _run_sample(self, ctx, run: Run, sample: T.Sample) -> None:
        cfg = self.cfg
        prompt = self.prompts[sample.key]
        todo = [p for p in cfg.protocols if not self._done(sample, p, run)]
        if not todo:
            return
        n_total = prompt.n_prompt + sample.max_new_tokens
        if run.plan is None:
            # FullKV: both protocols compute the same cache; one generation serves both
            ctx.clear()
            pred, n = self._generate(ctx, prompt.tokens, sample)
            for i, p in enumerate(todo):
                self._record(sample, p, run, pred, n, shared_with=todo[0] if i else None)
            self.reuse["fullkv_protocols_shared"] += len(todo) - 1
            return
        if cfg.reuse and keeps_everything(run.plan, n_total, self.n_ctx):
            src = [self._fullkv_record(sample, p) for p in todo]
            if all(src):
                for p, r in zip(todo, src):
                    self._record(sample, p, run, r["prediction"], r["n_generated"],  # type: ignore[index]
                                 reused_from=f"{FULLKV} (every layer keeps all {n_total} tokens)")
                self.reuse["copied_from_fullkv"] += len(todo)
                return
        p1, p2 = prompt.part1, prompt.part2
        P = (len(p1) // cfg.n_ubatch) * cfg.n_ubatch
        # a probed query-aware prompt streams differently from its first chunk on: nothing to share
        share = (cfg.reuse and cfg.prefill == "chunked" and len(todo) == 2 and P > 0
                 and cfg.n_batch % cfg.n_ubatch == 0 and not cfg.prompt_probe)
        self.reuse["prefix_tokens_total"] += len(p1) * len(todo)
        state = None
        if share:
            ctx.clear()
            ctx.decode(p1[:P], phase="prefill")
            state = ctx.state_bytes()
            self.reuse["prefix_tokens_shared"] += P
        for i, p in enumerate(todo):
            if share and i > 0:
                ctx.clear()
                ctx.load_state_bytes(state)  # type: ignore[arg-type]
            elif not share:
                ctx.clear()
            start = P if share else 0
            if p == "query-aware" and cfg.prefill == "exact" and uses_kvzip(run.plan):
                ctx.decode(p1[start:] + p2, phase="prefill")
                self._compress(ctx, run, p1 + p2)
                pred, n = self._generate(ctx, [], sample)
            elif p == "query-aware":
                probe = (p1 + p2)[-cfg.prompt_probe:] if cfg.prompt_probe else None
                pred, n = self._generate(ctx, p1[start:] + p2, sample, probe=probe)
            else:
                if len(p1) > start:
                    ctx.decode(p1[start:], phase="prefill")
                if cfg.prefill == "exact" or self._prefill_slack(run) > 1.0:
                    # the context ends before the question exists: compress it to the budget now
                    self._compress(ctx, run, p1)
                pred, n = self._generate(ctx, p2, sample)
            self._record(sample, p, run, pred, n, prefix_shared=P if share else 0)

    def _run_sample_shared(self, sample: T.Sample, runs: list[Run], bar) -> None:
        """Exact prefill: one prefill of the sample serves every (method, budget) and both protocols.

        A portable FullKV context prefills part 1 (state S1) and then part 2 (state S2) and generates FullKV's
        answer. Every other run loads S2 (query-aware: compressed at the first answer token) or S1 (query-agnostic:
        compressed now, then the question is fed) into a portable context with its own plan. The native portable
        state carries the cache and the attention statistics of every pattern, so this equals prefilling the
        sample in each run (tests/test_polykv_native.py checks kept positions and logits).
        """
        from polykv_cpp.errors import NativeError

        cfg = self.cfg
        prompt = self.prompts[sample.key]
        p1, p2 = prompt.part1, prompt.part2
        n_total = prompt.n_prompt + sample.max_new_tokens
        work = [(r, [p for p in cfg.protocols if not self._done(sample, p, r)]) for r in runs]
        work = [(r, todo) for r, todo in work if todo]
        if not work:
            bar.update(len(runs))
            return
        bar.update(len(runs) - len(work))
        full = next((r for r in self.runs if r.method == FULLKV), Run(FULLKV, None, None))
        t0 = time.time()
        cached = self.state_cache.load(p1, p2) if self.state_cache else None
        fk_todo = [p for p in cfg.protocols if not self._done(sample, p, full)]
        if cached:
            s1, s2 = cached
            self.reuse["prompt_states_loaded"] += 1
        self.reuse["prompt_tokens_shared"] += len(p1) + len(p2)
        if not cached or fk_todo:  # a loaded state whose FullKV answers are done needs no FullKV context
            src = self._context(full, prefill="portable")
            try:
                if cached:
                    src.restore(s2)
                else:
                    keep_both = self.state_cache is not None
                    src.decode(p1, phase="prefill")
                    s1 = src.snapshot() if keep_both or "query-agnostic" in cfg.protocols else None
                    src.decode(p2, phase="prefill")
                    s2 = src.snapshot() if keep_both or "query-aware" in cfg.protocols else None
                    if self.state_cache:
                        self.state_cache.save(p1, p2, s1, s2)  # type: ignore[arg-type]
                if fk_todo:
                    pred, n = self._generate(src, [], sample)
                    for i, p in enumerate(fk_todo):
                        self._record(sample, p, full, pred, n, shared_with=fk_todo[0] if i else None)
                    self.reuse["fullkv_protocols_shared"] += len(fk_todo) - 1
            finally:
                src.close()
        full.info["task_seconds"] = round(full.info.get("task_seconds", 0) + time.time() - t0, 2)
        scored: dict[str, Any] = {}  # protocol -> the prompt's state after one KVzip pass, shared by the KVzip runs
        for run, todo in work:
            bar.set_postfix_str(f"{run.key} {sample.task}@{sample.length}")
            if run.method == FULLKV:
                bar.update(1)
                continue
            t0 = time.time()
            if cfg.reuse and keeps_everything(run.plan, n_total, self.n_ctx):
                for p in todo:
                    r = self._fullkv_record(sample, p)
                    self._record(sample, p, run, r["prediction"], r["n_generated"],  # type: ignore[index]
                                 reused_from=f"{FULLKV} (every layer keeps all {n_total} tokens)")
                self.reuse["copied_from_fullkv"] += len(todo)
                bar.update(1)
                continue
            try:
                ctx = self._context(run, prefill="portable")
            except (NativeError, PlanError) as e:
                run.status = f"unsupported: {str(e).splitlines()[0][:300]}"
                bar.update(1)
                continue
            try:
                for p in todo:
                    if p == "query-aware":
                        if uses_kvzip(run.plan):
                            self._restore_scored(ctx, run, scored, p, s2, p1 + p2)
                            ctx.compress_prompt()
                        else:
                            ctx.restore(s2)  # type: ignore[arg-type]
                        pred, n = self._generate(ctx, [], sample)
                    else:
                        if uses_kvzip(run.plan):
                            self._restore_scored(ctx, run, scored, p, s1, p1)
                        else:
                            ctx.restore(s1)  # type: ignore[arg-type]
                        ctx.compress_prompt()
                        pred, n = self._generate(ctx, p2, sample)
                    self._record(sample, p, run, pred, n, prefill_shared=True)
                self.reuse["prompt_tokens_reused"] += len(p1) + (len(p2) if "query-aware" in todo else 0)
            finally:
                ctx.close()
            if not run.info.get("kv_bytes"):
                self._kv_info_chunked(run)
            run.info["task_seconds"] = round(run.info.get("task_seconds", 0) + time.time() - t0, 2)
            bar.update(1)

    def _restore_scored(self, ctx, run: Run, scored: dict[str, Any], protocol: str, state: Any,
                        prompt_tokens: list[int]) -> None:
        """Restore the sample's prompt into `ctx` scored by KVzip's reconstruction pass: the first KVzip run of the
        sample runs the pass (on the uncompressed prompt the pass sees the same cache under any plan, so its scores
        are the plan's own) and keeps the scored state; the others restore it."""
        if protocol in scored:
            ctx.restore(scored[protocol])
            self.reuse["kvzip_passes_shared"] += 1
            return
        prefix = self.model.kvzip_prefix()
        loaded = self.state_cache.load_scored(prompt_tokens, prefix, KVZIP_ROOM) if self.state_cache else None
        if loaded is not None:
            ctx.restore(loaded)
            scored[protocol] = loaded
            self.reuse["kvzip_passes_loaded"] += 1
            return
        ctx.restore(state)
        t0 = time.time()
        ctx.score_prompt_kvzip(prompt_tokens, prefix=prefix, chunk=KVZIP_ROOM)
        run.info["kvzip_seconds"] = round(run.info.get("kvzip_seconds", 0) + time.time() - t0, 2)
        scored[protocol] = ctx.snapshot()
        if self.state_cache:
            self.state_cache.save_scored(prompt_tokens, prefix, KVZIP_ROOM, scored[protocol])

    def _compress(self, ctx, run: Run, prompt_tokens: list[int]) -> None:
        """Compress the prompt in `ctx` now: by a KVzip reconstruction pass when the plan uses KVzip (its seconds
        are added to the run's ``kvzip_seconds``), else each layer by its prefill pattern."""
        if uses_kvzip(run.plan):
            t0 = time.time()
            ctx.compress_prompt_kvzip(prompt_tokens, chunk=KVZIP_ROOM)
            run.info["kvzip_seconds"] = round(run.info.get("kvzip_seconds", 0) + time.time() - t0, 2)
        else:
            ctx.compress_prompt()

    def _kv_info_chunked(self, run: Run) -> None:
        """KV bytes of `run` as the runtime allocates them (chunked prefill), from a context that decodes nothing."""
        with warnings.catch_warnings():  # chunked-only warnings (per-prompt budgets): this context decodes nothing
            warnings.simplefilter("ignore", UserWarning)
            ctx = self._context(run)
        try:
            self._kv_info(run, ctx)
        finally:
            ctx.close()

    # ---- perplexity ----------------------------------------------------------------------------------
    def _ppl_unit(self, src: T.TextSource, L: int, pending: list[Run], bar) -> None:
        from polykv_cpp.errors import NativeError

        cfg = self.cfg
        ids = self._ppl_tokens[(src.name, L)]
        M = cfg.ppl_tokens
        ctx_ids, eval_ids = ids[:L - M], ids[L - M:]
        ref: np.ndarray | None = None
        full_run = next((r for r in self.runs if r.method == FULLKV), None)
        exact = cfg.prefill == "exact"
        portable = exact and cfg.reuse
        shared: dict[str, Any] = {}

        def teacher_forced(run: Run) -> tuple[np.ndarray, list[float], list[int]]:
            # exact prefill: the FullKV reference (the first call) saves its prefilled state, every other run
            # loads it into its own portable context and is compressed at the first scored token
            t0 = time.time()
            try:
                ctx = self._context(run, prefill="portable" if portable else cfg.prefill if run.plan else "chunked")
            except (NativeError, PlanError) as e:
                run.status = f"unsupported: {str(e).splitlines()[0][:300]}"
                raise _Unsupported() from None
            try:
                if portable and "state" in shared:
                    ctx.restore(shared["state"])
                    self.reuse["prompt_tokens_reused"] += len(ctx_ids)
                else:
                    ctx.decode(ctx_ids, phase="prefill")
                    if portable:
                        shared["state"] = ctx.snapshot()
                        self.reuse["prompt_tokens_shared"] += len(ctx_ids)
                logps, nll, top = [], [], []
                for i, t in enumerate(eval_ids):
                    lp = scoring.log_softmax(ctx.logits())
                    logps.append(lp)
                    nll.append(float(-lp[t]))
                    top.append(int(np.argmax(lp)))
                    if i + 1 < len(eval_ids):
                        ctx.decode([t])
                if not run.info.get("kv_bytes"):
                    if cfg.prefill == "exact" and run.plan is not None:
                        self._kv_info_chunked(run)
                    else:
                        self._kv_info(run, ctx)
            finally:
                ctx.close()
                run.info["ppl_seconds"] = round(run.info.get("ppl_seconds", 0) + time.time() - t0, 2)
            return np.stack(logps), nll, top

        need_ref = any(r.method != FULLKV for r in pending) or (full_run in pending)
        if need_ref:
            fr = full_run or Run(FULLKV, None, None)
            ref, nll, top_ref = teacher_forced(fr)
            self.reuse["ppl_fullkv_reference_runs"] += 1
            self._ppl_record(src, L, fr, nll, np.zeros(len(nll)), np.ones(len(nll)))
            if full_run in pending:
                bar.update(1)
        for run in pending:
            if run.method == FULLKV:
                continue
            bar.set_postfix_str(f"ppl {src.name}@{L} {run.key}")
            if cfg.reuse and keeps_everything(run.plan, L, self.n_ctx):
                fk = self.records.get(f"ppl/{src.name}/{L}/0/teacher-forced/{FULLKV}/None")
                if fk:
                    r = dict(fk, method=run.method, budget=run.budget,
                             reused_from=f"{FULLKV} (every layer keeps all {L} tokens)")
                    self.records[record_key(r)] = r
                    self.reuse["copied_from_fullkv"] += 1
                    bar.update(1)
                    continue
            try:
                logp, nll, top = teacher_forced(run)
            except _Unsupported:
                bar.update(1)
                continue
            kl = scoring.kl_divergence(ref, logp)  # type: ignore[arg-type]
            agree = (np.argmax(ref, axis=-1) == np.asarray(top)).astype(float)  # type: ignore[arg-type]
            self._ppl_record(src, L, run, nll, kl, agree)
            bar.update(1)

    def _ppl_record(self, src: T.TextSource, L: int, run: Run, nll: Sequence[float], kl: np.ndarray,
                    agree: np.ndarray) -> None:
        r = {"kind": "ppl", "task": src.name, "length": L, "index": 0, "protocol": "teacher-forced",
             "method": run.method, "budget": run.budget, "n_context": L - len(nll), "n_scored": len(nll),
             "nll": float(np.mean(nll)), "ppl": scoring.perplexity(nll), "kl": float(np.mean(kl)),
             "kl_max": float(np.max(kl)), "top1": float(np.mean(agree)), "origin": src.origin}
        self.records[record_key(r)] = r

    # ---- main loop -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        from polykv_cpp.errors import NativeError

        cfg = self.cfg
        writer = _Writer(self.out / "results.json")
        active = [r for r in self.runs if r.status == "pending"]
        n_task_units = len(self.samples) * len(active)
        n_ppl_units = len(self.ppl_units) * len(active)
        n_tok = sum(self.prompts[s.key].n_prompt + s.max_new_tokens for s in self.samples)
        self.log(f"{self.model_path.name}: {self.device}; {len(self.samples)} samples ({n_tok} tokens) x "
                 f"{len(active)} (method, budget) runs x {len(cfg.protocols)} protocol(s); "
                 f"{len(self.ppl_units)} perplexity unit(s); n_ctx {self.n_ctx}; results in {self.out}")
        bar = tqdm(total=n_task_units + n_ppl_units, desc="eval", unit="unit", disable=not cfg.progress,
                   dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 10.0)
        try:
            if cfg.prefill == "exact" and cfg.reuse:
                # sample 0 of every task first, then sample 1, ...: partial results cover every task evenly
                for s in sorted(self.samples, key=lambda s: (s.index, s.length)):
                    self._run_sample_shared(s, [r for r in active if not r.status.startswith("unsupported")], bar)
                    writer.write(self.results(partial=True))
                active_tasks: list[Run] = []
            else:
                active_tasks = active
            for run in active_tasks:
                if not self.samples:
                    break
                todo = [s for s in self.samples if any(not self._done(s, p, run) for p in cfg.protocols)]
                bar.update(len(self.samples) - len(todo))
                if not todo:
                    run.status = "ok"
                    continue
                t0 = time.time()
                try:
                    ctx = self._context(run, prefill=cfg.prefill if run.plan is not None else "chunked")
                except (NativeError, PlanError) as e:
                    run.status = f"unsupported: {str(e).splitlines()[0][:300]}"
                    bar.update(len(todo))
                    continue
                try:
                    for s in todo:
                        bar.set_postfix_str(f"{run.key} {s.task}@{s.length}")
                        self._run_sample(ctx, run, s)
                        bar.update(1)
                    self._kv_info(run, ctx)
                    run.info["perf"] = ctx.perf()
                finally:
                    ctx.close()
                run.info["task_seconds"] = round(time.time() - t0, 2)
                run.status = "ok"
                writer.write(self.results(partial=True))
            for src, L in self.ppl_units:
                pending = [r for r in active if not r.status.startswith("unsupported") and
                           f"ppl/{src.name}/{L}/0/teacher-forced/{r.method}/{r.budget}" not in self.records]
                bar.update(len(active) - len(pending))
                if not pending:
                    continue
                self._ppl_unit(src, L, pending, bar)
                for r in pending:
                    if r.status == "pending":
                        r.status = "ok"
                writer.write(self.results(partial=True))
        finally:
            bar.close()
        for r in self.runs:
            if r.status == "pending":
                r.status = "ok"
        results = self.results(partial=False)
        writer.write(results)
        return results

    # ---- results -------------------------------------------------------------------------------------
    def results(self, partial: bool) -> dict[str, Any]:
        from polykv_cpp import LLAMA_CPP_COMMIT, __version__
        from polykv_cpp.evaluation import report

        cfg = self.cfg
        m = self.model
        shared, total = self.reuse["prefix_tokens_shared"], self.reuse["prefix_tokens_total"]
        reuse = dict(self.reuse)
        exact = cfg.prefill == "exact" and cfg.reuse
        n_sh, n_re = self.reuse["prompt_tokens_shared"], self.reuse["prompt_tokens_reused"]
        reuse["summary"] = [
            "model loaded once; " + ("one portable context per (sample, method, budget)" if exact else
                                     "one context per (method, budget), cleared between samples"),
            self.reuse["tokenization"],
            *([f"exact prefill: {n_sh} prompt tokens prefilled once (FullKV, portable state) and loaded instead of "
               f"prefilled {n_re} times over by the other methods and budgets"] if exact else []),
            *([f"prompt state cache {cfg.state_cache}: {self.reuse['prompt_states_loaded']} of the prompts loaded "
               "from an earlier evaluation instead of prefilled"] if cfg.state_cache else []),
            *([f"KVzip: {self.reuse['kvzip_passes_shared']} reconstruction passes saved (one pass per sample and "
               "protocol, its scored state loaded by the other KVzip runs)"] if self.reuse["kvzip_passes_shared"]
              else []),
            *([f"KVzip: {self.reuse['kvzip_passes_loaded']} scored prompt states loaded from the state cache instead "
               "of a reconstruction pass"] if self.reuse["kvzip_passes_loaded"] else []),
            f"FullKV: one generation per sample served both protocols ({self.reuse['fullkv_protocols_shared']} "
            "results shared) and is the reference of every budget",
            f"{self.reuse['copied_from_fullkv']} results copied from FullKV because the (method, budget) keeps "
            "every token of the sample (nothing can be evicted)",
            f"prefill state shared by the two protocols: {shared} part-1 tokens computed once instead of twice, "
            f"{100 * shared / total:.0f}% of the {total} part-1 tokens the compressed runs would otherwise feed"
            if total else "prefill state sharing between protocols (chunked): not used",
            f"perplexity: {self.reuse['ppl_fullkv_reference_runs']} FullKV reference run(s), each kept in memory "
            "for the KL of every other method and budget at that text and length",
        ]
        data: dict[str, Any] = {
            "format": RESULTS_FORMAT, "version": RESULTS_VERSION, "partial": partial,
            "fingerprint": self.fingerprint(),
            "config": asdict(cfg),
            "environment": {
                "model": str(self.model_path), "model_description": m.description, "arch": self.arch,
                "n_layer": self.n_layer, "n_params": m.n_params, "device": self.device,
                "n_gpu_layers": self.n_gpu_layers, "n_threads": cfg.n_threads or os.cpu_count(),
                "n_ctx": self.n_ctx, "chat_format": self.chat, "polykv_cpp": __version__,
                "llama_cpp": LLAMA_CPP_COMMIT, "python": platform.python_version(), "platform": platform.platform(),
                "elapsed_s": round(time.time() - self.t_start, 1),
            },
            "protocols": {p: PROTOCOL_TEXT[p] for p in [*cfg.protocols, "teacher-forced"]},
            "prefill": PREFILL_TEXT[cfg.prefill] + (SLACK_TEXT.format(s=cfg.prefill_slack)
                                                   if (cfg.prefill_slack or 1.0) > 1.0 else "")
                       + (PROBE_TEXT.format(n=cfg.prompt_probe) if cfg.prompt_probe else ""),
            "budget_definition": BUDGET_TEXT,
            "methods": self.methods,
            "plans": {n: {"origin": self.plan_origin.get(n), "summary": p.summary(), "b_min": p.b_min,
                          "budget_avg": p.budget_avg} for n, p in self.plans.items()},
            "sliding_window_layers": {str(i): w for i, w in enumerate(self.windows) if w},
            "runs": [{"method": r.method, "budget": r.budget, "status": r.status, **r.info} for r in self.runs],
            "tasks": {t: T.TASK_DESCRIPTIONS[t] for t in cfg.tasks},
            "samples": [{"key": s.key, "n_prompt": self.prompts[s.key].n_prompt, "part1": len(self.prompts[s.key].part1),
                         "part2": len(self.prompts[s.key].part2), "n_truncated": self.prompts[s.key].n_truncated,
                         "max_new_tokens": s.max_new_tokens, "answers": s.answers,
                         "meta": {k: v for k, v in s.meta.items() if k != "all_classes"}} for s in self.samples],
            "ppl_texts": sorted({(s.name, s.origin) for s, _ in self.ppl_units}),
            "longbench": self.longbench_status or ("not requested" if not cfg.longbench else {}),
            "reuse": reuse,
            "notes": self.notes,
            "records": sorted(self.records.values(), key=record_key),
        }
        data["summary"] = report.summarize(data)
        return data


def run_eval(cfg: EvalConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the whole evaluation and write results.json, results.md and the PNG plots; returns the results."""
    from polykv_cpp.evaluation import report

    ev = Evaluator(cfg, log)
    try:
        ev.setup()
        results = ev.run()
    finally:
        if ev.model is not None:
            ev.model.close()
    paths = report.write_report(results, Path(cfg.out_dir), png=cfg.png)
    results["files"] = {k: str(v) for k, v in paths.items()}
    return results
