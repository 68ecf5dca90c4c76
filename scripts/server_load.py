#!/usr/bin/env python3
"""Load test of the stock llama-server with a PolyKV plan at its defaults (several slots, continuous batching).

Starts our `llama-server` on 127.0.0.1 (the plan through ``LLAMA_POLYKV_PLAN``, FullKV with ``--no-plan``), then:

1. ``--clients`` threads each send ``--requests`` requests one after the other, all threads at once: every
   request is a document of ``--min-tokens``..``--max-tokens`` tokens (Python standard-library sources, a different
   piece each time) and a question, answered greedily (temperature 0, ``--n-predict`` tokens);
2. with ``--alone``, every request again with nothing else in flight;
3. the answers of 1 and 2 are compared, and the report gives requests/s, generated tokens/s, the server's peak RSS
   (VmHWM), the KV MiB the server allocated (its log) and the cells per slot (``/slots``).

Prompts are sent as token ids (``/completion``; ``--chat`` sends the same documents as chat messages to
``/v1/chat/completions``). ``cache_prompt`` is off so that a request alone does not reuse the cache of the
concurrent run; ``--turns 2`` also sends a second turn on the first turn's answer with ``cache_prompt`` on (the
slot's compressed cache is reused) and reports the cached tokens.

    python scripts/server_load.py MODEL.gguf --plan plans/....json --clients 4 --requests 20 --alone --out DIR
    python scripts/server_load.py MODEL.gguf --no-plan --clients 4 --requests 20 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

QUESTION = "\n\nIn one sentence: what does the code above do?"


def bin_dir() -> Path:
    env = os.environ.get("POLYKV_CPP_BIN_DIR")
    if env:
        return Path(env)
    import polykv_cpp  # noqa: PLC0415 (the installed package holds the tools)
    return Path(polykv_cpp.__file__).resolve().parent / "bin"


def kv_mib_from_log(text: str) -> float | None:
    """The KV memory a llama.cpp tool allocated, from its log: our plan line, else the stock cache's size lines."""
    m = re.search(r"PolyKV plan active .*?KV ([\d.]+) MiB", text)
    if m:
        return float(m.group(1))
    sizes = re.findall(r"llama_kv_cache: size = +([\d.]+) MiB", text)
    return sum(float(s) for s in sizes) if sizes else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get(url: str, timeout: float = 10) -> dict | list:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class Server:
    """A llama-server subprocess; its log goes to a file, read for the KV lines."""

    def __init__(self, model: str, args: list[str], env: dict[str, str], log_path: Path, timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [str(bin_dir() / "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     stdin=subprocess.DEVNULL)
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            try:
                if get(self.url + "/health", timeout=2).get("status") == "ok":
                    return
            except OSError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server did not start in {timeout:.0f} s:\n{self.log_text()[-3000:]}")
            time.sleep(0.5)

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def peak_rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024

    def kv_mib(self) -> float | None:
        return kv_mib_from_log(self.log_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def documents(n: int) -> list[str]:
    """n different pieces of the standard library's sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 40_000)
    texts = []
    for p in files:
        src = p.read_text(errors="replace")
        for start in range(0, len(src) - 20_000, 20_000):
            texts.append(f"# {p.name}\n" + src[start:start + 20_000])
            if len(texts) == n:
                return texts
    raise RuntimeError(f"the standard library has fewer than {n} pieces of 20K characters")


def make_prompts(server: Server, n: int, min_tokens: int, max_tokens: int, seed: int) -> list[list[int]]:
    """n prompts of token ids, lengths spread evenly over [min_tokens, max_tokens], each document + question."""
    question = post(server.url + "/tokenize", {"content": QUESTION}, 60)["tokens"]
    prompts = []
    for i, doc in enumerate(documents(n)):
        length = min_tokens + ((i * 7919 + seed) % n) * (max_tokens - min_tokens) // max(n - 1, 1)
        toks = post(server.url + "/tokenize", {"content": doc, "add_special": True}, 60)["tokens"]
        body = toks[:max(1, length - len(question))]
        if len(body) + len(question) < min_tokens:
            raise RuntimeError(f"document {i} has only {len(toks)} tokens")
        prompts.append(body + question)
    return prompts


def complete(server: Server, prompt: list[int], n_predict: int, cache_prompt: bool, timeout: float) -> dict:
    t0 = time.time()
    res = post(server.url + "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0,
                                            "top_k": 1, "cache_prompt": cache_prompt, "return_tokens": True,
                                            "samplers": ["top_k"]}, timeout)
    return {"tokens": res.get("tokens", []), "content": res.get("content", ""), "seconds": time.time() - t0,
            "n_prompt": res.get("timings", {}).get("prompt_n"), "n_cached": res.get("tokens_cached"),
            "cache_n": res.get("timings", {}).get("cache_n")}


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"LLAMA_POLYKV_PLAN": str(Path(args.plan).resolve())} if args.plan else {"LLAMA_POLYKV_DISABLE": "1"}
    if args.prefill:
        env["LLAMA_POLYKV_PREFILL"] = args.prefill
    # -lv 4: the library's info lines (the KV cache sizes) reach the log
    server_args = ["-c", str(args.ctx), "-t", str(args.threads), "-lv", "4", *args.server_args.split()]
    if args.parallel:
        server_args += ["-np", str(args.parallel)]
    server = Server(args.model, server_args, env, out / "server.log")
    try:
        n_req = args.clients * args.requests
        prompts = make_prompts(server, n_req, args.min_tokens, args.max_tokens, args.seed)
        slots = get(server.url + "/slots")
        results: list[dict | None] = [None] * n_req
        lock = threading.Lock()
        done = [0]

        def client(c: int) -> None:
            for r in range(args.requests):
                i = c * args.requests + r
                results[i] = complete(server, prompts[i], args.n_predict, False, args.timeout)
                with lock:
                    done[0] += 1
                    print(f"[server_load] {done[0]}/{n_req} requests ({time.time() - t0:.0f} s)", file=sys.stderr,
                          flush=True)

        t0 = time.time()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(client, range(args.clients)))
        wall = time.time() - t0
        report = {
            "model": args.model, "plan": args.plan, "prefill": args.prefill or "chunked", "clients": args.clients,
            "requests": n_req, "n_slots": len(slots), "n_ctx_slot": slots[0].get("n_ctx") if slots else None,
            "prompt_tokens": [len(p) for p in prompts], "wall_s": wall, "requests_per_s": n_req / wall,
            "gen_tokens_per_s": sum(len(r["tokens"]) for r in results) / wall,
            "prompt_tokens_per_s": sum(len(p) for p in prompts) / wall,
            "kv_mib": server.kv_mib(), "peak_rss_mib_concurrent": server.peak_rss_mib(),
        }
        if args.alone:
            same = []
            for i, p in enumerate(prompts):
                alone = complete(server, p, args.n_predict, False, args.timeout)
                same.append(alone["tokens"] == results[i]["tokens"])
                print(f"[server_load] alone {i + 1}/{n_req}: {'same' if same[-1] else 'DIFFERENT'}", file=sys.stderr,
                      flush=True)
                results[i]["alone_tokens"] = alone["tokens"]
            report["same_as_alone"] = sum(same)
        if args.turns > 1:
            first = complete(server, prompts[0], args.n_predict, True, args.timeout)
            follow = post(server.url + "/tokenize", {"content": "\n\nAnd in one word?"}, 60)["tokens"]
            second = complete(server, prompts[0] + first["tokens"] + follow, args.n_predict, True, args.timeout)
            report["second_turn"] = {"prompt_tokens": len(prompts[0]) + len(first["tokens"]) + len(follow),
                                     "cache_n": second["cache_n"], "answer_tokens": len(second["tokens"])}
        report["peak_rss_mib"] = server.peak_rss_mib()
        report["answers"] = [{"n_prompt": len(prompts[i]), "tokens": r["tokens"], "content": r["content"],
                              "seconds": r["seconds"], **({"alone_tokens": r["alone_tokens"]} if "alone_tokens" in r
                                                          else {})} for i, r in enumerate(results)]
    finally:
        server.stop()
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--plan", help="plan JSON for LLAMA_POLYKV_PLAN")
    ap.add_argument("--no-plan", action="store_true", help="FullKV (LLAMA_POLYKV_DISABLE=1)")
    ap.add_argument("--prefill", choices=["chunked", "exact"], help="LLAMA_POLYKV_PREFILL (default: chunked)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=20, help="requests per client")
    ap.add_argument("--min-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("-c", "--ctx", type=int, default=16384, help="server context (all slots share it: unified)")
    ap.add_argument("-np", "--parallel", type=int, default=0, help="slots (default: the server's, 4)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--server-args", default="", help="more llama-server arguments")
    ap.add_argument("--alone", action="store_true", help="run every request again alone and compare the answers")
    ap.add_argument("--turns", type=int, default=1, help="2: also a second turn that reuses the slot's cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="server-load-"))
    args = ap.parse_args(argv)
    if bool(args.plan) == args.no_plan:
        ap.error("give --plan FILE or --no-plan")
    report = run(args)
    keys = ["n_slots", "n_ctx_slot", "requests", "wall_s", "requests_per_s", "gen_tokens_per_s", "kv_mib",
            "peak_rss_mib", "same_as_alone", "second_turn"]
    print(json.dumps({k: report.get(k) for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
