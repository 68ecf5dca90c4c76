"""A Hugging Face checkpoint for a GGUF: transformers reads the GGUF (dequantizing it) and saves it.

Used when ``polykv-cpp calibrate`` gets no ``--hf``: the checkpoint is written once to
``~/.cache/polykv-cpp/hf/<gguf stem>`` (or ``$POLYKV_CPP_HF``) and reused. The signals are then measured on the
weights llama.cpp runs (dequantized to float32).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from polykv_cpp.errors import CalibrationError

ENV_HF_DIR = "POLYKV_CPP_HF"


def hf_cache_dir() -> Path:
    env = os.environ.get(ENV_HF_DIR)
    return Path(env) if env else Path.home() / ".cache" / "polykv-cpp" / "hf"


def hf_from_gguf(gguf_path: str | Path, out_dir: str | Path | None = None, *, log=print) -> Path:
    """The checkpoint directory for ``gguf_path`` (created if missing). Raises CalibrationError when
    transformers cannot read this GGUF."""
    gguf_path = Path(gguf_path)
    out = Path(out_dir) if out_dir is not None else hf_cache_dir() / gguf_path.stem
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise CalibrationError(f"converting a GGUF needs torch and transformers ({e})") from None
    log(f"writing a Hugging Face checkpoint of {gguf_path.name} to {out} (once)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        model.save_pretrained(tmp)
        try:
            AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(tmp)
        except Exception as e:  # a model without a tokenizer transformers understands: bytes fallback later
            log(f"warning: no tokenizer from {gguf_path.name}: {e}")
    except CalibrationError:
        raise
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CalibrationError(f"transformers cannot load {gguf_path} ({type(e).__name__}: {e}); pass --hf with "
                               "the original checkpoint") from None
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
