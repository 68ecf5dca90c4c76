"""Calibration signals (see docs/calibration.md for the formulas).

One FullKV forward per sample captures every layer's post-RoPE queries, keys and values (a custom
transformers attention function). Then, for each layer ALONE (the other layers keep their FullKV inputs):

* prefill preference ``cos_prefill[l, r]``: the sample of ``T`` tokens is split into a context ``[0, C)`` and a
  continuation ``[C, T)`` (``C = T - n_cont``). Pattern ``r`` compresses the context's KV of layer ``l`` to
  ``b`` tokens at the end of the context, exactly as the runtime does after a prompt (selection inputs: the
  context's own full causal attention, via ``polykv_cpp.patterns``). The continuation queries then attend to
  the kept context tokens plus the continuation itself (causal). Signal = mean over continuation tokens of
  the cosine similarity between the layer's attention output (after ``o_proj``) with compressed and with
  full KV. A sliding-window layer (``LayerTensors.window``) is scored by what it computes: every query, the
  selection's and the continuation's, sees only the keys less than its window back.
* decode preference ``cos_decode[l, r]``: positions ``[0, b)`` are the prompt (it fits, nothing evicted);
  every later token ``t`` is a decode step: it is appended, attends over the kept set, then the pattern
  evicts back to ``b`` with the decode-time state of ``patterns.simulate`` (H2O accumulator initialised from
  the prompt's column sums; SnapKV ring buffer of the last ``obs_window`` head-mean rows; TOVA the current
  row; K-norm the key norms). Signal = mean cosine (as above) over ``n_eval`` evenly spaced steps.
* ``entropy[l]``: attention entropy (nats) of the continuation queries over the full causal KV, averaged over
  heads and queries.
* optional ``nll_prefill[l, r]`` (``--signal ppl``): increase of the continuation's mean negative
  log-likelihood when only layer ``l``'s context KV is compressed by ``r`` (the model is re-run on the
  continuation with the context cache; exact for the prefill phase because the context's own states do not
  depend on the compression, which happens after the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from polykv_cpp import patterns as P

ATTN_IMPL = "polykv_calib"


class _State:
    capture: dict[int, tuple] | None = None
    # layer -> bool tensor [n_key] of allowed keys for queries at positions >= mask_from
    key_mask: dict[int, Any] = {}
    mask_from: int = 0


STATE = _State()


def register_attention() -> None:
    """Register the capturing attention function with transformers (idempotent)."""
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def polykv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if STATE.capture is not None and layer is not None:
            STATE.capture[layer] = (query[0].detach().float().cpu(), key[0].detach().float().cpu(),
                                    value[0].detach().float().cpu())
        km = STATE.key_mask.get(layer) if layer is not None else None
        if km is not None:
            # queries here are the continuation (positions >= mask_from); forbid evicted context keys
            n_q, n_k = query.shape[-2], key.shape[-2]
            allowed = torch.ones(n_k, dtype=torch.bool, device=query.device)
            allowed[:km.shape[0]] = km.to(query.device)
            q_pos = torch.arange(n_k - n_q, n_k, device=query.device)
            k_pos = torch.arange(n_k, device=query.device)
            causal = visible(q_pos, k_pos, getattr(module, "sliding_window", None))
            bias = torch.zeros(n_q, n_k, dtype=query.dtype, device=query.device)
            bias.masked_fill_(~(causal & allowed[None, :]), float("-inf"))
            return sdpa_attention_forward(module, query, key, value, bias[None, None], dropout=dropout,
                                          scaling=scaling, is_causal=False, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)

    AttentionInterface.register(ATTN_IMPL, polykv_attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


@dataclass
class LayerTensors:
    """Per-layer tensors of one sample (torch, float32, CPU)."""

    q: Any          # [H, T, d]
    k: Any          # [Hkv, T, d]
    v: Any          # [Hkv, T, d]
    window: int | None = None   # a sliding-window layer's window: a query sees the keys less than this far back


def visible(q_pos: Any, k_pos: Any, window: int | None) -> Any:
    """Bool [len(q_pos), len(k_pos)]: the keys each query attends to, causal and, in a sliding-window layer, less
    than ``window`` positions back (transformers' and llama.cpp's standard sliding window)."""
    m = k_pos[None, :] <= q_pos[:, None]
    if window:
        m = m & (q_pos[:, None] - k_pos[None, :] < window)
    return m


def layers_visible(q_pos: Any, k_pos: Any, windows: Sequence[int | None]) -> Any:
    """Bool [L, len(q_pos), len(k_pos)]: :func:`visible` for each layer's window, one mask per distinct window;
    [1, ...] (broadcast over the layers) when every layer has the same one, as on a model without windows."""
    import torch

    masks = {w: visible(q_pos, k_pos, w) for w in dict.fromkeys(windows)}
    if len(masks) == 1:
        return next(iter(masks.values()))[None]
    return torch.stack([masks[w] for w in windows])


@dataclass
class SignalConfig:
    budget: int
    patterns: Sequence[str]
    n_cont: int = 128
    n_eval: int = 48
    phases: Sequence[str] = ("prefill", "decode")
    pattern_params: dict[str, dict[str, Any]] = field(default_factory=dict)

    def pattern(self, name: str) -> P.Pattern:
        return P.get_pattern(name, ignore_unknown=True, **self.pattern_params.get(name, {}))


def _rep(x, groups: int):
    """[Hkv, T, d] -> [H, T, d] (GQA: query head h uses KV head h // groups)."""
    return x.repeat_interleave(groups, dim=0) if groups > 1 else x


def _cos(a, b, eps: float = 1e-12):
    import torch
    return torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=eps)


def prefill_layer_signals(lt: LayerTensors, w_o, b_o, scale: float, cfg: SignalConfig
                          ) -> tuple[np.ndarray, float, list[np.ndarray]]:
    """(cos_prefill[R], entropy, kept context indices per pattern) of one layer of one sample."""
    import torch

    q, k, v = lt.q, lt.k, lt.v
    H, T, d = q.shape
    G = H // k.shape[0]
    C = T - cfg.n_cont
    kr, vr = _rep(k, G), _rep(v, G)

    # continuation queries over full causal KV
    lg = torch.einsum("htd,hsd->hts", q[:, C:], kr) * scale                       # [H, n_cont, T]
    causal = visible(torch.arange(C, T), torch.arange(T), lt.window)              # [n_cont, T]
    lg = lg.masked_fill(~causal[None], float("-inf"))
    p_full = torch.softmax(lg, dim=-1)
    ent = -(p_full * torch.log(p_full.clamp_min(1e-30))).sum(-1)                   # [H, n_cont]
    entropy = float(ent.mean())

    def out_of(p):
        o = torch.einsum("hts,hsd->thd", p, vr).reshape(p.shape[1], H * d)
        o = o @ w_o.T
        return o + b_o if b_o is not None else o

    o_full = out_of(p_full)

    # selection inputs from the context's own prefill attention (exact mode, end of the context)
    need_all = any(cfg.pattern(n).query_rows == "all" for n in cfg.patterns)
    acc = None
    if need_all:
        acc = torch.zeros(C)
        for s in range(0, C, 256):
            e = min(C, s + 256)
            l2 = torch.einsum("htd,hsd->hts", q[:, s:e], kr[:, :C]) * scale
            m = visible(torch.arange(s, e), torch.arange(C), lt.window)
            p2 = torch.softmax(l2.masked_fill(~m[None], float("-inf")), dim=-1)
            acc += p2.mean(0).sum(0)
    max_w = max([getattr(cfg.pattern(n), "obs_window", 0) for n in cfg.patterns] + [1])
    s0 = max(0, C - max_w)
    l3 = torch.einsum("htd,hsd->hts", q[:, s0:C], kr[:, :C]) * scale
    m3 = visible(torch.arange(s0, C), torch.arange(C), lt.window)
    rows = torch.softmax(l3.masked_fill(~m3[None], float("-inf")), dim=-1).double().numpy()  # [H, w, C]
    keys_ctx = k[:, :C].double().numpy()

    cos = np.zeros(len(cfg.patterns))
    kept_all = []
    for ri, name in enumerate(cfg.patterns):
        pat = cfg.pattern(name)
        if pat.query_rows == "all":
            kept = pat.select(cfg.budget, acc=acc.double().numpy())
        elif pat.query_rows in ("window", "last"):
            kept = pat.select(cfg.budget, attn=rows)
        elif pat.needs_keys:
            kept = pat.select(cfg.budget, keys=keys_ctx)
        else:
            kept = pat.select(cfg.budget, n_key=C)
        kept_all.append(np.asarray(kept, dtype=np.int64))
        allowed = torch.zeros(T, dtype=torch.bool)
        allowed[torch.from_numpy(kept_all[-1])] = True
        allowed[C:] = True
        p = torch.softmax(lg.masked_fill(~allowed[None, None, :], float("-inf")), dim=-1)
        cos[ri] = float(_cos(out_of(p), o_full).mean())
    return cos, entropy, kept_all


def decode_signals(layers: Sequence[LayerTensors], w_o: Sequence[Any], b_o: Sequence[Any], scale: float,
                   cfg: SignalConfig, chunk: int = 64, progress: bool = False, desc: str = "decode steps"
                   ) -> np.ndarray:
    """cos_decode[L, R] of one sample, all layers at once (see the module docstring)."""
    import torch

    L = len(layers)
    H, T, d = layers[0].q.shape
    Hkv = layers[0].k.shape[0]
    G = H // Hkv
    b = cfg.budget
    P0 = b
    if T <= P0 + 1:
        return np.ones((L, len(cfg.patterns)))
    q = torch.stack([lt.q for lt in layers])                     # [L, H, T, d]
    k = torch.stack([lt.k for lt in layers])                     # [L, Hkv, T, d]
    v = torch.stack([lt.v for lt in layers])
    kr = k.repeat_interleave(G, dim=1) if G > 1 else k
    vr = v.repeat_interleave(G, dim=1) if G > 1 else v
    Wo = torch.stack(list(w_o))                                  # [L, hidden, H*d]
    Bo = torch.stack(list(b_o)) if b_o[0] is not None else None
    norms = k.norm(dim=-1).mean(1).double().numpy()              # [L, T] mean over KV heads of key norms
    v_np = v.numpy()

    n_steps = T - P0
    eval_steps = sorted(set(np.linspace(P0, T - 1, min(cfg.n_eval, n_steps)).round().astype(int).tolist()))
    eval_set = set(eval_steps)

    # prompt statistics (full causal attention of the prompt queries)
    lgp = torch.einsum("lhtd,lhsd->lhts", q[:, :, :P0], kr[:, :, :P0]) * scale
    windows = [lt.window for lt in layers]
    mp = layers_visible(torch.arange(P0), torch.arange(P0), windows)                 # [L or 1, P0, P0]
    pp = torch.softmax(lgp.masked_fill(~mp[:, None], float("-inf")), dim=-1).mean(1)   # [L, P0, P0]
    acc0 = pp.sum(1).double().numpy()                            # [L, P0]
    pats = [cfg.pattern(n) for n in cfg.patterns]
    states = []
    for pat in pats:
        w = getattr(pat, "obs_window", 0) if pat.query_rows == "window" else 0
        ring = pp[:, P0 - min(w, P0):, :].double().numpy() if w else None
        states.append({"kept": np.broadcast_to(np.arange(P0), (L, P0)).copy(), "acc": acc0.copy(), "ring": ring})
    del lgp, pp

    cos_sum = np.zeros((L, len(pats)))
    n_eval = 0
    from tqdm.auto import tqdm
    bar = tqdm(total=T - P0, desc=desc, leave=False, disable=not progress)
    for c0 in range(P0, T, chunk):
        bar.update(min(T, c0 + chunk) - c0)
        c1 = min(T, c0 + chunk)
        lgc = (torch.einsum("lhtd,lhsd->lhts", q[:, :, c0:c1], kr[:, :, :c1]) * scale)       # [L, H, c, c1]
        mc = layers_visible(torch.arange(c0, c1), torch.arange(c1), windows)
        lgc = lgc.masked_fill(~mc[:, None], float("-inf"))
        ev = [t for t in range(c0, c1) if t in eval_set]
        o_full = {}
        if ev:
            idx = torch.tensor([t - c0 for t in ev])
            pf = torch.softmax(lgc[:, :, idx], dim=-1)                                          # [L, H, e, c1]
            of = torch.einsum("lhes,lhsd->lehd", pf, vr[:, :, :c1]).reshape(L, len(ev), H * d)
            of = torch.einsum("led,lod->leo", of, Wo)
            if Bo is not None:
                of = of + Bo[:, None]
            for j, t in enumerate(ev):
                o_full[t] = of[:, j]
        lgc_np = lgc.numpy()
        for t in range(c0, c1):
            row_lg = lgc_np[:, :, t - c0, :]                                                     # [L, H, c1]
            for ri, pat in enumerate(pats):
                st = states[ri]
                cand = np.concatenate([st["kept"], np.full((L, 1), t)], axis=1)                 # [L, n+1]
                lg = np.take_along_axis(row_lg, cand[:, None, :], axis=2).astype(np.float64)
                lg -= lg.max(axis=-1, keepdims=True)
                row = np.exp(lg)
                row /= row.sum(axis=-1, keepdims=True)                                           # [L, H, n+1]
                m = row.mean(axis=1)
                if pat.query_rows == "all":
                    st["acc"] = np.concatenate([st["acc"], np.zeros((L, 1))], axis=1) + m
                if st["ring"] is not None:
                    rg = np.concatenate([st["ring"], np.zeros(st["ring"].shape[:2] + (1,))], axis=2)
                    st["ring"] = np.concatenate([rg, m[:, None, :]], axis=1)[:, -pat.obs_window:, :]
                if t in eval_set:
                    vg = np.take_along_axis(v_np, cand[:, None, :, None], axis=2)              # [L, Hkv, n+1, d]
                    rw = row.reshape(L, Hkv, G, -1).astype(np.float32)
                    o = np.matmul(rw, vg).reshape(L, H * d)                                      # [L, H*d]
                    o = torch.einsum("ld,lod->lo", torch.from_numpy(o), Wo)
                    if Bo is not None:
                        o = o + Bo
                    cos_sum[:, ri] += _cos(o, o_full[t]).double().numpy()
                n = cand.shape[1]
                if n > b:
                    if pat.query_rows == "all":
                        idx = pat.select(b, acc=st["acc"])
                    elif pat.query_rows == "window":
                        idx = pat.select(b, attn=st["ring"][:, None])
                    elif pat.query_rows == "last":
                        idx = pat.select(b, attn=row[:, :, None, :])
                    elif pat.needs_keys:
                        # K-norm only needs each token's norm: pass it as a 1-dim "key" (|x| = norm)
                        fake = np.take_along_axis(norms, cand, axis=1)[:, None, :, None]
                        idx = pat.select(b, keys=fake)
                    else:
                        idx = pat.select(b, attn=row[:, :, None, :])    # positional: shape only
                    cand = np.take_along_axis(cand, idx, axis=1)
                    if pat.query_rows == "all":
                        st["acc"] = np.take_along_axis(st["acc"], idx, axis=1)
                    if st["ring"] is not None:
                        st["ring"] = np.take_along_axis(st["ring"], idx[:, None, :], axis=2)
                st["kept"] = cand
            if t in eval_set:
                n_eval += 1
    bar.close()
    return cos_sum / max(1, n_eval)
