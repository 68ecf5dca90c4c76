"""Calibration data: texts from a built-in offline source, local files, or a Hugging Face dataset, packed into
token windows of ``ctx`` tokens.

Sources (``--dataset``):

* ``builtin`` (default, offline, no download): the Python standard library sources of the running
  interpreter (``sysconfig.get_paths()["stdlib"]``, ``*.py`` files outside ``test``/``tests``/``idlelib``
  folders, at least 8 KiB each), sorted by path and shuffled with ``--seed``. Code with docstrings and
  comments: close to what a coder model sees. If that folder is missing, ``builtin`` falls back to
  ``generated``.
* ``generated``: deterministic pseudo-text from a fixed word list (seeded); only for tests and smoke runs.
* a local path: a text file (``.txt``, ``.md``, ``.py``, ... read whole), a ``.json``/``.jsonl`` file
  (records with a ``--text-field``, default ``text``), a ``.parquet`` file, or a directory (every such file
  in it, recursively, sorted).
* anything else: a Hugging Face dataset name, ``name[:config]``, loaded with ``datasets.load_dataset``
  (needs the network or the local HF cache), split ``--split`` (default ``train``).

Packing: texts are taken in order; each sample is the first ``ctx`` tokens of the concatenation of the next
texts (joined by two newlines) starting at a text boundary, so every sample starts at the beginning of a
document. Samples are never shorter than ``ctx``.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from polykv_cpp.errors import CalibrationError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".js", ".ts", ".go", ".rs", ".java", ".html",
                 ".tex", ".csv", ".log")
_WORDS = ("the model keeps a small cache of keys and values for every layer and drops tokens that it "
          "does not need any more while the budget stays fixed over the whole context window so that "
          "memory does not grow with the length of the input sequence").split()


@dataclass
class CalibrationData:
    """Token windows for calibration and a description for the plan's provenance."""

    samples: list[list[int]]
    description: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for s in self.samples:
            h.update(json.dumps(s).encode())
        return h.hexdigest()


def stdlib_files(min_bytes: int = 8192) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        return []
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo"}
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in skip for part in rel[:-1]):
            continue
        try:
            if p.stat().st_size >= min_bytes:
                out.append(p)
        except OSError:
            continue
    return out


def generated_texts(seed: int, n: int = 64, words: int = 4000) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        sent, out = [], []
        for _ in range(words):
            sent.append(rng.choice(_WORDS))
            if len(sent) > rng.randint(6, 18):
                out.append(" ".join(sent).capitalize() + ".")
                sent = []
        texts.append(" ".join(out))
    return texts


def _read_text(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def _records_texts(path: Path, text_field: str) -> Iterator[str]:
    suf = path.suffix.lower()
    if suf == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise CalibrationError(f"{path}:{i + 1}: not JSON ({e})") from None
                yield _field(rec, text_field, path)
    elif suf == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise CalibrationError(f"{path}: not JSON ({e})") from None
        if isinstance(data, dict) and text_field in data and isinstance(data[text_field], list):
            data = [{text_field: t} for t in data[text_field]]
        if not isinstance(data, list):
            raise CalibrationError(f"{path}: expected a list of records with a {text_field!r} field")
        for rec in data:
            yield _field(rec, text_field, path)
    elif suf == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise CalibrationError("reading parquet needs pyarrow (pip install pyarrow)") from None
        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise CalibrationError(f"{path}: no column {text_field!r} (has {', '.join(table.column_names)})")
        for t in table.column(text_field).to_pylist():
            if isinstance(t, str):
                yield t
    else:
        yield _read_text(path)


def _field(rec: Any, text_field: str, path: Path) -> str:
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict) or text_field not in rec:
        raise CalibrationError(f"{path}: record without a {text_field!r} field (use --text-field)")
    return str(rec[text_field])


def iter_texts(dataset: str, *, seed: int, text_field: str = "text", split: str = "train"
               ) -> tuple[Iterable[str], dict[str, Any]]:
    """(texts, description) for a ``--dataset`` value (see the module docstring)."""
    if dataset in ("builtin", "builtin:stdlib"):
        files = stdlib_files()
        if files:
            rng = random.Random(seed)
            order = files[:]
            rng.shuffle(order)
            h = hashlib.sha256("\n".join(str(f) for f in files).encode()).hexdigest()[:16]
            desc = {"dataset": "builtin:stdlib", "source": str(Path(sysconfig.get_paths()["stdlib"])),
                    "n_files": len(files), "files_sha256": h}
            return (_read_text(p) for p in order), desc
        dataset = "generated"
    if dataset == "generated":
        return generated_texts(seed), {"dataset": "generated", "seed": seed}
    path = Path(dataset)
    if path.exists():
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and
                           p.suffix.lower() in TEXT_SUFFIXES + (".json", ".jsonl", ".parquet"))
            if not files:
                raise CalibrationError(f"{path}: no text/json/jsonl/parquet files in this directory")
        else:
            files = [path]

        def gen() -> Iterator[str]:
            for f in files:
                yield from _records_texts(f, text_field)
        return gen(), {"dataset": str(path), "n_files": len(files), "text_field": text_field}
    if dataset.startswith(("/", "./", "../", "~")) or dataset.endswith(tuple(TEXT_SUFFIXES) + (".json", ".jsonl",
                                                                                              ".parquet")):
        raise CalibrationError(f"calibration data not found: {dataset}")
    try:
        import datasets as hf_datasets
    except ImportError:
        raise CalibrationError("loading a dataset by name needs the 'datasets' package") from None
    name, _, config = dataset.partition(":")
    try:
        ds = hf_datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # network, unknown name, ...
        raise CalibrationError(f"cannot load dataset {dataset!r}: {e}. Use --dataset builtin (offline) or a "
                               "local file") from None
    if text_field not in ds.column_names:
        raise CalibrationError(f"dataset {dataset!r} has no column {text_field!r} "
                               f"(columns: {', '.join(ds.column_names)}); use --text-field")
    ds = ds.shuffle(seed=seed)
    return (r[text_field] for r in ds), {"dataset": dataset, "split": split, "text_field": text_field}


def pack(texts: Iterable[str], encode: Callable[[str], list[int]], *, ctx: int, n_samples: int,
         sep: str = "\n\n") -> list[list[int]]:
    """``n_samples`` windows of exactly ``ctx`` tokens, each starting at a text boundary."""
    samples: list[list[int]] = []
    buf: list[int] = []
    sep_ids = encode(sep) if sep else []
    for t in texts:
        if not t or not t.strip():
            continue
        ids = encode(t)
        if buf:
            buf = buf + sep_ids
        buf = buf + ids
        if len(buf) >= ctx:
            samples.append(buf[:ctx])
            buf = []
            if len(samples) >= n_samples:
                break
    if len(samples) < n_samples:
        raise CalibrationError(f"the calibration data gave only {len(samples)} samples of {ctx} tokens "
                               f"({n_samples} asked); use more data, fewer --samples or a smaller --ctx")
    return samples


def byte_encoder(n_vocab: int) -> Callable[[str], list[int]]:
    """Fallback when a checkpoint has no tokenizer: UTF-8 bytes as token ids (mod vocab). Tests only."""
    def enc(t: str) -> list[int]:
        return [b % n_vocab for b in t.encode("utf-8")]
    return enc


def load_calibration_data(dataset: str, encode: Callable[[str], list[int]], *, ctx: int, n_samples: int,
                          seed: int, text_field: str = "text", split: str = "train",
                          tokenizer_desc: str = "") -> CalibrationData:
    texts, desc = iter_texts(dataset, seed=seed, text_field=text_field, split=split)
    samples = pack(texts, encode, ctx=ctx, n_samples=n_samples)
    desc = {**desc, "n_samples": n_samples, "ctx": ctx, "seed": seed, "tokenizer": tokenizer_desc}
    data = CalibrationData(samples=samples, description=desc)
    data.description["tokens_sha256"] = data.fingerprint()[:16]
    return data
