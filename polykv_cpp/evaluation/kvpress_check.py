"""`polykv-cpp kvpress-check`: our single-pattern baselines next to kvpress's presses, on the same samples.

kvpress (NVIDIA, PyPI ``kvpress``) is the field's reference implementation of prompt KV-cache compression on
transformers. This check replays the samples of a finished ``polykv-cpp eval`` run (same generator seed, the
same token ids from our tokenizer) through kvpress on the transformers model with the same weights
(dequantized from the GGUF), and reports the task scores of both side by side, with how often the two
answers are identical.

    polykv-cpp kvpress-check results/eval-qwen-4k-b512-qa-3samples -o results/kvpress-qwen-4k-b512-qa

One prefill per sample serves every press and budget. kvpress compresses a layer's cache in a forward hook
*after* that layer's attention ran, so the hidden states that reach the next layer never depend on the
press. Calling each press's own ``compress`` on the hook's inputs therefore yields exactly the cache that
``with press(model): model(...)`` yields (``tests/test_kvpress_check.py`` checks this against kvpress's own
hooks). Decoding then follows ``KVPressTextGenerationPipeline.generate_answer``: greedy, explicit position
ids after the compressed context.

Known differences, written into every report:

* kvpress selects tokens per KV head; our cache keeps one token set per layer (scores summed over heads);
* kvpress compresses the prompt only and lets the cache grow while decoding; our baselines also evict
  during decode (the cache stays at the budget);
* transformers runs the dequantized weights in fp32; we run the Q4_K_M GGUF with an f16 cache;
* ObservedAttentionPress (H2O) keeps no recent window and averages attention over the queries that see a
  key; ours protects the last 32 tokens and sums. kvpress needs the attention weights for it: they are
  computed here as eager attention computes them, for that press only, so the model itself runs SDPA;
* KnormPress keeps no recent token (ours keeps the newest one); SnapKV/PyramidKV pool with an average
  (ours: max). Window, kernel and sink sizes are set to ours (``--kvpress-params`` keeps kvpress's);
* PyramidKVPress keeps SnapKV's uniform sizes unless budget / beta >= window (as KVCache-Factory does);
* adaptive (``adakv``): AdaKVPress masks the dropped (head, token) pairs in attention (the decode here applies its
  masks, :func:`head_masks`); ours keeps only the kept pairs (with flash attention the heads share the layer's
  slots; without it, rows for the longest head).

Limits: kvpress 0.5.5 supports Llama, Mistral, Phi-3, Qwen2/3 and Gemma-3 (multimodal) model classes; other
models are refused. Needs ``pip install 'polykv-cpp[kvpress]'`` (kvpress 0.5.5 wants transformers < 5.3).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from polykv_cpp.errors import PolyKVError

KVPRESS_VERSION = "0.5.5"
RESULTS_FORMAT = "polykv-kvpress-check"
FULLKV = "fullkv"
#: our baseline -> the kvpress press that implements the same rule
PRESS_OF = {"streamingllm": "StreamingLLMPress", "h2o": "ObservedAttentionPress", "snapkv": "SnapKVPress",
            "tova": "TOVAPress", "knorm": "KnormPress", "pyramidkv": "PyramidKVPress",
            "expected_attention": "ExpectedAttentionPress"}
# kvpress's scorer presses select per KV head (top-k of [batch, n_head_kv, n_key] scores): the same granularity
# as our "-head" baselines, which map to the same presses
PRESS_OF.update({f"{m}-head": PRESS_OF[m] for m in ("h2o", "snapkv", "tova", "knorm", "pyramidkv", "expected_attention")})
#: KVzip runs its own reconstruction passes after the prefill, so it cannot share the prefill's hook: it is replayed
#: on a copy of the FullKV cache (:func:`kvzip_cache`). KVzipPress(layerwise=True) keeps budget x n_head_kv pairs in
#: every layer, split across the layer's heads by score (our uniform per-layer and per-head budgets);
#: ``kvzip-model-wide`` is KVzipPress's default (layerwise=False): the pairs are chosen across the whole model per
#: prompt, the allocation the paper uses, which a plan of ours approximates with per-layer budgets fixed in advance
KVZIP_PRESS = "KVzipPress"
KVZIP_LAYERWISE = {"kvzip": True, "kvzip-head": True, "kvzip-model-wide": False}
#: KVzip+ (kvpress's ``kvzip_plus_normalization``): each reconstruction query's attention divided by the norm of its
#: hidden state and each key's by the norm of what its value writes to the residual stream, ||v W_O|| (per head)
KVZIP_LAYERWISE.update({"kvzip-plus": True, "kvzip-plus-head": True, "kvzip-plus-model-wide": False})
PRESS_OF.update({m: KVZIP_PRESS for m in KVZIP_LAYERWISE})
#: presses whose score reads the full attention matrix (kvpress asks for eager attention)
NEEDS_ATTENTIONS = tuple(m for m, p in PRESS_OF.items() if p == "ObservedAttentionPress")
#: our adaptive baselines (``snapkv-adaptive`` = ``adakv``, ...) -> kvpress's AdaKVPress around the pattern's press
#: (AdaKVPress takes a ScorerPress: not ObservedAttentionPress, and PyramidKVPress would score as SnapKV)
ADAPTIVE_INNER = ("snapkv", "tova", "knorm", "expected_attention")
ADAPTIVE_PRESS = "AdaKVPress"
#: the methods this check maps, as the error message and --help name them
KNOWN_METHODS = (f"{', '.join(PRESS_OF)}, snapkv@K, pyramidkv@K, adakv and "
                 f"{', '.join(m + '-adaptive' for m in ADAPTIVE_INNER)}; OURS=PRESS_METHOD pairs our method or plan "
                 "OURS with kvpress's PRESS_METHOD (e.g. polykv-kvzip=kvzip-model-wide)")
DIFFERENCES = [
    "kvpress selects tokens per KV head; our per-layer baselines keep one token set per layer (scores averaged over "
    "heads), our '-head' baselines select per KV head as kvpress does",
    "kvpress compresses the prompt only and the cache grows while decoding; our baselines also evict during "
    "decode (the cache stays at the budget)",
    "kvpress runs transformers in fp32 on the weights dequantized from the GGUF; we run the GGUF with an f16 cache",
    "H2O = ObservedAttentionPress: no recent window, attention averaged over the queries that see a key "
    "(ours: last 32 tokens protected, summed)",
    "KnormPress keeps no recent token (ours keeps the newest); SnapKV/PyramidKV average-pool (ours: max-pool)",
    "PyramidKVPress falls back to uniform SnapKV sizes unless budget / beta >= window (budget >= 640 with our "
    "window 32), as KVCache-Factory does; our PyramidKV plan is a pyramid at every budget",
    "Expected Attention: ours compresses the prompt once (exact prefill) as kvpress does; both look 512 positions "
    "ahead and leave the first 4 queries out of the statistics (kvpress's defaults)",
    "adaptive (Ada-KV) = AdaKVPress around the pattern's press (safeguard 0.2, as ours): kvpress keeps the whole "
    "cache and masks the dropped (head, token) pairs in attention; ours keeps only the kept pairs (flash attention "
    "on: the heads share the layer's slots; off: rows for the longest head)",
    "KVzip = KVzipPress, replayed on a copy of the FullKV cache (its own reconstruction passes, chunks of 2048): "
    "kvzip and kvzip-head map to layerwise=True, which splits each layer's budget x n_head_kv pairs across its heads "
    "by score with no floor and masks the rest (ours: one set per layer, or budget per head); kvzip-model-wide is "
    "its default, pairs chosen across all layers per prompt (ours: per-layer budgets fixed by the plan). kvpress "
    "scores a chunk by the repeat of that chunk only and leaves the chat template's prefix unscored (sinks kept)",
]


class KVPressCheckError(PolyKVError):
    """Bad input to the kvpress cross-check, or kvpress/transformers missing."""


@dataclass
class KVPressCheckConfig:
    results: str  # a `polykv-cpp eval` output directory or its results.json
    out_dir: str = "polykv-kvpress-check"
    methods: list[str] | None = None  # None: every baseline of the eval run that kvpress has
    budgets: list[int] | None = None  # None: the eval run's budgets
    protocols: list[str] | None = None  # None: the eval run's protocols
    tasks: list[str] | None = None  # None: the eval run's tasks
    samples: int | None = None  # the first N samples of every task and length; None: the eval run's
    hf_model: str | None = None  # transformers checkpoint with the same weights; None: converted from the GGUF
    kvpress_params: bool = False  # True: kvpress's own window/kernel sizes instead of ours
    n_threads: int | None = None
    png: bool = True
    progress: bool = True
    resume: bool = False  # go on from out_dir/results.json of a stopped check with the same settings


#: the settings a resumed check must share with the stopped one (the rest only say how to run it)
RESUME_KEYS = ("methods", "budgets", "protocols", "tasks", "kvpress_params")


def _import_kvpress():
    try:
        import kvpress
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise KVPressCheckError(f"the kvpress cross-check needs kvpress {KVPRESS_VERSION}, torch and transformers "
                                f"({e}); install them with: pip install 'polykv-cpp[kvpress]'") from None
    return kvpress


def ratio_for(budget: int, n_tokens: int, *, counts_pruned: bool = False) -> float:
    """kvpress's ``compression_ratio`` that keeps exactly ``budget`` of ``n_tokens`` (0 when all fit).

    kvpress's scorer presses keep ``int(n * (1 - ratio))`` tokens; half a token of slack keeps float rounding off
    the floor. KVzipPress (``counts_pruned``) prunes ``int(n_pairs * ratio)`` pairs: the slack goes the other way."""
    if budget >= n_tokens:
        return 0.0
    if counts_pruned:
        return (n_tokens - budget) / n_tokens + 1e-9
    return (n_tokens - budget - 0.5) / n_tokens


def _adaptive_base(method: str) -> str | None:
    """``snapkv`` for ``snapkv-adaptive`` / ``adakv`` (and their ``@K``), None for a method that is not adaptive."""
    from polykv_cpp.plan import METHOD_ALIASES

    name, at, kernel = method.partition("@")
    name = METHOD_ALIASES.get(name, name)
    base, sep, unit = name.partition("-")
    return base + at + kernel if sep and unit == "adaptive" else None


def split_pair(method: str) -> tuple[str, str]:
    """(our method or plan label, kvpress method) of ``OURS=PRESS_METHOD``; both are ``method`` without ``=``."""
    ours, eq, theirs = method.partition("=")
    return (ours, theirs) if eq else (method, method)


def press_name(method: str) -> str | None:
    """The kvpress press class for our baseline ``method`` (a pooling variant ``snapkv@23`` of SnapKV/PyramidKV maps
    to the press with that kernel; an adaptive one to AdaKVPress), None if kvpress has none."""
    method = split_pair(method)[1]
    base = _adaptive_base(method)
    if base is not None:
        return ADAPTIVE_PRESS if base.partition("@")[0] in ADAPTIVE_INNER and press_name(base) else None
    name, at, kernel = method.partition("@")
    if at and (name.removesuffix("-head") not in ("snapkv", "pyramidkv") or not kernel.isdigit()):
        return None
    return PRESS_OF.get(name)


def make_press(kvpress: Any, method: str, ratio: float, *, own_params: bool = False) -> Any:
    """The kvpress press for our baseline ``method`` at ``ratio``; window/kernel/sink sizes are ours unless
    ``own_params`` (see :data:`polykv_cpp.plan.DEFAULT_PARAMS`); ``snapkv@K`` sets the kernel K."""
    from polykv_cpp.plan import DEFAULT_PARAMS

    press = press_name(method)
    if press is None:
        raise KVPressCheckError(f"no kvpress press for {method!r} (known: {KNOWN_METHODS})")
    method = split_pair(method)[1]
    if press == KVZIP_PRESS:
        return kvpress.KVzipPress(compression_ratio=ratio, layerwise=KVZIP_LAYERWISE[method],
                                  n_sink=DEFAULT_PARAMS["kvzip"]["n_sink"],
                                  kvzip_plus_normalization=method.startswith("kvzip-plus"))
    base = _adaptive_base(method)
    if base is not None:
        return kvpress.AdaKVPress(press=make_press(kvpress, base, ratio, own_params=own_params))
    kw: dict[str, Any] = {"compression_ratio": ratio}
    method, _, kernel = method.partition("@")
    method = method.removesuffix("-head")
    ours = DEFAULT_PARAMS[method]
    if not own_params:
        if method in ("streamingllm", "expected_attention"):
            kw["n_sink"] = ours["n_sink"]
        elif method in ("snapkv", "pyramidkv"):
            kw["window_size"] = ours["obs_window"]
            kw["kernel_size"] = ours["pool_kernel"]
    if kernel:
        kw["kernel_size"] = int(kernel)
    return getattr(kvpress, press)(**kw)


def eager_attention_weights(module: Any, hidden_states: Any, keys: Any, position_embeddings: Any) -> Any:
    """softmax(Q K^T * scaling + causal mask) in fp32 for every query, as transformers' eager attention
    computes it (the ``attentions`` that ObservedAttentionPress reads), without running the model eagerly."""
    import torch
    from kvpress.utils import get_prerope_query_states
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    q = get_prerope_query_states(module, hidden_states)
    cos, sin = position_embeddings
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    k = repeat_kv(keys, q.shape[1] // keys.shape[1])
    w = torch.matmul(q.float(), k.float().transpose(2, 3)).mul_(module.scaling)
    n_q, n_k = w.shape[-2], w.shape[-1]
    w.masked_fill_(torch.ones(n_q, n_k, dtype=torch.bool, device=w.device).triu(n_k - n_q + 1), float("-inf"))
    # softmax in place: at 4K tokens one [heads, n, n] matrix is ~1 GB, a copy per step would double it
    w.sub_(w.amax(dim=-1, keepdim=True)).exp_()
    return w.div_(w.sum(dim=-1, keepdim=True)).to(q.dtype)


def language_model(model: Any) -> Any:
    """The decoder stack of a causal LM (Gemma-3's multimodal class nests it under ``language_model``)."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


class SharedPrefill:
    """One prefill, many presses: the per-layer (keys, values) each press would leave in the cache.

    A forward hook on every attention layer calls each press's ``compress`` on the same inputs kvpress's own
    hook passes (hidden states, the layer's cache, the attention output's weights, the forward kwargs) and
    stores the result instead of writing it back; the model's own cache stays full (FullKV). A press that masks
    instead of evicting (AdaKVPress sets the module's ``masked_key_indices``) leaves its masks in ``masked``, for
    :func:`head_masks` to apply while decoding from its cache."""

    def __init__(self, model: Any, presses: dict[Any, Any]):
        self.model = model
        self.presses = presses
        self.kept: dict[Any, list[Any]] = {}
        self.masked: dict[Any, list[Any]] = {}

    def run(self, input_ids: list[int]) -> tuple[Any, Any]:
        """Prefill ``input_ids``: (logits of the last position, the FullKV DynamicCache); fills ``kept``."""
        import torch
        from kvpress.presses.base_press import is_prefilling
        from kvpress.utils import extract_keys_and_values
        from transformers import DynamicCache

        lm = language_model(self.model)
        n_layer = len(lm.layers)
        self.kept = {key: [None] * n_layer for key in self.presses}
        self.masked = {key: [None] * n_layer for key in self.presses}
        for press in self.presses.values():
            press.post_init_from_model(self.model)
        attn_users = [k for k, p in self.presses.items() if type(p).__name__ == "ObservedAttentionPress"]

        def hook(module, args, kwargs, output):
            hidden_states = kwargs["hidden_states"]
            if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
                return output
            keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
            attentions = output[1]
            if attentions is None and attn_users:
                attentions = eager_attention_weights(module, hidden_states, keys, kwargs["position_embeddings"])
            for key, press in self.presses.items():
                a = attentions if key in attn_users else output[1]
                module.masked_key_indices = None
                self.kept[key][module.layer_idx] = press.compress(module, hidden_states, keys, values, a, kwargs)
                self.masked[key][module.layer_idx] = getattr(module, "masked_key_indices", None)
            module.masked_key_indices = None
            return output

        hooks = []
        try:
            for layer in lm.layers:
                layer.self_attn.rotary_emb = lm.rotary_emb  # as kvpress's BasePress.__call__ does
                hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
            cache = DynamicCache()
            with torch.no_grad():
                out = self.model(input_ids=torch.tensor([input_ids]), past_key_values=cache, logits_to_keep=1)
        finally:
            for h in hooks:
                h.remove()
        return out.logits[0, -1], cache


def kvzip_cache(model: Any, press: Any, input_ids: list[int], full: Any) -> tuple[list[Any], list[Any]]:
    """What ``with press(model): model(input_ids)`` leaves for a KVzipPress, without a second prefill: the press's
    own exit (reconstruction passes over the cache, then its masks) runs on a copy of the FullKV cache ``full`` of
    ``input_ids``. Returns (per-layer keys/values, per-layer masks for :func:`head_masks`); the modules' masks are
    cleared again."""
    import torch

    layers = language_model(model).layers
    cache = cache_of([(k.clone(), v.clone()) for k, v in full_layers(full)])
    try:
        with torch.no_grad(), press(model):
            # what the press's wrapper of the decoder's forward records during the prefill it replaces
            press._context_ids = torch.tensor([input_ids])
            press._cache = cache
        masked = [layer.self_attn.masked_key_indices for layer in layers]
    finally:
        for layer in layers:
            layer.self_attn.masked_key_indices = None
    return full_layers(cache), masked


@contextmanager
def head_masks(model: Any, masked: Sequence[Any] | None) -> Iterator[None]:
    """Decode with AdaKVPress's per-layer masks (``SharedPrefill.masked``) in place, as kvpress's attention patch
    reads them from each attention module; none afterwards."""
    layers = language_model(model).layers
    try:
        for layer, m in zip(layers, masked or [None] * len(layers)):
            layer.self_attn.masked_key_indices = m
        yield
    finally:
        for layer in layers:
            layer.self_attn.masked_key_indices = None


def cache_of(layers: list[tuple[Any, Any]]) -> Any:
    """A DynamicCache holding the given per-layer (keys, values)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def kept_per_layer(layers: list[tuple[Any, Any]], masked: Sequence[Any] | None = None) -> list[float]:
    """Tokens each layer keeps per KV head: its cache length, less its masked (head, token) pairs per head."""
    out = []
    for i, (k, _) in enumerate(layers):
        n_masked = len(masked[i][0]) if masked and masked[i] is not None else 0
        kept = k.shape[2] - n_masked / k.shape[1]
        out.append(int(kept) if kept == int(kept) else round(kept, 2))
    return out


def full_layers(cache: Any) -> list[tuple[Any, Any]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def greedy_tokens(model: Any, cache: Any, n_context: int, *, first_logits: Any = None, question: Sequence[int] = (),
                  max_new_tokens: int, stop: Callable[[int], bool]) -> Iterator[int]:
    """Greedy decoding after a (compressed) context of ``n_context`` positions, as kvpress's pipeline does:
    the question (if any) is forwarded with explicit position ids, then one token at a time. Without a
    question the first token comes from ``first_logits`` (the prefill's last position)."""
    import torch

    pos = n_context
    # transformers builds one attention mask from layer 0's cache length: with layers of different lengths
    # (PyramidKV) a multi-token forward fails, so the question then goes in one token at a time (same result)
    uneven = len({layer.keys.shape[-2] for layer in cache.layers}) > 1
    with torch.no_grad():
        if question:
            chunks = [[t] for t in question] if uneven else [list(question)]
            for chunk in chunks:
                out = model(input_ids=torch.tensor([chunk]), past_key_values=cache, logits_to_keep=1,
                            position_ids=torch.arange(pos, pos + len(chunk)).unsqueeze(0))
                pos += len(chunk)
            logits = out.logits[0, -1]
        else:
            logits = first_logits
        for i in range(max_new_tokens):
            tok = int(logits.argmax())
            yield tok
            if stop(tok) or i == max_new_tokens - 1:
                return
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                        position_ids=torch.tensor([[pos]]))
            logits = out.logits[0, -1]
            pos += 1


def _load_hf(path: str | Path, n_threads: int | None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    if n_threads:
        torch.set_num_threads(n_threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    except Exception as e:
        raise KVPressCheckError(f"cannot load the transformers model at {path}: {e}") from None
    return model.eval()


def _complete_samples(records: list[dict[str, Any]], tasks: list[str], lengths: list[int], protocol: str) -> int:
    """How many samples of every (task, length), counted from index 0, a stopped eval run has FullKV results for."""
    have = {(r["task"], r["length"], r["index"]) for r in records
            if r["kind"] == "ruler" and r["method"] == FULLKV and r["protocol"] == protocol}
    n = 0
    while all((t, L, n) in have for t in tasks for L in lengths):
        n += 1
    return n


class KVPressCheck:
    """The samples of one eval run, replayed through kvpress (see the module docstring)."""

    def __init__(self, cfg: KVPressCheckConfig, log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.log = log or (lambda msg: print(f"[polykv-cpp kvpress-check] {msg}", file=sys.stderr))
        self.records: list[dict[str, Any]] = []
        self.seconds_before = 0.0
        self.prefill_before = 0.0

    def setup(self) -> None:
        from polykv_cpp.evaluation import report
        from polykv_cpp.evaluation.runner import PROTOCOLS, EvalConfig, Evaluator

        cfg = self.cfg
        self.kvpress = _import_kvpress()
        try:
            self.ours = report.load_results(cfg.results)
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise KVPressCheckError(f"{cfg.results}: not a finished `polykv-cpp eval` run ({e})") from None
        if self.ours.get("format") != "polykv-eval-results":
            raise KVPressCheckError(f"{cfg.results}: not a `polykv-cpp eval` results file")
        oc = self.ours["config"]
        ran = {(r["method"], r["budget"]) for r in self.ours["records"] if r["kind"] == "ruler"}
        methods = cfg.methods or [m for m in oc["methods"] if press_name(m)]
        bad = [m for m in methods if not press_name(m)]
        if bad:
            raise KVPressCheckError(f"no kvpress press for {', '.join(bad)} (known: {', '.join(PRESS_OF)})")
        self.methods = methods
        self.budgets = cfg.budgets or list(oc["budgets"])
        self.protocols = cfg.protocols or list(oc["protocols"])
        for p in self.protocols:
            if p not in PROTOCOLS or p not in oc["protocols"]:
                raise KVPressCheckError(f"protocol {p!r} is not in the eval run ({', '.join(oc['protocols'])})")
        missing = [f"{split_pair(m)[0]}@{b}" for m in methods for b in self.budgets if (split_pair(m)[0], b) not in ran]
        if missing:
            raise KVPressCheckError(f"the eval run has no task results for {', '.join(missing)}; choose --methods "
                                    "and --budgets it ran")
        tasks = cfg.tasks or list(oc["tasks"])
        unknown = [t for t in tasks if t not in oc["tasks"]]
        if unknown:
            raise KVPressCheckError(f"task(s) {', '.join(unknown)} not in the eval run")
        n_samples = oc["n_samples"] if cfg.samples is None else cfg.samples
        if cfg.samples is None and self.ours.get("partial"):
            n_samples = _complete_samples(self.ours["records"], tasks, oc["lengths"], self.protocols[0])
            if n_samples == 0:
                raise KVPressCheckError(f"{cfg.results}: the eval run stopped before it had one sample of every task")
            self.log(f"the eval run stopped early: replaying the {n_samples} sample(s) per task it has for all of them")
        if not isinstance(n_samples, int) or not 1 <= n_samples <= oc["n_samples"]:
            raise KVPressCheckError(f"--samples must be 1..{oc['n_samples']} (the eval run's samples per task), "
                                    f"got {cfg.samples!r}")
        # the same samples and token ids as the eval run: its generator, seed and our tokenizer
        known = {f.name for f in fields(EvalConfig)}
        ecfg = EvalConfig(**{**{k: v for k, v in oc.items() if k in known}, "tasks": tasks, "ppl": False,
                             "n_samples": n_samples, "longbench": [], "out_dir": str(cfg.out_dir),
                             "progress": False, "resume": False})
        self.ev = Evaluator(ecfg, log=self.log)
        self.ev.build_samples()
        self.ours_by_key = {self._key(r): r for r in self.ours["records"] if r["kind"] == "ruler"}
        for s in self.ev.samples:
            r = self.ours_by_key.get(self._key_of(s, self.protocols[0], FULLKV, None))
            if r is None and self.ours.get("partial"):
                raise KVPressCheckError(f"the eval run stopped before sample {s.key}: replay the samples it has "
                                        "with --samples N (the first N of every task)")
            if r is None or r["n_prompt"] != self.ev.prompts[s.key].n_prompt or r["answers"] != s.answers:
                raise KVPressCheckError(f"sample {s.key} differs from the eval run's (another generator version "
                                        "or tokenizer); rerun the eval with this version")
        self.hf_path = cfg.hf_model or str(self._convert(self.ev.model_path))
        self.hf = _load_hf(self.hf_path, cfg.n_threads)
        cls = type(self.hf).__name__
        supported = tuple(c.__name__ for c in self.kvpress.presses.base_press.SUPPORTED_MODELS)
        if cls not in supported:
            raise KVPressCheckError(f"kvpress {KVPRESS_VERSION} does not support {cls} (supported: "
                                    f"{', '.join(supported)})")
        eos = self.hf.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def _convert(self, gguf: Path) -> Path:
        try:
            from calibration.checkpoint import hf_from_gguf
        except ImportError:
            raise KVPressCheckError("converting the GGUF to a transformers checkpoint needs the calibration "
                                    "package (pip install 'polykv-cpp[kvpress]'), or give --hf DIR") from None
        return hf_from_gguf(gguf, log=self.log)

    @staticmethod
    def _key(r: dict[str, Any]) -> str:
        return f"{r['task']}/{r['length']}/{r['index']}/{r['protocol']}/{r['method']}/{r['budget']}"

    @staticmethod
    def _key_of(s: Any, protocol: str, method: str, budget: int | None) -> str:
        return f"{s.task}/{s.length}/{s.index}/{protocol}/{method}/{budget}"

    def _stop(self, tok: int) -> bool:
        return tok in self.eos or self.ev.model.is_eog(tok)

    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        from polykv_cpp.evaluation import scoring
        from polykv_cpp.evaluation.runner import read_answer

        t0 = time.time()
        self.t_prefill = 0.0
        units = [(s, p) for s in self.ev.samples for p in self.protocols]
        done = self._resumed() if self.cfg.resume else set()
        units = [(s, p) for s, p in units if (s.key, p) not in done]
        bar = tqdm(total=len(units), desc="kvpress", unit="prefill", disable=not self.cfg.progress,
                   dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 10.0)
        try:
            for s, protocol in units:
                prompt = self.ev.prompts[s.key]
                aware = protocol == "query-aware"
                context = prompt.tokens if aware else prompt.part1
                question = [] if aware else prompt.part2
                presses = {(m, b): make_press(self.kvpress, m, ratio_for(b, len(context),
                                                                       counts_pruned=press_name(m) == KVZIP_PRESS),
                                              own_params=self.cfg.kvpress_params)
                           for m in self.methods for b in self.budgets}
                replayed = {k: p for k, p in presses.items() if isinstance(p, self.kvpress.KVzipPress)}
                bar.set_postfix_str(f"{s.task} {protocol}")
                t1 = time.time()
                shared = SharedPrefill(self.hf, {k: p for k, p in presses.items() if k not in replayed})
                logits, full = shared.run(context)
                self.t_prefill += time.time() - t1
                for key, press in replayed.items():
                    shared.kept[key], shared.masked[key] = kvzip_cache(self.hf, press, context, full)
                runs = [((FULLKV, None), full_layers(full))] + [(k, shared.kept[k]) for k in presses]
                for (method, budget), layers in runs:
                    masked = shared.masked.get((method, budget))
                    with head_masks(self.hf, masked):
                        toks = greedy_tokens(self.hf, cache_of(layers), len(context), first_logits=logits,
                                             question=question, max_new_tokens=s.max_new_tokens, stop=self._stop)
                        pred, n_gen = read_answer(toks, self.ev.model, s)
                    ours = self.ours_by_key.get(self._key_of(s, protocol, split_pair(method)[0], budget))
                    score = scoring.score(s.metric, pred, s.answers, meta=s.meta)
                    self.records.append({
                        "task": s.task, "length": s.length, "index": s.index, "protocol": protocol,
                        "method": method, "budget": budget, "n_prompt": prompt.n_prompt,
                        "n_compressed": len(context), "kept_per_layer": kept_per_layer(layers, masked),
                        "prediction": pred, "n_generated": n_gen, "score": score,
                        "ours_prediction": ours and ours["prediction"], "ours_score": ours and ours["score"],
                        "same_answer": ours is not None and pred.strip() == ours["prediction"].strip()})
                self.seconds = self.seconds_before + time.time() - t0
                write_results(self.results(partial=True), Path(self.cfg.out_dir), png=False)
                bar.update(1)
        finally:
            bar.close()
        self.seconds = self.seconds_before + time.time() - t0
        return self.results()

    def _resumed(self) -> set[tuple[str, str]]:
        """Take the records of a stopped check in ``out_dir`` (same settings, checked); return the (sample key,
        protocol) units it finished."""
        path = Path(self.cfg.out_dir) / "results.json"
        if not path.exists():
            self.log(f"--resume: nothing to resume in {self.cfg.out_dir}, starting afresh")
            return set()
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise KVPressCheckError(f"--resume: {path} is not readable ({e})") from None
        if old.get("format") != RESULTS_FORMAT:
            raise KVPressCheckError(f"--resume: {path} is not a kvpress-check results file")
        now = {"methods": self.methods, "budgets": self.budgets, "protocols": self.protocols,
               "tasks": list(self.ev.cfg.tasks), "kvpress_params": self.cfg.kvpress_params}
        then = {"methods": old.get("methods"), "budgets": old.get("budgets"), "protocols": old.get("protocols"),
                "tasks": old.get("tasks", now["tasks"]), "kvpress_params": old["config"].get("kvpress_params")}
        differ = [k for k in RESUME_KEYS if now[k] != then[k]]
        if differ or Path(old["eval_results"]).resolve() != Path(self.cfg.results).resolve():
            what = ", ".join(f"{k} {then[k]} -> {now[k]}" for k in differ) or "another eval run"
            raise KVPressCheckError(f"--resume: {path} was made with other settings ({what}); use another --out")
        per_unit = 1 + len(self.methods) * len(self.budgets)
        key_of = {(s.task, s.length, s.index): s.key for s in self.ev.samples}
        by_unit: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for r in old["records"]:
            by_unit[(key_of.get((r["task"], r["length"], r["index"]), ""), r["protocol"])].append(r)
        keys = {(s.key, p) for s in self.ev.samples for p in self.protocols}
        done = {u for u, rs in by_unit.items() if len(rs) == per_unit and u in keys}
        self.records = [r for u in sorted(done) for r in by_unit[u]]
        self.seconds_before = float(old.get("seconds", 0.0))
        self.prefill_before = float(old.get("prefill_seconds", 0.0))
        self.log(f"--resume: {len(done)} of {len(keys)} prefills done in {path}")
        return done

    def results(self, *, partial: bool = False) -> dict[str, Any]:
        import kvpress
        import torch
        import transformers

        from polykv_cpp import __version__

        cfg = self.cfg
        return {"format": RESULTS_FORMAT, "version": 1, "eval_results": str(cfg.results),
                "config": asdict(cfg), "model": self.ours["config"]["model"], "hf_model": str(self.hf_path),
                "methods": self.methods, "budgets": self.budgets, "protocols": self.protocols,
                "tasks": list(self.ev.cfg.tasks), "partial": partial,
                "presses": {m: press_name(m) for m in self.methods},
                "params": "kvpress defaults" if cfg.kvpress_params else "ours (window, kernel, sinks)",
                "differences": DIFFERENCES,
                "environment": {"polykv_cpp": __version__, "kvpress": kvpress.__version__ if hasattr(
                    kvpress, "__version__") else KVPRESS_VERSION, "transformers": transformers.__version__,
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
                "seconds": round(self.seconds, 1), "prefill_seconds": round(self.prefill_before + self.t_prefill, 1),
                "n_samples": len({(r["task"], r["length"], r["index"]) for r in self.records}), "records": self.records,
                "summary": summarize(self.records)}


def _paired_intervals(by_t: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Bootstrap 95% intervals (paired: the same draw of samples for both engines, as `polykv-cpp eval`) of ours,
    kvpress's and their difference, over the task average and per task; {} when a sample lacks our score."""
    from polykv_cpp.evaluation.report import bootstrap_task_average, interval

    if any(r["ours_score"] is None for rs in by_t.values() for r in rs):
        return {}

    def cis(tasks: list[str]) -> dict[str, Any]:
        reps = bootstrap_task_average({eng: {t: {r["index"]: r[key] for r in by_t[t]} for t in tasks}
                                       for eng, key in (("ours", "ours_score"), ("kvpress", "score"))})
        return {"ours_ci95": interval(reps["ours"]), "kvpress_ci95": interval(reps["kvpress"]),
                "diff_ci95": interval(reps["ours"] - reps["kvpress"])}

    return {**cis(sorted(by_t)), "tasks": {t: cis([t]) for t in sorted(by_t)}}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """protocol -> method -> budget -> {ours, kvpress (0-100, mean over tasks of the task means),
    same_answer (% of samples), n, tasks: task -> {ours, kvpress}}, with paired bootstrap 95% intervals
    (``ours_ci95``, ``kvpress_ci95``, ``diff_ci95`` = ours - kvpress) on the average and on each task."""
    acc: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    for r in records:
        acc[r["protocol"]][r["method"]][str(r["budget"])][r["task"]].append(r)
    out: dict[str, Any] = {}
    for p, by_m in acc.items():
        for m, by_b in by_m.items():
            for b, by_t in by_b.items():
                tasks = {}
                for t, rs in sorted(by_t.items()):
                    ours = [r["ours_score"] for r in rs if r["ours_score"] is not None]
                    tasks[t] = {"kvpress": 100 * sum(r["score"] for r in rs) / len(rs),
                                "ours": 100 * sum(ours) / len(ours) if ours else None}
                rs_all = [r for rs in by_t.values() for r in rs]
                ours_t = [v["ours"] for v in tasks.values() if v["ours"] is not None]
                ci = _paired_intervals(by_t)
                for t, c in ci.pop("tasks", {}).items():
                    tasks[t].update(c)
                out.setdefault(p, {}).setdefault(m, {})[b] = {
                    "kvpress": sum(v["kvpress"] for v in tasks.values()) / len(tasks),
                    "ours": sum(ours_t) / len(ours_t) if len(ours_t) == len(tasks) else None,
                    "same_answer": 100 * sum(r["same_answer"] for r in rs_all) / len(rs_all),
                    "n": len(rs_all), "tasks": tasks, **ci}
    return out


def _ci(ci: Sequence[float] | None, *, signed: bool = True) -> str:
    """`` [+a, +b]`` for a difference's interval, `` [a-b]`` for a score's, nothing without one."""
    if not ci:
        return ""
    return f" [{ci[0]:+.1f}, {ci[1]:+.1f}]" if signed else f" [{ci[0]:.1f}-{ci[1]:.1f}]"


def _task_cell(c: dict[str, Any]) -> str:
    from polykv_cpp.evaluation.report import _f

    if c["ours"] is None:
        return f"– / {_f(c['kvpress'])}"
    return f"{_f(c['ours'])} / {_f(c['kvpress'])}, {c['ours'] - c['kvpress']:+.1f}{_ci(c.get('diff_ci95'))}"


def to_markdown(data: dict[str, Any]) -> str:
    from polykv_cpp.evaluation.report import _f

    s = data["summary"]
    L = [f"# kvpress cross-check of `{Path(data['model']).name}`", "",
         f"Our runtime (llama.cpp, results from `{data['eval_results']}`) against kvpress "
         f"{data['environment']['kvpress']} on transformers {data['environment']['transformers']} with the same "
         f"weights (`{data['hf_model']}`), on the same {data['n_samples']} samples and token ids. Scores are 0-100, "
         "mean over tasks; *same answer* = identical answer text. Press parameters: "
         f"{data['params']}. Time: {data['seconds']:.0f} s ({data['prefill_seconds']:.0f} s prefill).", "",
         *(["**Partial**: the check stopped or is still running; `--resume` goes on.", ""] if data.get("partial")
           else []),
         "Presses: " + ", ".join(f"{m} = `{p}`" for m, p in data["presses"].items()) + ".", ""]
    for p in data["protocols"]:
        by_m = s.get(p, {})
        budgets = [str(b) for b in data["budgets"]]
        L += [f"## {p}", "", "| method | budget | ours [95% CI] | kvpress [95% CI] | ours − kvpress [95% CI] | "
              "same answer | n |", "|---|---:|---:|---:|---:|---:|---:|"]
        for m in [FULLKV, *data["methods"]]:
            for b in (["None"] if m == FULLKV else budgets):
                c = by_m.get(m, {}).get(b)
                if not c:
                    continue
                diff = "–" if c["ours"] is None else f"{c['ours'] - c['kvpress']:+.1f}{_ci(c.get('diff_ci95'))}"
                ours = f"{_f(c['ours'])}{_ci(c.get('ours_ci95'), signed=False)}"
                theirs = f"{_f(c['kvpress'])}{_ci(c.get('kvpress_ci95'), signed=False)}"
                L.append(f"| {m} | {'–' if b == 'None' else b} | {ours} | {theirs} | {diff} | "
                         f"{c['same_answer']:.0f}% | {c['n']} |")
        L.append("")
        tasks = sorted({t for by_b in by_m.values() for c in by_b.values() for t in c["tasks"]})
        for b in budgets:
            L += [f"### {p}, budget {b}: per task (ours / kvpress, then ours − kvpress [95% CI])", "",
                  "| method | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
            for m in data["methods"]:
                c = by_m.get(m, {}).get(b)
                if c:
                    L.append(f"| {m} | " + " | ".join(_task_cell(c["tasks"][t]) if t in c["tasks"] else "–"
                                                       for t in tasks) + " |")
            L.append("")
    L += ["## Known differences between the two implementations", ""] + [f"- {d}" for d in data["differences"]]
    return "\n".join(L) + "\n"


def write_plot(data: dict[str, Any], out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    for p in data["protocols"]:
        by_m = data["summary"].get(p, {})
        budgets = [str(b) for b in data["budgets"]]
        fig, axes = plt.subplots(1, len(budgets), figsize=(4.5 * len(budgets), 3.6), squeeze=False)
        for ax, b in zip(axes[0], budgets):
            ms = [m for m in data["methods"] if b in by_m.get(m, {})]
            xs = range(len(ms))
            ours = [by_m[m][b]["ours"] or 0 for m in ms]
            kvp = [by_m[m][b]["kvpress"] for m in ms]
            ax.bar([x - 0.2 for x in xs], ours, 0.4, label="ours (llama.cpp)", color="tab:blue")
            ax.bar([x + 0.2 for x in xs], kvp, 0.4, label="kvpress (transformers)", color="tab:green")
            full = by_m.get(FULLKV, {}).get("None")
            if full:
                ax.axhline(full["ours"] or 0, color="black", ls="--", lw=1, label="FullKV (ours)")
                ax.axhline(full["kvpress"], color="gray", ls=":", lw=1, label="FullKV (transformers)")
            ax.set_xticks(list(xs), ms, rotation=30)
            ax.set_title(f"{p}, budget {b}")
            ax.set_ylabel("task score (0-100)")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        name = f"kvpress_{p}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files


def run_kvpress_check(cfg: KVPressCheckConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Replay an eval run's samples through kvpress; write results.json, results.md and PNGs to ``out_dir``."""
    check = KVPressCheck(cfg, log)
    check.setup()
    data = check.run()
    write_results(data, Path(cfg.out_dir), png=cfg.png)
    return data


def write_results(data: dict[str, Any], out: Path, *, png: bool) -> None:
    """results.json (replaced atomically: a check stopped while writing keeps the previous one), results.md and,
    with ``png``, the plots."""
    out.mkdir(parents=True, exist_ok=True)
    data["plots"] = write_plot(data, out) if png else []
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out / "results.json")
    (out / "results.md").write_text(to_markdown(data))


def cmd_kvpress_check(args: argparse.Namespace) -> int:
    from polykv_cpp.evaluation.cli import _ints, _names

    cfg = KVPressCheckConfig(results=args.results, out_dir=args.out, hf_model=args.hf,
                             methods=_names(args.methods) if args.methods else None,
                             budgets=_ints(args.budgets) if args.budgets else None,
                             protocols=None if args.protocol == "all" else [args.protocol],
                             tasks=_names(args.tasks) if args.tasks else None, samples=args.samples,
                             kvpress_params=args.kvpress_params,
                             n_threads=args.threads, png=not args.no_png, progress=not args.no_progress,
                             resume=args.resume)
    data = run_kvpress_check(cfg)
    print(to_markdown(data) if args.print_tables else f"wrote {Path(cfg.out_dir) / 'results.md'}")
    return 0


def register_cli(sub: Any) -> None:
    p = sub.add_parser("kvpress-check", help="compare our baselines with kvpress's presses on an eval run's samples",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("results", metavar="EVAL_DIR", help="output directory (or results.json) of `polykv-cpp eval`")
    p.add_argument("-o", "--out", default="polykv-kvpress-check", help="output directory")
    p.add_argument("--methods", default=None,
                   help=f"comma list among {KNOWN_METHODS} (default: the run's)")
    p.add_argument("--budgets", default=None, help="comma list (default: the run's budgets)")
    p.add_argument("--protocol", choices=["all", "query-aware", "query-agnostic"], default="all",
                   help="default: every protocol of the run")
    p.add_argument("--tasks", default=None, help="comma list (default: the run's tasks)")
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help="the first N samples of every task (default: the run's; of a stopped run, as many as it "
                        "has of every task)")
    p.add_argument("--hf", default=None, metavar="DIR",
                   help="transformers checkpoint with the same weights (default: converted from the GGUF, cached)")
    p.add_argument("--kvpress-params", action="store_true",
                   help="kvpress's own window/kernel/sink sizes instead of ours")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--resume", action="store_true",
                   help="go on from OUT/results.json of a stopped check (written after every prefill)")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--print-tables", action="store_true", help="print the markdown at the end")
    p.set_defaults(func=cmd_kvpress_check)
