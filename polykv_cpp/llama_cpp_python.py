"""llama-cpp-python on our libllama: plans in the apps that embed llama.cpp through `llama_cpp.Llama`.

llama-cpp-python 0.3.36 vendors the very llama.cpp commit we patch (0c1e57098), so its ctypes bindings match our
library's C API; our functions are appended to it. It documents one way to use a library built elsewhere: install
it with ``-DLLAMA_BUILD=OFF`` (nothing native is compiled) and load libllama from ``LLAMA_CPP_LIB_PATH``, or from
its package's ``lib/`` folder when that variable is unset. ``polykv-cpp llama-cpp-python install`` does both
steps: pip-installs the pinned version that way and points ``llama_cpp/lib`` at our build, so that plain
``from llama_cpp import Llama`` loads our library, and ``Llama(model_path="m.polykv.gguf")`` follows the plan in
the GGUF (or ``LLAMA_POLYKV_PLAN``) like every stock tool.

Notes: llama-cpp-python's default is one sequence per context; ``embedding=True`` asks for up to 256, and with a
plan each gets caches of the plan's size (memory grows with the count); llama-cpp-python's prompt-prefix reuse between calls keeps the compressed cache of
the previous call (positions the plan evicted stay evicted), as a chat session with compression does.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from polykv_cpp import _native
from polykv_cpp.errors import NativeError, PolyKVError

#: the llama-cpp-python release whose vendored llama.cpp our library is built from (native/prepare_source.py)
PINNED_VERSION = "0.3.36"
SDIST_FILE = f"llama_cpp_python-{PINNED_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: configure llama-cpp-python without its own llama.cpp and llava builds
CMAKE_ARGS = "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"


def _cached_sdist() -> Path | None:
    """The sdist our build downloaded and checked (``POLYKV_CPP_CACHE`` or ~/.cache/polykv-cpp), if still intact."""
    env = os.environ.get("POLYKV_CPP_CACHE")
    base = Path(env).expanduser() if env else Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "polykv-cpp"
    path = base / "sdist" / SDIST_FILE
    if not path.is_file():
        return None
    from polykv_cpp.models import _sha256_file

    return path if _sha256_file(path) == SDIST_SHA256 else None


def install_command() -> tuple[list[str], dict[str, str]]:
    """The pip command (and environment) that installs the pinned llama-cpp-python without its own libllama."""
    source = _cached_sdist()
    target = str(source) if source else f"llama-cpp-python=={PINNED_VERSION}"
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS}
    return [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--force-reinstall", "--no-deps",
            target], env


def package_dir() -> Path:
    """Where llama-cpp-python is installed, found without importing it (importing loads a libllama)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise PolyKVError("llama-cpp-python is not installed: run `polykv-cpp llama-cpp-python install`")
    return Path(list(spec.submodule_search_locations)[0])


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        return None


def link() -> Path:
    """Point llama-cpp-python's ``lib/`` folder at our library folder; returns the link.

    Refuses a ``lib/`` that holds llama-cpp-python's own build (a default install): replacing files of another
    package's build is the user's call, not ours."""
    version = installed_version()
    if version != PINNED_VERSION:
        raise PolyKVError(f"llama-cpp-python {version or '(none)'} is installed; our library matches "
                          f"{PINNED_VERSION} only: run `polykv-cpp llama-cpp-python install`")
    ours = _native.lib_dir().resolve()
    if not (ours / "libllama.so").exists() and not any(ours.glob("libllama.*")):
        raise PolyKVError(f"no libllama in {ours}: install polykv-cpp first")
    lib = package_dir() / "lib"
    if lib.is_symlink():
        lib.unlink()
    elif lib.exists():
        raise PolyKVError(f"{lib} holds llama-cpp-python's own llama.cpp build: reinstall it without one "
                          f"(`polykv-cpp llama-cpp-python install`) or set LLAMA_CPP_LIB_PATH={ours}")
    lib.symlink_to(ours, target_is_directory=True)
    return lib


def import_llama_cpp() -> Any:
    """``import llama_cpp`` on our library (sets ``LLAMA_CPP_LIB_PATH`` when unset) and check that it is ours."""
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(_native.lib_dir()))
    import llama_cpp

    check_same_library(llama_cpp)
    return llama_cpp


def check_same_library(llama_cpp_module: Any) -> None:
    """Raise unless llama-cpp-python and our bindings loaded the same libllama (a context pointer from one
    library passed to another would crash)."""
    theirs = Path(llama_cpp_module.llama_cpp._lib._name).resolve()
    ours = (_native.lib_dir() / theirs.name).resolve()
    if theirs != ours:
        raise NativeError(f"llama-cpp-python loaded {theirs}, not polykv-cpp's {ours}: run `polykv-cpp "
                          f"llama-cpp-python install` or set LLAMA_CPP_LIB_PATH={ours.parent} before importing it")
    if not hasattr(llama_cpp_module.llama_cpp._lib, "llama_polykv_version"):
        raise NativeError(f"{theirs} has no polykv-cpp extension")


def _context_pointer(llm: Any):
    """Our cffi view of a ``llama_cpp.Llama``'s llama_context."""
    import llama_cpp

    check_same_library(llama_cpp)
    address = ctypes.cast(llm._ctx.ctx, ctypes.c_void_p).value  # llama-cpp-python's LlamaContext wrapper
    if not address:
        raise NativeError("this Llama has no context (closed?)")
    return _native.ffi.cast("struct llama_context *", address)


def kv_layer_stats(llm: Any) -> list:
    """Per-layer KV memory of a ``llama_cpp.Llama``'s context under its plan (`Context.kv_layer_stats`); empty
    without a plan."""
    from polykv_cpp.api import layer_stats

    return layer_stats(_native.load(), _context_pointer(llm))


def kv_bytes(llm: Any) -> tuple[int, int]:
    """(bytes the plan's caches hold, bytes a FullKV cache of the same n_ctx would hold); (0, 0) without a plan."""
    stats = kv_layer_stats(llm)
    return sum(s.bytes for s in stats), sum(s.bytes_fullkv for s in stats)


def cmd_llama_cpp_python(args: argparse.Namespace) -> int:
    if args.action == "install":
        cmd, env = install_command()
        print(f"CMAKE_ARGS=\"{CMAKE_ARGS}\" {' '.join(cmd[2:])}", file=sys.stderr)
        r = subprocess.run(cmd, env=env)
        if r.returncode != 0:
            raise PolyKVError(f"pip failed (exit {r.returncode}) installing llama-cpp-python {PINNED_VERSION}")
        deps = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "typing-extensions>=4.5",
                "numpy>=1.20", "diskcache>=5.6.1", "jinja2>=2.11.3"]
        if subprocess.run(deps).returncode != 0:
            raise PolyKVError("pip failed installing llama-cpp-python's dependencies")
    lib = link()
    print(f"llama-cpp-python {PINNED_VERSION}: {lib} -> {_native.lib_dir().resolve()}")
    print("from llama_cpp import Llama; Llama(model_path='model.polykv.gguf') now follows the plan in the GGUF")
    return 0


def register_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "llama-cpp-python", help="use llama-cpp-python on our libllama (plans in llama_cpp.Llama)",
        description=f"install: pip-install llama-cpp-python=={PINNED_VERSION} without its own llama.cpp build "
                    f"(CMAKE_ARGS='{CMAKE_ARGS}'; from the sdist our build cached when it is there) and link its "
                    "lib/ folder to our library. link: only the link, for an install made that way.")
    p.add_argument("action", choices=("install", "link"))
    p.set_defaults(func=cmd_llama_cpp_python)
