"""``calibrate()``: HF checkpoint + GGUF + calibration data -> signals -> plan -> new GGUF with the plan."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from polykv_cpp import patterns as P
from polykv_cpp.errors import CalibrationError

DEFAULT_PATTERNS = ("streamingllm", "h2o", "snapkv", "tova", "knorm")
#: The pooling window calibrated plans give SnapKV and PyramidKV where ``--param`` sets none: 15 positions moved 4
#: towards the tokens after a high score (``pool_shift``; reaching 11 after it and 3 before), not the paper's 7
#: centred. With 7 the digits of a needle's value, 4 to 10 tokens after its key with a tokenizer that splits digits,
#: were evicted; 23 centred kept them, and 15 moved by 4 keeps the same 11 tokens after a score for 8 fewer before
#: it, chosen on calibration prompts (docs/results.md, "SnapKV's pooling kernel", "A pooling window moved after
#: the key").
CALIBRATED_POOL_KERNEL = 15
CALIBRATED_POOL_SHIFT = 4
#: The runtime search's default candidates: SnapKV with the calibrated window (see above).
RUNTIME_PATTERNS = ("streamingllm", "h2o", f"snapkv@{CALIBRATED_POOL_KERNEL}+{CALIBRATED_POOL_SHIFT}", "tova",
                    "knorm")

#: The "evict_every" calibrated plans carry: decode brings a layer back to its budget once per 64 generated tokens,
#: not after every token. The same allocation (a layer's cache already has one ubatch of room above its budget),
#: decode at 0.97x stock instead of 0.86x at depth 512, and a lower KL to FullKV on 12 texts (docs/results.md,
#: "`evict_every` 64 against 1"). The searches measure their candidates at 1; the key is set on the plan returned.
CALIBRATED_EVICT_EVERY = 64


def check_evict_every(k: int) -> None:
    from polykv_cpp.plan import MAX_EVICT_EVERY

    if not isinstance(k, int) or not 1 <= k <= MAX_EVICT_EVERY:
        raise CalibrationError(f"evict_every must be an integer from 1 to {MAX_EVICT_EVERY} (got {k!r})")

DEFAULT_SAMPLES = 8
DEFAULT_CTX = 2048
#: On a model with sliding-window layers the calibrated budgets are split by span (``Plan.span_split``), the spans
#: counted at a context of this many tokens (a global layer's span; a sliding-window layer's is its window). On
#: Gemma-3-270M the shares of a 4K context (4352 tokens) beat the plain split by 32 points at 128 tokens per layer
#: of 4K (90 prompts) and, on 1K prompts, the shares of the 1K context itself by 14 (docs/results.md,
#: "Gemma-3-270M: budgets split by span", "The span shares at other context lengths").
DEFAULT_SPAN_CTX = 4096
DEFAULT_N_CONT = 128
SIGNALS_VERSION = 2  # 2: sliding-window layers scored with their window


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window from a transformers config (``layer_types`` entries ``"sliding_attention"`` with
    ``sliding_window`` tokens), None for a layer that attends to the whole context: the windows the runtime reads
    from the GGUF (``Model.attention_windows()``). A config without ``layer_types`` has none."""
    tcfg = getattr(config, "text_config", None) or config
    n_layer = int(tcfg.num_hidden_layers)
    types = getattr(tcfg, "layer_types", None)
    window = getattr(tcfg, "sliding_window", None)
    if not types or not window:
        return [None] * n_layer
    if len(types) != n_layer:
        raise CalibrationError(f"the checkpoint's config lists {len(types)} layer types for {n_layer} layers")
    return [int(window) if t == "sliding_attention" else None for t in types]


def calibrated_params(params: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``params`` (pattern -> parameter overrides, as ``--param``) over the calibrated defaults
    (:data:`CALIBRATED_POOL_KERNEL` and :data:`CALIBRATED_POOL_SHIFT` for snapkv and pyramidkv; a given
    ``pool_kernel`` without a ``pool_shift`` pools centred)."""
    calibrated = {"pool_kernel": CALIBRATED_POOL_KERNEL, "pool_shift": CALIBRATED_POOL_SHIFT}
    out: dict[str, dict[str, Any]] = {p: dict(calibrated) for p in ("snapkv", "pyramidkv")}
    for name, kv in (params or {}).items():
        base = dict(out.get(name, {}))
        if "pool_kernel" in kv:
            base.pop("pool_shift", None)
        out[name] = {**base, **kv}
    return out


@dataclass
class CalibrationResult:
    plan: Any
    out: Path | None
    signals_path: Path
    signals: dict[str, np.ndarray]
    reused_signals: bool
    wall_s: float
    timings: dict[str, float] = field(default_factory=dict)


def always_kept(patterns: Sequence[P.Pattern]) -> int:
    """The largest always-kept part (sinks + windows) of the candidates."""
    reserved = 0
    for p in patterns:
        w = max(getattr(p, "window", 0) or 0, getattr(p, "obs_window", 0) or 0) if p.name != "streamingllm" else 1
        reserved = max(reserved, (getattr(p, "n_sink", 0) or 0) + w)
    return reserved


def default_b_min(budget: int, patterns: Sequence[P.Pattern]) -> int:
    """max(budget // 4, the largest always-kept part (sinks + windows) of the candidates), <= budget."""
    return min(budget, max(budget // 4, always_kept(patterns)))


def signals_path_for(out: Path | None, plan_out: Path | None) -> Path:
    base = out if out is not None else plan_out
    assert base is not None
    return base.with_name(base.name + ".signals.npz")


def _hash_inputs(hf_dir: Path, config: Any, data_fp: str, settings: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(config.to_dict() if hasattr(config, "to_dict") else str(config), sort_keys=True,
                        default=str).encode())
    for f in sorted(hf_dir.glob("*.safetensors")) + sorted(hf_dir.glob("*.bin")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}".encode())
        with open(f, "rb") as fh:        # first and last MiB of every weight file
            h.update(fh.read(1 << 20))
            if st.st_size > (2 << 20):
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read(1 << 20))
    h.update(data_fp.encode())
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()


def load_signals(path: Path, key: str) -> dict[str, np.ndarray] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta_json"]))
            if meta.get("inputs_sha256") != key or meta.get("signals_version") != SIGNALS_VERSION:
                return None
            return {k: z[k] for k in z.files}
    except Exception:
        return None


def save_signals(path: Path, sig: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez_compressed(tmp, **{k: v for k, v in sig.items() if k != "meta_json"},
                        meta_json=np.array(json.dumps(meta, default=str)))
    os.replace(tmp, path)


def _load_tokenizer(hf_dir: Path, gguf_path: Path, n_vocab: int, log):
    """(tokenizer or None, encode, description). The checkpoint's tokenizer first, then the GGUF's (via
    transformers), then UTF-8 bytes (tests). A tokenizer that yields ids outside the vocabulary is skipped."""
    from transformers import AutoTokenizer

    probe = "def f(x):\n    return x  # the quick brown fox\n\n"
    for src, kw, desc in ((str(hf_dir), {}, "hf"), (str(gguf_path.parent), {"gguf_file": gguf_path.name}, "gguf")):
        try:
            tok = AutoTokenizer.from_pretrained(src, **kw)
            ids = tok(probe, add_special_tokens=False)["input_ids"]
        except Exception:
            continue
        if not ids or max(ids) >= n_vocab:
            continue
        enc = (lambda t, tok=tok: tok(t, add_special_tokens=False)["input_ids"])
        return (tok if desc == "hf" else None), enc, f"{desc}:{type(tok).__name__}"
    from calibration.data import byte_encoder
    log("warning: no usable tokenizer in the checkpoint or the GGUF; using UTF-8 bytes as token ids")
    return None, byte_encoder(n_vocab), "bytes"


def _nll_signal(model, ids, C: int, kept: dict[tuple[int, int], np.ndarray], n_layer: int, n_pat: int,
                device: str) -> np.ndarray:
    """delta NLL [L, R] of the continuation with only layer l's context KV compressed by pattern r."""
    import torch

    from calibration.signals import STATE

    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        out = model(x[:, :C], use_cache=True)
        cache = out.past_key_values
        last_logit = out.logits[:, -1:]

        def nll() -> float:
            o = model(x[:, C:], past_key_values=cache, use_cache=True)
            logits = torch.cat([last_logit, o.logits[:, :-1]], dim=1).float()
            cache.crop(C)
            return float(torch.nn.functional.cross_entropy(logits[0], x[0, C:]))

        base = nll()
        res = np.zeros((n_layer, n_pat))
        for l in range(n_layer):
            for r in range(n_pat):
                m = torch.zeros(C, dtype=torch.bool)
                m[torch.from_numpy(kept[(l, r)])] = True
                STATE.key_mask = {l: m}
                try:
                    res[l, r] = nll() - base
                finally:
                    STATE.key_mask = {}
    return res


def calibrate(hf_dir: str | Path, gguf_path: str | Path, out: str | Path | None, *, budget: int,
              dataset: str = "builtin", samples: int = DEFAULT_SAMPLES, ctx: int = DEFAULT_CTX,
              n_cont: int = DEFAULT_N_CONT, patterns: Sequence[str] = DEFAULT_PATTERNS,
              phases: Sequence[str] = ("prefill", "decode"), b_min: int | None = None, signal: str = "cosine",
              sensitivity: str = "entropy", budget_rule: str = "sensitivity", device: str = "cpu",
              plan_out: str | Path | None = None, seed: int = 0, text_field: str = "text", split: str = "train",
              pattern_params: dict[str, dict[str, Any]] | None = None, n_eval: int = 48,
              fullkv_below: float = 0.9, reuse_signals: bool = True, progress: bool = True,
              evict_every: int = CALIBRATED_EVICT_EVERY, span_ctx: int = DEFAULT_SPAN_CTX, encode=None,
              log=None) -> CalibrationResult:
    """Calibrate (see docs/calibration.md). ``span_ctx``: on a model with sliding-window layers, the budgets are
    split by span with the spans of a context of this many tokens (:data:`DEFAULT_SPAN_CTX`; 0: the plain split).
    ``encode``: optional ``str -> list[int]`` replacing the tokenizer (API only; the identity check then skips the
    tokenizer fingerprint)."""
    check_evict_every(evict_every)
    if not isinstance(span_ctx, int) or isinstance(span_ctx, bool) or span_ctx < 0:
        raise CalibrationError(f"--span-ctx must be a non-negative integer (got {span_ctx!r})")
    t_start = time.perf_counter()
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    timings: dict[str, float] = {}
    hf_dir, gguf_path = Path(hf_dir), Path(gguf_path)
    out = Path(out) if out is not None else None
    plan_out = Path(plan_out) if plan_out is not None else None
    if out is None and plan_out is None:
        raise CalibrationError("nothing to write: give --out (GGUF) and/or --plan-out (JSON)")
    if out is not None and out.resolve() == gguf_path.resolve():
        raise CalibrationError(f"--out must be a new file, not the input GGUF {gguf_path}")
    if not hf_dir.is_dir() or not (hf_dir / "config.json").is_file():
        raise CalibrationError(f"{hf_dir} is not a Hugging Face checkpoint directory (no config.json)")
    if not gguf_path.is_file():
        raise CalibrationError(f"GGUF not found: {gguf_path}")
    for name in patterns:
        if name not in P.PATTERNS:
            raise CalibrationError(f"unknown pattern {name!r} (known: {', '.join(P.PATTERN_NAMES)})")
        if P.PATTERNS[name].prefill_only:
            raise CalibrationError(f"{name} scores a prompt once, inside the runtime; the transformers calibration "
                                   "cannot measure it: use --method runtime")
    if len(set(patterns)) != len(patterns) or not patterns:
        raise CalibrationError("--patterns must list distinct pattern names")
    for ph in phases:
        if ph not in ("prefill", "decode"):
            raise CalibrationError(f"unknown phase {ph!r} (prefill, decode)")
    if signal not in ("cosine", "ppl"):
        raise CalibrationError(f"--signal must be cosine or ppl (got {signal!r})")
    if sensitivity not in ("entropy", "cosine", "ppl"):
        raise CalibrationError(f"--sensitivity must be entropy, cosine or ppl (got {sensitivity!r})")
    if sensitivity == "ppl" and signal != "ppl":
        raise CalibrationError("--sensitivity ppl needs --signal ppl (it is computed with it)")
    if budget < 1 or samples < 1:
        raise CalibrationError("--budget and --samples must be positive")
    if ctx - n_cont <= budget:
        raise CalibrationError(f"--ctx {ctx} leaves a context of {ctx - n_cont} tokens before the {n_cont}-token "
                               f"continuation, not more than --budget {budget}: nothing would be evicted. "
                               f"Use --ctx > budget + {n_cont} (e.g. {4 * budget})")
    pattern_params = calibrated_params(pattern_params)
    from calibration.signals import SignalConfig
    scfg = SignalConfig(budget=budget, patterns=list(patterns), n_cont=n_cont, n_eval=n_eval, phases=tuple(phases),
                        pattern_params=pattern_params)
    pats = {n: scfg.pattern(n) for n in patterns}
    floor_given = b_min is not None
    if b_min is None:
        b_min = default_b_min(budget, list(pats.values()))
    if not 1 <= b_min <= budget:
        raise CalibrationError(f"--b-min must be in [1, budget] (got {b_min})")

    t0 = time.perf_counter()
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise CalibrationError(f"calibration needs torch and transformers ({e}); "
                               "pip install torch==2.13.0 transformers==5.2.0") from None
    from tqdm.auto import tqdm

    from calibration import signals as S
    from calibration.data import load_calibration_data
    from calibration.identity import check_identity

    torch.manual_seed(seed)
    if not progress:
        try:
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
        except Exception:
            pass
    config = AutoConfig.from_pretrained(str(hf_dir))
    tcfg = getattr(config, "text_config", None) or config
    if encode is None:
        tok, encode, tok_desc = _load_tokenizer(hf_dir, gguf_path, int(tcfg.vocab_size), log)
    else:
        tok, tok_desc = None, f"custom:{getattr(encode, '__name__', 'encode')}"
    ident = check_identity(config, gguf_path, tok)
    windows = layer_windows(config)
    data = load_calibration_data(dataset, encode, ctx=ctx, n_samples=samples, seed=seed, text_field=text_field,
                                 split=split, tokenizer_desc=tok_desc)
    timings["data_s"] = time.perf_counter() - t0

    settings = dict(budget=budget, patterns=list(patterns), params={n: p.params() for n, p in pats.items()},
                    ctx=ctx, n_cont=n_cont, n_eval=n_eval, phases=list(phases), signal=signal, seed=seed,
                    samples=samples, tool=SIGNALS_VERSION)
    sig_path = signals_path_for(out, plan_out)
    key = _hash_inputs(hf_dir, config, data.fingerprint(), settings)
    sig = load_signals(sig_path, key) if reuse_signals else None
    reused = sig is not None
    n_layer = int(tcfg.num_hidden_layers)
    R = len(patterns)
    if reused:
        log(f"reusing signals from {sig_path} (same inputs)")
    else:
        t0 = time.perf_counter()
        S.register_attention()
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                     attn_implementation=S.ATTN_IMPL).to(device).eval()
        timings["load_s"] = time.perf_counter() - t0
        attn_mods = [layer.self_attn for layer in model.model.layers]
        w_o = [m.o_proj.weight.detach().float().cpu() for m in attn_mods]
        b_o = [m.o_proj.bias.detach().float().cpu() if getattr(m.o_proj, "bias", None) is not None else None
               for m in attn_mods]
        scale = float(attn_mods[0].scaling)
        cos_pre = np.zeros((n_layer, R))
        cos_dec = np.zeros((n_layer, R))
        ent = np.zeros(n_layer)
        nll = np.zeros((n_layer, R))
        t_fwd = t_pre = t_dec = t_nll = 0.0
        for si, ids in enumerate(tqdm(data.samples, desc="calibration samples", disable=not progress)):
            t0 = time.perf_counter()
            S.STATE.capture = {}
            try:
                with torch.no_grad():
                    model.model(torch.tensor([ids], device=device), use_cache=False)
                cap = S.STATE.capture
            finally:
                S.STATE.capture = None
            if len(cap) != n_layer:
                raise CalibrationError(f"captured attention of {len(cap)} layers, expected {n_layer} (unsupported "
                                       "model: its attention does not go through transformers' attention interface)")
            layers = [S.LayerTensors(*cap[l], window=windows[l]) for l in range(n_layer)]
            t_fwd += time.perf_counter() - t0
            t0 = time.perf_counter()
            kept = {}
            for l in tqdm(range(n_layer), desc=f"sample {si + 1} prefill signals", leave=False,
                          disable=not progress):
                c, e, kl = S.prefill_layer_signals(layers[l], w_o[l], b_o[l], scale, scfg)
                cos_pre[l] += c
                ent[l] += e
                for r in range(R):
                    kept[(l, r)] = kl[r]
            t_pre += time.perf_counter() - t0
            if "decode" in phases:
                t0 = time.perf_counter()
                cos_dec += S.decode_signals(layers, w_o, b_o, scale, scfg, progress=progress,
                                            desc=f"sample {si + 1} decode steps (all layers)")
                t_dec += time.perf_counter() - t0
            del layers, cap
            if signal == "ppl":
                t0 = time.perf_counter()
                nll += _nll_signal(model, ids, ctx - n_cont, kept, n_layer, R, device)
                t_nll += time.perf_counter() - t0
        n = len(data.samples)
        sig = {"cos_prefill": cos_pre / n, "entropy": ent / n, "patterns": np.array(list(patterns))}
        if "decode" in phases:
            sig["cos_decode"] = cos_dec / n
        if signal == "ppl":
            sig["nll_prefill"] = nll / n
        timings.update(forward_s=t_fwd, prefill_signals_s=t_pre, decode_signals_s=t_dec, ppl_signals_s=t_nll)
        meta = {"inputs_sha256": key, "signals_version": SIGNALS_VERSION, "settings": settings,
                "data": data.description, "timings": timings, "hf_dir": str(hf_dir), "gguf": str(gguf_path)}
        save_signals(sig_path, sig, meta)
        del model

    # ---- plan
    from polykv_cpp import plan as plan_mod
    from calibration.planner import build_plan

    pref_pre = sig["nll_prefill"] * -1.0 if signal == "ppl" else sig["cos_prefill"]
    pref = {"prefill": pref_pre, "decode": sig.get("cos_decode", pref_pre)}
    if "prefill" not in phases and "cos_decode" in sig:
        pref["prefill"] = sig["cos_decode"]
    if sensitivity == "entropy":
        sens = {ph: sig["entropy"] for ph in ("prefill", "decode")}
    elif sensitivity == "cosine":
        sens = {ph: 1.0 - pref_cos.min(axis=1) + 1e-6 for ph, pref_cos in
                (("prefill", sig["cos_prefill"]), ("decode", sig.get("cos_decode", sig["cos_prefill"])))}
    else:
        s = np.clip(sig["nll_prefill"].max(axis=1), 0, None) + 1e-6
        sens = {"prefill": s, "decode": s}
    info = plan_mod.ModelInfo.from_gguf(gguf_path)
    signal_names = ["cosine_prefill"] + (["cosine_decode"] if "decode" in phases else []) + \
        (["delta_nll_prefill"] if signal == "ppl" else []) + ([sensitivity] if sensitivity == "entropy" else [])
    prov = plan_mod.Provenance.now(
        model=info, calibration={**data.description, "hf_checkpoint": str(hf_dir)}, signals=signal_names,
        extra={"budget_rule": budget_rule, "signal": signal, "sensitivity": sensitivity, "ctx": ctx,
               "n_cont": n_cont, "phases": list(phases), "candidates": list(patterns), "b_min": b_min,
               "signals_file": sig_path.name, "signals_sha256": key[:16], "identity": ident.get("gguf")})
    plan = build_plan(n_layer=n_layer, budget=budget, b_min=b_min, names=list(patterns), pref=pref, sens=sens,
                      rule=budget_rule, patterns=pats, full_charge=ctx, fullkv_below=fullkv_below,
                      provenance=prov, full_score={"prefill": sig["cos_prefill"],
                                                   "decode": sig.get("cos_decode", sig["cos_prefill"])})
    plan = dataclasses.replace(plan, evict_every=evict_every)
    if span_ctx and any(windows):
        plan = plan.span_split(windows, span_ctx)
        if not floor_given:
            # the split's proportions down to what the patterns always keep: with the floor at a quarter of the
            # budget, every layer was equal again at a quarter (Gemma-3-270M at 128 of 4K: 1.4, with this floor 36.7)
            plan = plan.with_floor(min(plan.b_min, max(1, always_kept(list(pats.values())))))
        log(f"budgets split by span (sliding-window layers {min(w for w in windows if w)} tokens, the others "
            f"{span_ctx}): {plan.token_budgets('prefill')}")
    wall = time.perf_counter() - t_start
    prov.extra["calibration_wall_s"] = round(wall, 1)
    plan.validate(n_layer)
    if plan_out is not None:
        plan_out.parent.mkdir(parents=True, exist_ok=True)
        plan_out.write_text(plan.to_json() + "\n")
    if out is not None:
        plan_mod.embed_plans(gguf_path, out, plan=plan, progress=progress)  # a query-agnostic plan in the source stays
    return CalibrationResult(plan=plan, out=out, signals_path=sig_path, signals=sig, reused_signals=reused,
                             wall_s=time.perf_counter() - t_start, timings=timings)
