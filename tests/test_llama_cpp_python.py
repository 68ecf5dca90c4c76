"""llama-cpp-python (`llama_cpp.Llama`) on our libllama follows the plan in the GGUF.

`scripts/test.sh` installs it with `polykv-cpp llama-cpp-python install`; without it the end-to-end test skips.
llama-cpp-python takes over llama.cpp's log callback when imported, so it runs in a child process.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from polykv_cpp import llama_cpp_python as lcp
from polykv_cpp.errors import PolyKVError

CHILD = r"""
import json, sys
from polykv_cpp import llama_cpp_python as lcp
llama_cpp = lcp.import_llama_cpp()
path, prompt = sys.argv[1], json.loads(sys.argv[2])
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2, verbose=False)
out = []
for tok in llm.generate(prompt, temp=0.0):
    out.append(int(tok))
    if len(out) == 8:
        break
stats = lcp.kv_layer_stats(llm)
print(json.dumps({"tokens": out, "bytes": [s.bytes for s in stats], "fullkv": [s.bytes_fullkv for s in stats],
                  "budget": [s.budget_decode for s in stats], "evicted": sum(s.n_evicted for s in stats)}))
"""


def test_pins_match_the_native_build():
    """The version we link llama-cpp-python at is the one whose vendored llama.cpp the build patches."""
    spec = importlib.util.spec_from_file_location("prepare_source",
                                                  Path(__file__).parents[1] / "native" / "prepare_source.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    assert (lcp.PINNED_VERSION, lcp.SDIST_FILE, lcp.SDIST_SHA256) == (prep.SDIST_VERSION, prep.SDIST_FILE,
                                                                       prep.SDIST_SHA256)


def test_link_points_lib_at_our_library_and_refuses_a_real_build(tmp_path, monkeypatch):
    pkg = tmp_path / "llama_cpp"
    pkg.mkdir()
    monkeypatch.setattr(lcp, "package_dir", lambda: pkg)
    monkeypatch.setattr(lcp, "installed_version", lambda: lcp.PINNED_VERSION)
    link = lcp.link()
    assert link.is_symlink() and (link / "libllama.so").resolve() == (lcp._native.lib_dir() / "libllama.so").resolve()
    assert lcp.link() == link  # again: replaced, not nested
    link.unlink()
    (pkg / "lib").mkdir()
    with pytest.raises(PolyKVError, match="own llama.cpp build"):
        lcp.link()
    monkeypatch.setattr(lcp, "installed_version", lambda: "0.3.2")
    with pytest.raises(PolyKVError, match="0.3.2 is installed"):
        lcp.link()


def test_install_command_builds_nothing_native(monkeypatch, tmp_path):
    monkeypatch.setenv("POLYKV_CPP_CACHE", str(tmp_path))
    cmd, env = lcp.install_command()
    assert env["CMAKE_ARGS"] == "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"
    assert cmd[-1] == f"llama-cpp-python=={lcp.PINNED_VERSION}"  # no cached sdist: from the index
    (tmp_path / "sdist").mkdir()
    (tmp_path / "sdist" / lcp.SDIST_FILE).write_bytes(b"not the sdist")
    assert lcp.install_command()[0][-1] == f"llama-cpp-python=={lcp.PINNED_VERSION}"  # a bad checksum is ignored


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python not installed (`polykv-cpp llama-cpp-python install`)")
def test_llama_follows_the_plan_in_the_gguf(tiny_gguf, tmp_path):
    """`Llama(model_path=plan GGUF)` generates the tokens our own bindings generate under the same plan (greedy,
    same batch sizes), evicts, and holds the plan's KV bytes, not FullKV's."""
    from polykv_cpp.api import Model
    from polykv_cpp.plan import uniform_plan, write_gguf

    plan = uniform_plan(2, "snapkv", 48)
    path = write_gguf(tiny_gguf, tmp_path / "tiny.polykv.gguf", plan)
    prompt = [(7 * i * i + 3 * i + 11) % 380 + 2 for i in range(300)]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), json.dumps(prompt)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)  # the package pytest imports, not ./polykv_cpp
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])

    with Model(path) as model:
        model.set_plan(use_gguf=True)
        with model.context(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2) as ctx:
            want = list(ctx.generate_tokens(prompt, max_tokens=8, stop_at_eog=False))
            stats = ctx.kv_layer_stats()
    assert got["tokens"] == want
    assert got["budget"] == [48, 48] and got["evicted"] > 0
    assert got["bytes"] == [s.bytes for s in stats]
    assert sum(got["bytes"]) < sum(got["fullkv"]) / 2
