"""PolyKV offline calibration: signals from a Hugging Face checkpoint -> a per-layer plan stored in a GGUF.

``calibrate()`` is the entry point (``polykv-cpp calibrate`` on the command line). torch/transformers are
imported lazily, inside the functions that need them.
"""

from calibration.core import DEFAULT_CTX, DEFAULT_N_CONT, DEFAULT_PATTERNS, DEFAULT_SAMPLES, calibrate

__all__ = ["calibrate", "DEFAULT_PATTERNS", "DEFAULT_SAMPLES", "DEFAULT_CTX", "DEFAULT_N_CONT"]
