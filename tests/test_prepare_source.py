"""native/prepare_source.py: what a fresh machine goes through before the first compile (no build here).

The whole path (download under pip's build isolation into an empty cache, sha256, unpack, patches) is
checked by scripts/check_fresh_source.sh, which CI runs before the test suite.
"""

import importlib.util
import io
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prepare():
    spec = importlib.util.spec_from_file_location("prepare_source", ROOT / "native" / "prepare_source.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tar(members: list[tarfile.TarInfo], path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for m in members:
            data = b"x" * m.size if m.isfile() else None
            tar.addfile(m, io.BytesIO(data) if data is not None else None)
    return path


def _member(prepare, name: str, kind=tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(prepare.VENDOR_PREFIX + name if not name.startswith("/") else name)
    m.type = kind
    m.linkname = linkname
    m.size = 3 if kind == tarfile.REGTYPE else 0
    return m


@pytest.mark.parametrize("with_data_filter", [True, False])
def test_vendor_members_are_renamed_and_only_vendor_files_kept(prepare, tmp_path, monkeypatch, with_data_filter):
    if not with_data_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    outside = tarfile.TarInfo("llama_cpp_python-0.3.36/pyproject.toml")
    outside.size = 3
    path = _tar([outside, _member(prepare, "include/llama.h"),
                 _member(prepare, "src/alias.h", tarfile.LNKTYPE, prepare.VENDOR_PREFIX + "include/llama.h")],
                tmp_path / "s.tar.gz")
    with tarfile.open(path) as tar:
        members = prepare.vendor_members(tar)
    assert [(m.name, m.linkname) for m in members] == [("include/llama.h", ""), ("src/alias.h", "include/llama.h")]


@pytest.mark.parametrize("name,kind,linkname", [
    ("../../etc/evil", tarfile.REGTYPE, ""),
    ("src/link", tarfile.SYMTYPE, "../../../etc/passwd"),
    ("dev/null", tarfile.CHRTYPE, ""),
])
def test_without_the_data_filter_escaping_members_are_refused(prepare, tmp_path, monkeypatch, name, kind, linkname):
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    path = _tar([_member(prepare, "include/llama.h"), _member(prepare, name, kind, linkname)], tmp_path / "s.tar.gz")
    with tarfile.open(path) as tar, pytest.raises(prepare.PrepareError, match="refusing"):
        prepare.vendor_members(tar)


def test_no_pip_says_where_to_put_the_sdist(prepare, tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real_find_spec(name, *a))
    with pytest.raises(prepare.PrepareError) as err:
        prepare.fetch_sdist(tmp_path)
    text = str(err.value)
    assert "pip is not importable" in text
    assert str(tmp_path / "sdist" / prepare.SDIST_FILE) in text and prepare.SDIST_SHA256 in text
    assert "POLYKV_LLAMA_CPP_SRC" in text


def test_refused_download_says_what_to_do(prepare, tmp_path, monkeypatch):
    # an index that answers nothing: pip fails at once, and the message names the two ways around it
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_INDEX", "0")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(prepare.PrepareError) as err:
        prepare.fetch_sdist(tmp_path)
    text = str(err.value)
    assert "pip could not download llama-cpp-python==0.3.36" in text
    assert "POLYKV_LLAMA_CPP_SRC" in text and str(tmp_path / "sdist") in text
    assert not any((tmp_path / "sdist").iterdir())  # nothing half-downloaded is left


def test_cached_sdist_with_a_wrong_sha256_is_not_used(prepare, tmp_path, monkeypatch):
    bad = tmp_path / "sdist" / prepare.SDIST_FILE
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not the sdist")
    monkeypatch.setattr(prepare, "pip_download_command", lambda dest: [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(prepare.PrepareError, match="pip could not download"):
        prepare.fetch_sdist(tmp_path)


@pytest.mark.parametrize("backend_here", [True, False])
def test_pip_download_uses_this_environments_backend_or_isolates(prepare, monkeypatch, backend_here):
    # pip prepares the sdist's metadata with its backend: ours when the build environment has it, else pip's own
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (real_find_spec("pytest") if backend_here else None) if name == "scikit_build_core" else real_find_spec(name, *a)))
    cmd = prepare.pip_download_command("/tmp/x")
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and cmd[-1] == "llama-cpp-python==0.3.36"
    assert ("--no-build-isolation" in cmd) == backend_here


def test_missing_patch_program_is_named(prepare, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `patch` there
    with pytest.raises(prepare.PrepareError, match="`patch` program"):
        prepare.apply_patches(tmp_path, sorted((ROOT / "native" / "patches").glob("*.patch")), {})
