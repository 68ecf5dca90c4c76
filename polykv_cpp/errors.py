"""Exceptions raised by polykv-cpp. The CLI turns any of them into a one-line message and exit code 2."""


class PolyKVError(Exception):
    """Base class of every error polykv-cpp reports to users."""


class NativeError(PolyKVError):
    """A call into libllama failed; the message carries what llama.cpp logged about it."""


class ModelLoadError(NativeError):
    """A GGUF file could not be loaded (missing, not a GGUF, corrupt, unsupported)."""


class PlanError(PolyKVError, ValueError):
    """A PolyKV plan is malformed or does not fit the model."""


class ModelFetchError(PolyKVError):
    """A packaged model could not be downloaded, assembled or verified."""


class CalibrationError(PolyKVError):
    """Calibration could not run (mismatched checkpoint and GGUF, bad dataset, ...)."""
