"""Model identity check: the Hugging Face checkpoint used for calibration must be the model in the GGUF.

Compared: number of layers, attention heads, KV heads, head dimension, vocabulary size (GGUF: the
``token_embd.weight`` rows, else ``tokenizer.ggml.tokens`` length, else ``{arch}.vocab_size``), and where both
sides have one, a tokenizer fingerprint: the token strings of up to 2,000 ids spread over the vocabulary must
agree (>= 99%). A mismatch raises CalibrationError naming every field that differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polykv_cpp.errors import CalibrationError

# HF model_type -> GGUF general.architecture, where they differ
_ARCH_ALIASES = {"qwen2": "qwen2", "llama": "llama", "gemma3_text": "gemma3", "gemma3": "gemma3",
                 "mistral": "llama", "qwen3": "qwen3", "phi3": "phi3"}


@dataclass
class Identity:
    arch: str | None
    n_layer: int | None
    n_head: int | None
    n_head_kv: int | None
    head_dim: int | None
    n_vocab: int | None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def hf_identity(config: Any) -> Identity:
    c = getattr(config, "text_config", None) or config
    n_head = getattr(c, "num_attention_heads", None)
    head_dim = getattr(c, "head_dim", None)
    if head_dim is None and n_head:
        head_dim = c.hidden_size // n_head
    mt = getattr(c, "model_type", None)
    return Identity(arch=_ARCH_ALIASES.get(mt, mt), n_layer=getattr(c, "num_hidden_layers", None), n_head=n_head,
                    n_head_kv=getattr(c, "num_key_value_heads", None) or n_head, head_dim=head_dim,
                    n_vocab=getattr(c, "vocab_size", None))


def gguf_identity(path: str | Path) -> tuple[Identity, Any]:
    """(identity, gguf reader) of a GGUF file."""
    try:
        import gguf
    except ImportError:
        raise CalibrationError("the identity check needs the 'gguf' package (pip install gguf)") from None
    p = Path(path)
    if not p.is_file():
        raise CalibrationError(f"GGUF not found: {p}")
    try:
        r = gguf.GGUFReader(p, "r")
    except Exception as e:
        raise CalibrationError(f"{p} is not a readable GGUF: {e}") from None

    def val(key: str) -> Any:
        f = r.get_field(key)
        if f is None:
            return None
        try:
            return f.contents()
        except Exception:
            return None

    arch = val("general.architecture")
    n_head = val(f"{arch}.attention.head_count")
    if isinstance(n_head, list):          # per-layer head counts (some archs): take the first
        n_head = n_head[0] if n_head else None
    n_head_kv = val(f"{arch}.attention.head_count_kv")
    if isinstance(n_head_kv, list):
        n_head_kv = n_head_kv[0] if n_head_kv else None
    head_dim = val(f"{arch}.attention.key_length")
    emb = val(f"{arch}.embedding_length")
    if head_dim is None and emb and n_head:
        head_dim = emb // n_head
    n_vocab = None
    for t in r.tensors:
        if t.name == "token_embd.weight":
            n_vocab = int(t.shape[-1]) if len(t.shape) > 1 else None
            break
    if n_vocab is None:
        f = r.get_field("tokenizer.ggml.tokens")
        n_vocab = len(f.data) if f is not None else val(f"{arch}.vocab_size")
    return Identity(arch=arch, n_layer=val(f"{arch}.block_count"), n_head=n_head,
                    n_head_kv=n_head_kv or n_head, head_dim=head_dim, n_vocab=n_vocab), r


def gguf_tokens(reader: Any, ids: list[int]) -> dict[int, str] | None:
    f = reader.get_field("tokenizer.ggml.tokens")
    if f is None:
        return None
    out = {}
    n = len(f.data)
    for i in ids:
        if i < n:
            out[i] = bytes(f.parts[f.data[i]]).decode("utf-8", errors="replace")
    return out


def check_identity(config: Any, gguf_path: str | Path, tokenizer: Any = None) -> dict[str, Any]:
    """Raise CalibrationError if the HF config (and tokenizer) do not match the GGUF. Returns a report."""
    hf = hf_identity(config)
    gg, reader = gguf_identity(gguf_path)
    diffs = []
    for k in ("n_layer", "n_head", "n_head_kv", "head_dim", "n_vocab"):
        a, b = getattr(hf, k), getattr(gg, k)
        if a is not None and b is not None and int(a) != int(b):
            diffs.append(f"{k}: checkpoint {a}, GGUF {b}")
    if gg.n_layer is None:
        diffs.append("the GGUF has no block_count metadata")
    if hf.arch and gg.arch and hf.arch != gg.arch:
        diffs.append(f"architecture: checkpoint {hf.arch}, GGUF {gg.arch}")
    report: dict[str, Any] = {"checkpoint": hf.as_dict(), "gguf": gg.as_dict(), "tokenizer_checked": False}
    if tokenizer is not None and not diffs:
        n = min(int(hf.n_vocab or 0), int(gg.n_vocab or 0))
        if n > 0:
            step = max(1, n // 2000)
            ids = list(range(0, n, step))
            gt = gguf_tokens(reader, ids)
            if gt:
                try:
                    ht = tokenizer.convert_ids_to_tokens(list(gt))
                except Exception:
                    ht = None
                if ht is not None:
                    pairs = [(a, b) for a, b in zip(gt.values(), ht) if b is not None]
                    same = sum(a == b for a, b in pairs)
                    report["tokenizer_checked"] = True
                    report["tokenizer_agreement"] = same / max(1, len(pairs))
                    if pairs and same / len(pairs) < 0.99:
                        bad = [(i, a, b) for i, (a, b) in zip(gt, pairs) if a != b][:3]
                        diffs.append(f"tokenizer: only {same}/{len(pairs)} sampled token strings agree "
                                     f"(e.g. id {bad[0][0]}: GGUF {bad[0][1]!r} vs checkpoint {bad[0][2]!r})")
    if diffs:
        raise CalibrationError("the Hugging Face checkpoint is not the model in the GGUF " f"{gguf_path}: "
                               + "; ".join(diffs))
    return report
