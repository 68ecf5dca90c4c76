"""polykv-cpp: PolyKV per-layer KV-cache compression on llama.cpp.

The native library (our build of llama.cpp) is loaded lazily, on first use, so that pure-Python parts
(plans, calibration, model downloads) work without it.
"""

__version__ = "0.1.0"
LLAMA_CPP_COMMIT = "0c1e57098"

from polykv_cpp.errors import ModelLoadError, NativeError, PlanError, PolyKVError  # noqa: E402

__all__ = ["__version__", "LLAMA_CPP_COMMIT", "Model", "Context", "PolyKVError", "NativeError",
           "ModelLoadError", "PlanError"]


def __getattr__(name: str):
    if name in ("Model", "Context"):
        from polykv_cpp import api

        return getattr(api, name)
    raise AttributeError(name)
