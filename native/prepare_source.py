#!/usr/bin/env python3
"""Prepare the patched llama.cpp tree that the polykv-cpp build compiles.

1. Take the pinned llama.cpp source: the `vendor/llama.cpp` of the PyPI sdist llama-cpp-python==0.3.36
   (llama.cpp commit 0c1e57098), downloaded with pip, checked by sha256 and unpacked once into a cache
   outside the repository; or an existing checkout of the same commit given by --llama-src.
2. Keep a working copy of it at a fixed cache path (fixed so that ccache hits across clean builds).
3. Copy our own sources (native/src, native/include) into it and apply native/patches/*.patch in order.
   Files are only rewritten when their content changes, so incremental builds stay incremental.

Prints the path of the prepared tree on its last stdout line. Exits 1 with a message naming the patch and
the file when a hunk does not apply.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_COMMIT = "0c1e57098"
VENDOR_PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
MANIFEST = ".polykv-manifest.json"


class PrepareError(Exception):
    pass


def default_cache_dir() -> Path:
    env = os.environ.get("POLYKV_CPP_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "polykv-cpp"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manual_fetch_hint(cache: Path) -> str:
    return (f"To build without the download, put {SDIST_FILE} (sha256 {SDIST_SHA256}) at {cache / 'sdist' / SDIST_FILE}, "
            f"or set POLYKV_LLAMA_CPP_SRC to a llama.cpp checkout at commit {LLAMA_CPP_COMMIT}.")


def pip_download_command(dest: str) -> list[str]:
    """`pip download` of the pinned sdist. pip prepares the sdist's metadata, which needs its build backend
    (scikit-build-core): use the one of this environment when it has it, else let pip isolate that step."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", dest, f"{SDIST_NAME}=={SDIST_VERSION}"]
    if importlib.util.find_spec("scikit_build_core") is not None:
        cmd.insert(cmd.index("-q"), "--no-build-isolation")
    return cmd


def fetch_sdist(cache: Path) -> Path:
    sdist_dir = cache / "sdist"
    sdist = sdist_dir / SDIST_FILE
    if sdist.exists():
        actual = sha256_of(sdist)
        if actual == SDIST_SHA256:
            return sdist
        log(f"{sdist}: sha256 {actual} != expected {SDIST_SHA256}; downloading it again")
    if importlib.util.find_spec("pip") is None:
        raise PrepareError(f"pip is not importable by {sys.executable}, so {SDIST_NAME}=={SDIST_VERSION} cannot be "
                           f"downloaded.\n{manual_fetch_hint(cache)}")
    sdist_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=sdist_dir) as tmp:
        log(f"downloading {SDIST_NAME}=={SDIST_VERSION} (sdist, 77 MB) with pip")
        proc = subprocess.run(pip_download_command(tmp), capture_output=True, text=True)
        got = Path(tmp) / SDIST_FILE
        if proc.returncode != 0 or not got.exists():
            detail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-20:]
            raise PrepareError(f"pip could not download {SDIST_NAME}=={SDIST_VERSION}:\n" + "\n".join(detail) +
                               f"\n{manual_fetch_hint(cache)}")
        actual = sha256_of(got)
        if actual != SDIST_SHA256:
            raise PrepareError(f"{SDIST_FILE}: sha256 {actual} != expected {SDIST_SHA256}\n{manual_fetch_hint(cache)}")
        os.replace(got, sdist)
    return sdist


def _escapes(name: str) -> bool:
    return name.startswith("/") or ".." in Path(name).parts


def vendor_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The members under vendor/llama.cpp/, renamed relative to it. Without tarfile's "data" filter (Python
    < 3.10.12 / 3.11.4) we refuse what that filter refuses: absolute or escaping names and links, devices."""
    members = []
    for m in tar.getmembers():
        if not m.name.startswith(VENDOR_PREFIX) or len(m.name) <= len(VENDOR_PREFIX):
            continue
        m.name = m.name[len(VENDOR_PREFIX):]
        if m.islnk():
            if not m.linkname.startswith(VENDOR_PREFIX):
                raise PrepareError(f"{SDIST_FILE}: refusing hard link {m.name!r} -> {m.linkname!r}")
            m.linkname = m.linkname[len(VENDOR_PREFIX):]
        if not hasattr(tarfile, "data_filter"):
            if _escapes(m.name) or not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
                raise PrepareError(f"{SDIST_FILE}: refusing member {m.name!r}")
            if m.issym() and _escapes(os.path.normpath(os.path.join(os.path.dirname(m.name), m.linkname))):
                raise PrepareError(f"{SDIST_FILE}: refusing link {m.name!r} -> {m.linkname!r}")
        members.append(m)
    return members


def unpack_pristine(cache: Path) -> Path:
    pristine = cache / f"llama.cpp-{LLAMA_CPP_COMMIT}"
    stamp = pristine / ".polykv-unpacked"
    if stamp.exists():
        return pristine
    sdist = fetch_sdist(cache)
    log(f"unpacking llama.cpp {LLAMA_CPP_COMMIT} from {sdist.name}")
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".unpack-"))
    try:
        with tarfile.open(sdist) as tar:
            members = vendor_members(tar)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, members=members, filter="data")
            else:
                tar.extractall(tmp, members=members)
        (tmp / ".polykv-unpacked").write_text(SDIST_SHA256 + "\n")
        if pristine.exists():
            shutil.rmtree(pristine)
        os.replace(tmp, pristine)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return pristine


def check_checkout(src: Path) -> None:
    if not (src / "include" / "llama.h").exists() or not (src / "src" / "llama-kv-cache.cpp").exists():
        raise PrepareError(f"{src} does not look like a llama.cpp source tree (no include/llama.h)")
    if (src / ".git").exists():
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0 and not head.stdout.strip().startswith(LLAMA_CPP_COMMIT):
            raise PrepareError(f"{src} is at commit {head.stdout.strip()[:12]}, polykv-cpp needs {LLAMA_CPP_COMMIT}")


def patch_targets(patch: Path) -> list[str]:
    targets = []
    for line in patch.read_text().splitlines():
        m = re.match(r"^\+\+\+ (?:b/)?(\S+)", line)
        if m and m.group(1) != "/dev/null":
            targets.append(m.group(1))
    return targets


def overlay_files(native: Path) -> dict[str, Path]:
    """Our own sources: native/src/X -> src/X, native/include/X -> include/X."""
    files = {}
    for sub in ("src", "include"):
        root = native / sub
        if root.is_dir():
            for p in sorted(root.rglob("*")):
                if p.is_file():
                    files[f"{sub}/{p.relative_to(root).as_posix()}"] = p
    return files


def apply_patches(pristine: Path, patches: list[Path], overlay: dict[str, Path]) -> dict[str, bytes]:
    """Return the final content of every file the overlay or the patches touch."""
    if patches and shutil.which("patch") is None:
        raise PrepareError("the `patch` program is needed to apply native/patches (Debian/Ubuntu: apt-get install patch)")
    touched = sorted({t for p in patches for t in patch_targets(p)})
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        for rel in touched:
            src = pristine / rel
            dst = stage / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.exists():
                shutil.copy2(src, dst)
        for rel, path in overlay.items():
            dst = stage / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst)
        for patch in patches:
            cmd = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-r", "-", "-d", str(stage)]
            dry = subprocess.run(cmd + ["--dry-run", "-i", str(patch)], capture_output=True, text=True)
            if dry.returncode != 0:
                failing = [m.group(1) for m in re.finditer(r"patching file (\S+)\n(?:.*\n)*?.*(?:FAILED|malformed|Reversed)",
                                                           dry.stdout)]
                where = f" (file {failing[0]})" if failing else ""
                raise PrepareError(f"patch {patch.name} does not apply{where}:\n{dry.stdout.strip()}{dry.stderr.strip()}")
            subprocess.run(cmd + ["-s", "-i", str(patch)], check=True)
        return {rel: (stage / rel).read_bytes() for rel in sorted(set(touched) | set(overlay))}


def sync_tree(pristine: Path, work: Path, final: dict[str, bytes]) -> int:
    """Make `work` = pristine + final contents, writing only files whose bytes differ."""
    stamp = work / ".polykv-copied"
    if not stamp.exists() or stamp.read_text().strip() != str(pristine):
        log(f"copying pristine tree to {work}")
        if work.exists():
            shutil.rmtree(work)
        shutil.copytree(pristine, work, symlinks=True)
        stamp.write_text(str(pristine) + "\n")
    manifest_path = work / MANIFEST
    previous = json.loads(manifest_path.read_text()) if manifest_path.exists() else []
    changed = 0
    for rel in previous:
        if rel in final:
            continue
        orig = pristine / rel
        dst = work / rel
        if orig.exists():
            if not dst.exists() or dst.read_bytes() != orig.read_bytes():
                shutil.copy2(orig, dst)
                changed += 1
        elif dst.exists():
            dst.unlink()
            changed += 1
    for rel, data in final.items():
        dst = work / rel
        if dst.exists() and dst.read_bytes() == data:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        changed += 1
    manifest_path.write_text(json.dumps(sorted(final), indent=1) + "\n")
    return changed


def log(msg: str) -> None:
    print(f"[polykv-cpp] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--native-dir", type=Path, default=here)
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--llama-src", type=Path, default=None,
                    help=f"existing llama.cpp checkout at commit {LLAMA_CPP_COMMIT} (env POLYKV_LLAMA_CPP_SRC)")
    ap.add_argument("--work-dir", type=Path, default=None, help="where the patched tree is kept")
    args = ap.parse_args(argv)

    cache = (args.cache_dir or default_cache_dir()).expanduser().resolve()
    cache.mkdir(parents=True, exist_ok=True)
    llama_src = args.llama_src or (Path(os.environ["POLYKV_LLAMA_CPP_SRC"]) if os.environ.get("POLYKV_LLAMA_CPP_SRC") else None)
    try:
        if llama_src:
            pristine = llama_src.expanduser().resolve()
            check_checkout(pristine)
        else:
            pristine = unpack_pristine(cache)
        patches = sorted((args.native_dir / "patches").glob("*.patch"))
        overlay = overlay_files(args.native_dir)
        final = apply_patches(pristine, patches, overlay)
        tag = hashlib.sha256(str(pristine).encode()).hexdigest()[:8]
        work = (args.work_dir or cache / "src" / f"llama.cpp-{LLAMA_CPP_COMMIT}-polykv-{tag}").resolve()
        changed = sync_tree(pristine, work, final)
    except PrepareError as e:
        print(f"polykv-cpp: error: {e}", file=sys.stderr)
        return 1
    log(f"llama.cpp {LLAMA_CPP_COMMIT} + {len(overlay)} own files + {len(patches)} patches ready at {work} "
        f"({changed} files rewritten)")
    print(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
