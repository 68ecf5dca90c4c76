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


def fetch_sdist(cache: Path) -> Path:
    sdist_dir = cache / "sdist"
    sdist = sdist_dir / SDIST_FILE
    if sdist.exists() and sha256_of(sdist) == SDIST_SHA256:
        return sdist
    sdist_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=sdist_dir) as tmp:
        log(f"downloading {SDIST_NAME}=={SDIST_VERSION} (sdist) with pip")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--no-build-isolation", "--disable-pip-version-check", "-q", "-d", tmp,
               f"{SDIST_NAME}=={SDIST_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / SDIST_FILE
        if proc.returncode != 0 or not got.exists():
            raise PrepareError(f"pip could not download {SDIST_NAME}=={SDIST_VERSION}:\n{proc.stderr.strip()}")
        actual = sha256_of(got)
        if actual != SDIST_SHA256:
            raise PrepareError(f"{SDIST_FILE}: sha256 {actual} != expected {SDIST_SHA256}")
        os.replace(got, sdist)
    return sdist


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
            members = []
            for m in tar.getmembers():
                if m.name.startswith(VENDOR_PREFIX) and len(m.name) > len(VENDOR_PREFIX):
                    m.name = m.name[len(VENDOR_PREFIX):]
                    members.append(m)
            tar.extractall(tmp, members=members, filter="data")
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
