"""Evaluation data: RULER-style synthetic tasks, natural texts for perplexity/KL, LongBench from local files.

Everything is generated or read offline. A synthetic sample is a pure function of (seed, task, length,
index): the same seed gives the same samples on every machine; the haystack is sized by a binary search so
that the prompt, measured with the model's own tokenizer and chat template, plus the answer budget
(`max_new_tokens`) fits in `length` tokens (as RULER's `max_seq_length`).

A sample has two parts, which is what the two protocols need:

* part 1 = (chat header) + instruction + context: compressed before the question is seen in the
  query-agnostic protocol;
* part 2 = question + (end of the user turn, assistant header) + answer prefix.

The query-aware prompt is part 1 followed by part 2 as one token sequence; the query-agnostic run feeds the
very same tokens in two steps. Both parts are tokenized once per sample and shared by every run.
"""

from __future__ import annotations

import functools
import json
import random
import re
import string
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from polykv_cpp.errors import PolyKVError

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "niah_code", "vt", "cwe", "qa",
               "qa_2hop")
TASK_DESCRIPTIONS = {
    "niah_single": "needle in a haystack: one key/number pair hidden in natural text, asked back",
    "niah_multikey": "one target needle among 3 distractor needles with other keys",
    "niah_multivalue": "one key with 4 numbers; all 4 must be returned",
    "niah_multiquery": "4 keys with one number each, all asked at once",
    "niah_code": "one target needle (a code comment) among 3 distractors in real Python standard-library sources",
    "vt": "variable tracking: a chain of 5 assignments hidden in noise; name all variables holding the value",
    "cwe": "common-word extraction: the 10 words repeated 30x among words seen 3x",
    "qa": "QA over synthetic facts: one attribute of one fictional person among many documents",
    "qa_2hop": "2-hop QA over synthetic facts: the birthplace of the founder of a fictional company",
}
# answer budgets (RULER uses 128/30/120/32; ours are smaller because answers are short and CPU time counts)
MAX_NEW_TOKENS = {"niah_single": 24, "niah_multikey": 24, "niah_multivalue": 64, "niah_multiquery": 64,
                  "niah_code": 24, "vt": 40, "cwe": 96, "qa": 24, "qa_2hop": 24}

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

ADJECTIVES = """able absent acidic active adorable agile airy alert amber ancient angry arctic aromatic artful
ashen austere autumn awake bitter blazing bleak blissful bold boundless brave breezy brief bright brisk broad
bronze busy calm candid careful cheerful chilly civic classic clever cloudy coastal cobalt cold colossal
cosmic cozy crimson crisp curious daring dazzling deep dense distant dizzy dusty eager early earnest electric
elegant emerald empty endless epic faint famous fancy fearless fierce flat fluffy formal fragile frank
frozen gentle giant gleaming golden graceful grand gray green hasty hidden hollow honest humble icy idle
jolly joyful keen kind large lavish lazy lively lofty lonely loud loyal lucky lunar magic majestic mellow
merry mighty misty modern modest muddy narrow neat nimble noble odd olive orange pale patient plain polite
proud purple quick quiet rapid rare red regal rigid robust rosy rough round royal rusty sacred scarlet
secret serene sharp shiny silent silver simple sleepy slim smooth snowy solar solid sour spicy steady stormy
strong sturdy sunny swift tall tender tidy tiny tranquil vast velvet vivid warm wild windy wise witty young
zealous""".split()
NOUNS = """acorn anchor anthem apple arch arrow atlas badge bakery ballad bamboo banner barrel basket beacon
bell bench berry blanket blossom boat bonnet boulder bridge brook bucket button cabin cactus camera candle
canyon captain carpet castle cathedral cellar chalk channel chapel cherry chimney circle cliff clock cloud
clover comet compass copper cottage crater crown crystal cup curtain dagger daisy desert diamond dolphin
dragon drum eagle ember engine falcon feather fern festival fiddle flame flute forest fountain garden
garnet glacier globe goblet granite harbor harp hawk helmet hill horizon island ivory jacket jade jungle
kettle kingdom ladder lagoon lantern lemon library lighthouse lily lion locket magnet maple marble meadow
melody mirror monument moon mountain needle nest oasis ocean orbit orchard otter owl paddle palace parrot
pearl pebble pepper piano pillow planet pocket pond poppy prism puzzle quartz quill rabbit rainbow raven
reef ribbon river robin rocket saddle sail sapphire scroll shadow shell shield signal skyline sparrow
spiral spring squirrel stable star statue stone summit sunset swan sword temple thunder tiger timber
tower trail tulip tunnel valley velvet village violin volcano wagon walnut waterfall whistle willow window
wizard wolf yacht zebra""".split()
PROFESSIONS = ("baker", "pilot", "architect", "violinist", "geologist", "carpenter", "librarian", "chemist",
               "sailor", "painter", "surgeon", "translator", "beekeeper", "astronomer", "potter", "jeweler")
FOODS = ("plum dumplings", "fig pastry", "barley soup", "pear tart", "lentil stew", "quince jam",
         "walnut bread", "apricot pie", "rice pudding", "onion soup", "chestnut cake", "cherry strudel")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "black", "white", "golden")
THINGS = ("bicycle", "canoe", "piano", "telescope", "parrot", "tortoise", "sailboat", "typewriter")
_SYL_START = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "qu", "r", "s", "st",
              "t", "tr", "v", "z")
_SYL_VOWEL = ("a", "e", "i", "o", "u", "ai", "ou", "ei")
_SYL_END = ("", "", "n", "r", "l", "s", "m", "th", "x")


class TaskError(PolyKVError):
    """Raised when a task cannot be generated or loaded as asked."""


# ------------------------------------------------------------------------------------------------ samples


@dataclass
class Sample:
    """One prompt with its reference answers.

    The prompt text is `instruction + context` (part 1) then `question` and `answer_prefix` (part 2); the
    chat template, if any, wraps the user turn around them (see `PromptBuilder`).
    """

    kind: str  # "ruler" | "longbench"
    task: str
    length: int  # the length (tokens) asked: prompt + max_new_tokens <= length (after truncation for LongBench)
    index: int
    instruction: str
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    metric: str  # a name in scoring.METRICS
    max_new_tokens: int
    stop_at_newline: bool = False  # stop generating at the first newline after some text (plain prompts)
    use_chat: bool = True  # False: never wrap in the chat template (LongBench few-shot and code tasks)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.task}/{self.length}/{self.index}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------ chat templates


@dataclass(frozen=True)
class ChatFormat:
    """How a user turn and the assistant header look for a chat model ("none": plain text)."""

    name: str
    user_prefix: str = ""  # before the user text (after BOS); parsed for special tokens
    user_suffix: str = ""  # after the user text: end of turn + assistant header; parsed for special tokens


QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CHAT_FORMATS = {
    "none": ChatFormat("none"),
    "chatml": ChatFormat("chatml", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
    "chatml-qwen": ChatFormat("chatml-qwen", f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n",
                              "<|im_end|>\n<|im_start|>assistant\n"),
    "gemma": ChatFormat("gemma", "<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"),
    "llama3": ChatFormat("llama3", "<|start_header_id|>user<|end_header_id|>\n\n",
                         "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
}


def detect_chat_format(template: str | None) -> str:
    """The `CHAT_FORMATS` name matching a GGUF `tokenizer.chat_template` (\"none\" when there is none)."""
    if not template:
        return "none"
    if "<|im_start|>" in template:
        return "chatml-qwen" if QWEN_SYSTEM in template else "chatml"
    if "<start_of_turn>" in template:
        return "gemma"
    if "<|start_header_id|>" in template:
        return "llama3"
    return "none"


Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special) -> ids


@dataclass
class Prompt:
    """The token ids of a sample: part 1 (instruction + context) and part 2 (question + answer prefix)."""

    part1: list[int]
    part2: list[int]
    n_truncated: int = 0  # context tokens cut out of the middle (LongBench)

    @property
    def n_prompt(self) -> int:
        return len(self.part1) + len(self.part2)

    @property
    def tokens(self) -> list[int]:
        return self.part1 + self.part2


class PromptBuilder:
    """Tokenizes samples with the model's tokenizer and chat format.

    Template pieces are tokenized with special-token parsing, the texts (context, question) without it, so a
    context that happens to contain `<|im_start|>` stays text. BOS comes from the tokenizer's own rule
    (`add_special` on the first piece).
    """

    def __init__(self, tokenize: Tokenize, chat: ChatFormat | str = "none"):
        self.tokenize = tokenize
        self.chat = CHAT_FORMATS[chat] if isinstance(chat, str) else chat

    def _fmt(self, sample: Sample) -> ChatFormat:
        return self.chat if sample.use_chat else CHAT_FORMATS["none"]

    def head(self, sample: Sample) -> list[int]:
        return self.tokenize(self._fmt(sample).user_prefix, True, True)

    def body(self, sample: Sample) -> list[int]:
        return self.tokenize(sample.instruction + sample.context, False, False)

    def tail(self, sample: Sample) -> list[int]:
        fmt = self._fmt(sample)
        out = self.tokenize(sample.question, False, False) if sample.question else []
        if fmt.user_suffix:
            out += self.tokenize(fmt.user_suffix, False, True)
        if sample.answer_prefix:
            out += self.tokenize(sample.answer_prefix, False, False)
        return out

    def build(self, sample: Sample, max_prompt: int | None = None) -> Prompt:
        """Token ids; with `max_prompt`, the context is cut in its middle (LongBench's truncation) to fit."""
        head, tail = self.head(sample), self.tail(sample)
        if max_prompt is None or len(head) + len(self.body(sample)) + len(tail) <= max_prompt:
            return Prompt(head + self.body(sample), tail)
        instr = self.tokenize(sample.instruction, False, False) if sample.instruction else []
        ctx = self.tokenize(sample.context, False, False)
        room = max_prompt - len(head) - len(instr) - len(tail)
        if room < 2:
            raise TaskError(f"{sample.key}: {max_prompt} tokens leave no room for the context")
        half = room // 2
        kept = ctx[:half] + ctx[len(ctx) - (room - half):]
        return Prompt(head + instr + kept, tail, n_truncated=len(ctx) - len(kept))

    def count(self, sample: Sample) -> int:
        return len(self.head(sample)) + len(self.body(sample)) + len(self.tail(sample))


# ---------------------------------------------------------------------------------------------- haystacks


def _prose_sentences() -> list[str]:
    """English sentences from the Python reference documentation shipped with the interpreter (pydoc_data)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it
        return []
    out: list[str] = []
    for key in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[key]):
            if para.startswith((" ", "\t")) or set(para.strip()) <= set("*=-~^"):
                continue  # code blocks, grammar, underlines
            text = " ".join(para.split())
            if len(text) < 60 or "::=" in text or ">>>" in text:
                continue
            for sent in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
                if 30 <= len(sent) <= 400 and sent[-1] in ".!?" and sent.isascii():
                    out.append(sent)
    return out


@functools.cache
def prose_sentences() -> list[str]:
    return _prose_sentences()


#: pure-Python standard-library modules whose sources make the `code` haystack (code, docstrings, comments)
CODE_MODULES = ("argparse", "calendar", "configparser", "csv", "dataclasses", "difflib", "enum", "fractions",
                "functools", "gettext", "heapq", "json.decoder", "json.encoder", "shlex", "string", "textwrap",
                "tokenize", "zipfile")


def _code_blocks() -> list[str]:
    """Blocks of Python source (split at blank lines, 2..24 lines each) from :data:`CODE_MODULES`."""
    import importlib.util

    out: list[str] = []
    for name in CODE_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        try:
            text = Path(spec.origin).read_text(encoding="utf-8")
        except OSError:
            continue
        for block in re.split(r"\n\s*\n", text):
            lines = [ln.rstrip() for ln in block.splitlines() if ln.strip()]
            if 2 <= len(lines) <= 24 and all(ln.isascii() for ln in lines):
                out.append("\n".join(lines))
    return out


@functools.cache
def code_blocks() -> list[str]:
    return _code_blocks()


class Haystack:
    """Filler units: RULER's noise sentence (`noise`), natural sentences (`text`, Python docs) or real source code
    (`code`, Python standard-library modules shipped with the interpreter)."""

    def __init__(self, kind: str):
        if kind == "text" and not prose_sentences():
            kind = "noise"  # no pydoc_data: fall back, recorded in the sample's meta
        if kind == "code" and not code_blocks():
            kind = "text" if prose_sentences() else "noise"
        if kind not in ("noise", "text", "code"):
            raise TaskError(f"unknown haystack {kind!r} (noise, text, code)")
        self.kind = kind

    def units(self, n: int, offset: int) -> list[str]:
        if self.kind == "noise":
            return [NOISE] * n
        pool = code_blocks() if self.kind == "code" else prose_sentences()
        return [pool[(offset + i) % len(pool)] for i in range(n)]

    def needle(self, text: str) -> str:
        """A needle as it sits in this haystack: a comment line in code, a sentence elsewhere."""
        return f"# {text}" if self.kind == "code" else text

    @property
    def sep(self) -> str:
        return {"noise": "\n", "text": " ", "code": "\n\n"}[self.kind]


def _insert(units: list[str], items: Sequence[str], depths: Sequence[float]) -> list[str]:
    """Insert items at relative depths (0 = start, 1 = end) of `units`, keeping their order by depth."""
    out = list(units)
    placed = sorted(zip(depths, range(len(items))), key=lambda t: (t[0], t[1]))
    for k, (d, i) in enumerate(placed):
        pos = int(round(d * len(units))) + k
        out.insert(min(pos, len(out)), items[i])
    return out


def _fresh(used: set[str], draw: Callable[[], str]) -> str:
    """The first value of `draw()` not in `used` (then added to it)."""
    while True:
        v = draw()
        if v not in used:
            used.add(v)
            return v


def _word_key(rng: random.Random, used: set[str]) -> str:
    return _fresh(used, lambda: f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}")


def _number(rng: random.Random, used: set[str], digits: int = 7) -> str:
    return _fresh(used, lambda: str(rng.randint(10 ** (digits - 1), 10 ** digits - 1)))


def pseudo_word(rng: random.Random, n_syl: int | None = None) -> str:
    n_syl = n_syl or rng.choice((2, 2, 3))
    return "".join(rng.choice(_SYL_START) + rng.choice(_SYL_VOWEL) + rng.choice(_SYL_END) for _ in range(n_syl))


def _distinct_words(rng: random.Random, n: int, exclude: set[str] | None = None) -> list[str]:
    seen = set(exclude or ())
    out = []
    while len(out) < n:
        w = pseudo_word(rng)
        if w not in seen and len(w) >= 4:
            seen.add(w)
            out.append(w)
    return out


def _name(rng: random.Random, used: set[str]) -> str:
    return _fresh(used, lambda: f"{pseudo_word(rng, 2).capitalize()} "
                                f"{pseudo_word(rng, rng.choice((2, 3))).capitalize()}")


# ---------------------------------------------------------------------------------------- task builders
# Each builder makes the sample for `n` filler units from a fresh rng; everything random is drawn before the
# filler so that the needles, keys and depths do not change while the binary search resizes the haystack.

_NIAH_INSTR = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")


def _niah(rng: random.Random, n: int, hay: Haystack, length: int, *, n_keys: int, n_values: int, n_query: int, task: str):
    keys_used: set[str] = set()
    vals_used: set[str] = set()
    keys = [_word_key(rng, keys_used) for _ in range(n_keys)]
    values = [[_number(rng, vals_used) for _ in range(n_values if i == 0 or n_query > 1 else 1)]
              for i in range(n_keys)]
    needles, owners = [], []
    for k, vs in zip(keys, values):
        for v in vs:
            needles.append(hay.needle(f"One of the special magic numbers for {k} is: {v}."))
            owners.append(k)
    depths = [rng.random() for _ in needles]
    offset = rng.randrange(1 << 30)
    context = hay.sep.join(_insert(hay.units(n, offset), needles, depths))
    asked = keys[:n_query]
    query = asked[0] if n_query == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    answers = [v for vs in values[:n_query] for v in vs]
    return dict(
        instruction=_NIAH_INSTR, context=context,
        question=f"\nWhat are all the special magic numbers for {query} mentioned in the provided text?",
        answer_prefix=f" The special magic numbers for {query} mentioned in the provided text are",
        answers=answers, metric="match_all",
        meta={"keys": keys, "asked": asked, "depths": [round(d, 4) for d in depths], "haystack": hay.kind})


def _vt(rng: random.Random, n: int, hay: Haystack, length: int, *, hops: int = 4):
    names: set[str] = set()
    while len(names) < hops + 1:
        names.add("".join(rng.choices(string.ascii_uppercase, k=5)))
    vars_ = sorted(names)
    rng.shuffle(vars_)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {vars_[0]} = {value}"] + [f"VAR {vars_[j + 1]} = VAR {vars_[j]}" for j in range(hops)]
    depths = sorted(rng.random() for _ in chain)
    noise = Haystack("noise")
    context = "\n".join(_insert(noise.units(n, 0), chain, depths))
    return dict(
        instruction="Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
        context=context,
        question=f"\nQuestion: Find all variables that are assigned the value {value} in the text above.",
        answer_prefix=(f" Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} "
                       f"variables are assigned the value {value}, they are: "),
        answers=vars_, metric="match_all", meta={"chain": chain, "depths": [round(d, 4) for d in depths]})


def _cwe(rng: random.Random, n: int, hay: Haystack, length: int, *, n_common: int = 10, freq_uncommon: int = 3):
    # n = number of distinct uncommon words; the common words come first from the same rng stream.
    # RULER repeats the common words 30 times at 4K tokens; shorter prompts get proportionally fewer repeats
    # (at least 5, so that they stay more frequent than the uncommon ones).
    freq_common = max(5, min(30, round(30 * length / 4096)))
    common = _distinct_words(rng, n_common)
    order_seed = rng.randrange(1 << 30)
    uncommon = _distinct_words(random.Random(order_seed), n, exclude=set(common))
    words = common * freq_common + uncommon * freq_uncommon
    random.Random(order_seed + 1).shuffle(words)
    context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    return dict(
        instruction=("Below is a numbered list of words. In these words, some appear more often than others. "
                     "Memorize the ones that appear most often.\n"),
        context=context, question="\nQuestion: What are the 10 most common words in the above list?",
        answer_prefix=" Answer: The top 10 words that appear most often in the list are:",
        answers=common, metric="match_all", meta={"n_uncommon": n, "freq_common": freq_common})


_QA_INSTR = ("Answer the question based on the given documents. Only give me the answer and do not output any "
             "other words.\n\nThe following are given documents.\n\n")
_QA_Q = "\n\nAnswer the question based on the given documents. Only give me the answer and do not output any " \
        "other words.\n\nQuestion: "


def _person_doc(name: str, a: dict[str, str]) -> str:
    return (f"{name} is a {a['profession']} who lives in the town of {a['town']}. {name} was born in {a['year']} "
            f"and owns a {a['color']} {a['thing']}. The favourite dish of {name} is {a['food']}.")


def _person_attrs(rng: random.Random, towns: Sequence[str]) -> dict[str, str]:
    return {"profession": rng.choice(PROFESSIONS), "town": rng.choice(towns), "year": str(rng.randint(1901, 1999)),
            "color": rng.choice(COLORS), "thing": rng.choice(THINGS), "food": rng.choice(FOODS)}


def _docs(docs: list[str]) -> str:
    return "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))


def _qa(rng: random.Random, n: int, hay: Haystack, length: int):
    used: set[str] = set()
    towns = [pseudo_word(rng, 3).capitalize() for _ in range(24)]
    target = _name(rng, used)
    attrs = _person_attrs(rng, towns)
    kind = rng.choice(("town", "profession", "food", "year"))
    question = {"town": f"In which town does {target} live?", "profession": f"What is the profession of {target}?",
                "food": f"What is the favourite dish of {target}?", "year": f"In which year was {target} born?"}[kind]
    depth = rng.random()
    drng = random.Random(rng.randrange(1 << 30))
    others = [_person_doc(_name(drng, used), _person_attrs(drng, towns)) for _ in range(n)]
    docs = _insert(others, [_person_doc(target, attrs)], [depth])
    return dict(instruction=_QA_INSTR, context=_docs(docs), question=_QA_Q + question, answer_prefix=" Answer:",
                answers=[attrs[kind]], metric="match_part",
                meta={"target": target, "attribute": kind, "depth": round(depth, 4), "n_documents": len(docs)})


def _qa_2hop(rng: random.Random, n: int, hay: Haystack, length: int):
    used: set[str] = set()
    towns = [pseudo_word(rng, 3).capitalize() for _ in range(24)]

    def company_doc(c: str, founder: str, r: random.Random) -> str:
        return (f"{c} is a company that makes {r.choice(THINGS)}s. {c} was founded by {founder} in "
                f"{r.randint(1950, 2015)} and employs {r.randint(12, 900)} people.")

    def person_doc(p: str, town: str, r: random.Random) -> str:
        return (f"{p} was born in the town of {town}. {p} works as a {r.choice(PROFESSIONS)} and likes "
                f"{r.choice(FOODS)}.")

    company = pseudo_word(rng, 2).capitalize() + " " + rng.choice(("Works", "Labs", "Industries", "Trading"))
    founder = _name(rng, used)
    town = rng.choice(towns)
    d1, d2 = rng.random(), rng.random()
    r1, r2 = random.Random(rng.randrange(1 << 30)), random.Random(rng.randrange(1 << 30))
    drng = random.Random(rng.randrange(1 << 30))
    others = []
    for i in range(n):  # distractors: other companies and other people, alternating
        if i % 2 == 0:
            c = pseudo_word(drng, 2).capitalize() + " " + drng.choice(("Works", "Labs", "Industries", "Trading"))
            others.append(company_doc(c, _name(drng, used), drng))
        else:
            others.append(person_doc(_name(drng, used), drng.choice(towns), drng))
    docs = _insert(others, [company_doc(company, founder, r1), person_doc(founder, town, r2)], [d1, d2])
    return dict(instruction=_QA_INSTR, context=_docs(docs),
                question=_QA_Q + f"In which town was the founder of {company} born?", answer_prefix=" Answer:",
                answers=[town], metric="match_part",
                meta={"company": company, "founder": founder, "depths": [round(d1, 4), round(d2, 4)]})


_BUILDERS: dict[str, tuple[Callable[..., dict], str]] = {
    "niah_single": (lambda r, n, h, L: _niah(r, n, h, L, n_keys=1, n_values=1, n_query=1, task="niah_single"),
                    "text"),
    "niah_multikey": (lambda r, n, h, L: _niah(r, n, h, L, n_keys=4, n_values=1, n_query=1, task="niah_multikey"),
                      "text"),
    "niah_multivalue": (lambda r, n, h, L: _niah(r, n, h, L, n_keys=1, n_values=4, n_query=1,
                                                 task="niah_multivalue"), "text"),
    "niah_multiquery": (lambda r, n, h, L: _niah(r, n, h, L, n_keys=4, n_values=1, n_query=4,
                                                 task="niah_multiquery"), "text"),
    "niah_code": (lambda r, n, h, L: _niah(r, n, h, L, n_keys=4, n_values=1, n_query=1, task="niah_code"), "code"),
    "vt": (_vt, "noise"),
    "cwe": (_cwe, "noise"),
    "qa": (_qa, "noise"),
    "qa_2hop": (_qa_2hop, "noise"),
}


def sample_seed(seed: int, task: str, length: int, index: int) -> str:
    return f"polykv-eval/{seed}/{task}/{length}/{index}"


def make_ruler_sample(task: str, length: int, index: int, seed: int, n_units: int, *,
                      haystack: str | None = None, max_new_tokens: int | None = None,
                      stop_at_newline: bool = False) -> Sample:
    """The sample of (seed, task, length, index) with `n_units` filler units (deterministic)."""
    if task not in _BUILDERS:
        raise TaskError(f"unknown task {task!r} (known: {', '.join(RULER_TASKS)})")
    builder, default_hay = _BUILDERS[task]
    hay = Haystack(haystack or default_hay)
    rng = random.Random(sample_seed(seed, task, length, index))
    fields = builder(rng, n_units, hay, length)
    fields["meta"] = {**fields["meta"], "n_units": n_units, "seed": seed}
    return Sample(kind="ruler", task=task, length=length, index=index,
                  max_new_tokens=max_new_tokens or MAX_NEW_TOKENS[task], stop_at_newline=stop_at_newline, **fields)


def fit_units(make: Callable[[int], Sample], measure: Callable[[Sample], int], length: int) -> int:
    """The largest number of filler units whose sample measures <= `length` (binary search)."""
    base = measure(make(0))
    if base > length:
        raise TaskError(f"length {length} is too small: the task's fixed text already takes {base} tokens")
    probe = 8
    per = max(1e-3, (measure(make(probe)) - base) / probe)
    lo, hi = 0, max(1, int((length - base) / per * 1.25) + 4)
    while measure(make(hi)) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(make(mid)) <= length:
            lo = mid
        else:
            hi = mid
    return lo


def generate_ruler(tasks: Iterable[str], lengths: Iterable[int], n_samples: int, seed: int,
                   measure: Callable[[Sample], int], *, haystack: str | None = None,
                   max_new_tokens: int | None = None, stop_at_newline: bool = False,
                   progress: Callable[[], None] | None = None) -> list[Sample]:
    """`n_samples` samples per (task, length); `measure(sample)` = prompt tokens + answer budget.

    `haystack` overrides the task's default filler (`text`: Python docs sentences; `noise`: RULER's noise).
    """
    out = []
    for task in tasks:
        if task not in _BUILDERS:
            raise TaskError(f"unknown task {task!r} (known: {', '.join(RULER_TASKS)})")
        for length in lengths:
            for index in range(n_samples):
                def make(n: int, task=task, length=length, index=index) -> Sample:
                    return make_ruler_sample(task, length, index, seed, n, haystack=haystack,
                                             max_new_tokens=max_new_tokens, stop_at_newline=stop_at_newline)
                try:
                    n = fit_units(make, measure, length)
                except TaskError as e:
                    raise TaskError(f"task {task}: {e}") from None
                s = make(n)
                s.meta["n_tokens"] = measure(s)
                out.append(s)
                if progress:
                    progress()
    return out


def answer_in_text(sample: Sample) -> bool:
    """Every reference answer can be recovered from the prompt text (for the match_all/match_part tasks)."""
    text = sample.instruction + sample.context
    if sample.task == "cwe":
        counts: dict[str, int] = {}
        for w in re.findall(r"\d+\. (\w+)", text):
            counts[w] = counts.get(w, 0) + 1
        top = sorted(counts, key=lambda w: -counts[w])[:len(sample.answers)]
        return sorted(top) == sorted(sample.answers)
    if sample.task == "vt":
        value = re.search(r"assigned the value (\d+)", sample.question).group(1)  # type: ignore[union-attr]
        holders = set()
        frontier = {value}
        assigns = re.findall(r"VAR (\w+) = (VAR \w+|\d+)", text)
        while frontier:
            new = {a for a, b in assigns if b.replace("VAR ", "") in frontier and a not in holders}
            holders |= new
            frontier = new
        return holders == set(sample.answers)
    if sample.task.startswith("niah"):
        for key in sample.meta["asked"]:
            found = re.findall(rf"special magic numbers for {re.escape(key)} is: (\d+)", text)
            if not found:
                return False
        vals = [v for k in sample.meta["asked"]
                for v in re.findall(rf"special magic numbers for {re.escape(k)} is: (\d+)", text)]
        return sorted(vals) == sorted(sample.answers)
    if sample.task == "qa":
        t = sample.meta["target"]
        doc = re.search(rf"{re.escape(t)} is a .*?The favourite dish of {re.escape(t)} is [^.]*\.", text)
        return doc is not None and all(a in doc.group(0) for a in sample.answers)
    if sample.task == "qa_2hop":
        founder = re.search(rf"{re.escape(sample.meta['company'])} was founded by ([A-Z]\w+ [A-Z]\w+)", text)
        if not founder:
            return False
        born = re.search(rf"{re.escape(founder.group(1))} was born in the town of (\w+)\.", text)
        return born is not None and [born.group(1)] == sample.answers
    return all(a in text for a in sample.answers)


# ------------------------------------------------------------------------------------ natural texts (PPL)


@dataclass
class TextSource:
    name: str
    text: str
    origin: str


def builtin_texts() -> list[TextSource]:
    """Long texts found on any machine with Python, not used by the default calibration (builtin:stdlib).

    1. `python-docs`: the Python language reference as prose (`pydoc_data.topics`, English);
    2. `idlelib`: the sources of IDLE (code with comments); the calibration's builtin set skips `idlelib`.
    """
    out = []
    try:
        from pydoc_data.topics import topics
        out.append(TextSource("python-docs", "\n\n".join(topics[k] for k in sorted(topics)),
                              "pydoc_data.topics (Python reference documentation)"))
    except ImportError:
        pass
    root = Path(sysconfig.get_paths()["stdlib"]) / "idlelib"
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4096) if root.is_dir() else []
    if files:
        out.append(TextSource("idlelib", "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files),
                              f"{root}/*.py (IDLE sources)"))
    return out


def user_texts(paths: Sequence[str | Path]) -> list[TextSource]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in
                           (".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".tex", ".html"))
            if not files:
                raise TaskError(f"{p}: no text files in this directory")
            out.append(TextSource(p.name, "\n\n".join(f.read_text(encoding="utf-8", errors="replace")
                                                      for f in files), str(p)))
        elif p.is_file():
            out.append(TextSource(p.stem, p.read_text(encoding="utf-8", errors="replace"), str(p)))
        else:
            raise TaskError(f"text file not found: {p}")
    return out


def text_tokens(src: TextSource, n_tokens: int, tokenize: Tokenize) -> list[int] | None:
    """The first `n_tokens` tokens of a text (BOS included), or None if it is shorter."""
    n_chars = max(4096, n_tokens * 6)
    while True:
        ids = tokenize(src.text[:n_chars], True, False)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
        if n_chars >= len(src.text):
            return None
        n_chars *= 2


# ------------------------------------------------------------------------------------------- LongBench

LONGBENCH_PROMPTS = {
    "narrativeqa": ("You are given a story, which can be either a novel or a movie script, and a question. Answer the "
                    "question as concisely as you can, using a single phrase if possible. Do not provide any "
                    "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as "
                    "you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
                    "{input}\n\nAnswer:"),
    "qasper": ("You are given a scientific article and a question. Answer the question as concisely as you can, "
               "using a single phrase or sentence if possible. If the question cannot be answered based on the "
               "information in the article, write \"unanswerable\". If the question is a yes/no question, answer "
               "\"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n "
               "Answer the question based on the above article as concisely as you can, using a single phrase or "
               "sentence if possible. If the question cannot be answered based on the information in the article, "
               "write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
               "\"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"),
    "multifieldqa_en": ("Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
                        "question based on the above text, only give me the answer and do not output any other "
                        "words.\n\nQuestion: {input}\nAnswer:"),
    "hotpotqa": ("Answer the question based on the given passages. Only give me the answer and do not output any "
                 "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
                 "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
                 "{input}\nAnswer:"),
    "gov_report": ("You are given a report by a government agency. Write a one-page summary of the report.\n\n"
                   "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"),
    "qmsum": ("You are given a meeting transcript and a query containing a question or instruction. Answer the "
              "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
              "above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"),
    "multi_news": ("You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
                   "{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"),
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": ("Answer the question based on the given passage. Only give me the answer and do not output any "
                 "other words. The following are some examples.\n\n{context}\n\n{input}"),
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "passage_count": ("There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
                      "carefully read these paragraphs and determine how many unique paragraphs there are after "
                      "removing duplicates. In other words, how many non-repeating paragraphs are there in total?"
                      "\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. "
                      "The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final "
                      "answer is: "),
    "passage_retrieval_en": ("Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
                             "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n"
                             "{input}\n\nPlease enter the number of the paragraph that the abstract is from. The "
                             "answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: "),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
LONGBENCH_PROMPTS["2wikimqa"] = LONGBENCH_PROMPTS["hotpotqa"]
LONGBENCH_PROMPTS["musique"] = LONGBENCH_PROMPTS["hotpotqa"]
LONGBENCH_MAXLEN = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32,
                    "musique": 32, "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32,
                    "samsum": 128, "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64}
LONGBENCH_METRIC = {"narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "hotpotqa": "qa_f1",
                    "2wikimqa": "qa_f1", "musique": "qa_f1", "gov_report": "rouge_l", "qmsum": "rouge_l",
                    "multi_news": "rouge_l", "trec": "classification", "triviaqa": "qa_f1", "samsum": "rouge_l",
                    "passage_count": "count", "passage_retrieval_en": "retrieval", "lcc": "code_sim",
                    "repobench-p": "code_sim"}
LONGBENCH_TASKS = tuple(LONGBENCH_METRIC)
# LongBench's pred.py does not apply the chat template to these (few-shot and code completion)
LONGBENCH_NO_CHAT = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
LONGBENCH_FIRST_LINE = ("trec", "triviaqa", "samsum", "lsht")


class LongBenchUnavailable(TaskError):
    pass


def _load_longbench_records(task: str, data_dir: str | Path | None) -> tuple[list[dict], str]:
    if data_dir:
        d = Path(data_dir)
        for name in (f"{task}.jsonl", f"data/{task}.jsonl"):
            p = d / name
            if p.is_file():
                with open(p, encoding="utf-8") as f:
                    return [json.loads(line) for line in f if line.strip()], str(p)
        raise LongBenchUnavailable(f"LongBench task {task!r}: no {task}.jsonl in {d} (unzip LongBench's data.zip "
                                   "there, or leave --longbench-dir out to use the local Hugging Face cache)")
    import os
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local only: never wait on the network
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise LongBenchUnavailable("LongBench needs the 'datasets' package (pip install datasets) or "
                                   "--longbench-dir with LongBench's jsonl files") from None
    try:
        import datasets.config as dconf
        dconf.HF_DATASETS_OFFLINE = True
        if hasattr(dconf, "HF_HUB_OFFLINE"):
            dconf.HF_HUB_OFFLINE = True
    except Exception:  # pragma: no cover - older/newer datasets layouts
        pass
    try:
        ds = datasets.load_dataset("THUDM/LongBench", task, split="test")
    except Exception as e:  # not in the local cache, or a datasets version that refuses loading scripts
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LongBenchUnavailable(f"LongBench task {task!r} is not available locally ({msg[:200]}); download "
                                   "it once with `datasets.load_dataset('THUDM/LongBench', ...)` on a machine "
                                   "with network access, or pass --longbench-dir DIR with its jsonl files") from None
    return [dict(r) for r in ds], "hf:THUDM/LongBench (local cache)"


def load_longbench(tasks: Iterable[str], n_samples: int, *, data_dir: str | Path | None = None,
                   length: int = 8192) -> tuple[list[Sample], dict[str, str]]:
    """(samples, {task: where it came from or why it is missing}). `length` caps prompt + answer tokens."""
    samples: list[Sample] = []
    status: dict[str, str] = {}
    for task in tasks:
        if task not in LONGBENCH_PROMPTS:
            raise TaskError(f"unknown LongBench task {task!r} (known: {', '.join(LONGBENCH_TASKS)})")
        try:
            records, origin = _load_longbench_records(task, data_dir)
        except LongBenchUnavailable as e:
            status[task] = f"unavailable: {e}"
            continue
        status[task] = origin
        tmpl = LONGBENCH_PROMPTS[task]
        head, _, rest = tmpl.partition("{context}")
        for i, rec in enumerate(records[:n_samples]):
            answers = rec.get("answers") or []
            if isinstance(answers, str):
                answers = [answers]
            samples.append(Sample(
                kind="longbench", task=task, length=length, index=i, instruction=head,
                context=str(rec.get("context", "")), question=rest.replace("{input}", str(rec.get("input", ""))),
                answer_prefix="", answers=[str(a) for a in answers], metric=LONGBENCH_METRIC[task],
                max_new_tokens=LONGBENCH_MAXLEN[task], stop_at_newline=task in LONGBENCH_FIRST_LINE,
                use_chat=task not in LONGBENCH_NO_CHAT,
                meta={"all_classes": rec.get("all_classes"), "_id": rec.get("_id"), "origin": origin}))
    return samples, status
