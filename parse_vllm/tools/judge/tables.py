"""The compared judges (compare.py) scored on a report's own examples, from its score tables,
without building the head's data again (``parse-vllm train-judge ... --judges-on-tables``).

A score table (scores.py) names every example the head was trained or scored on -- task, answer
number, kind, length -- with its label and the head's score, but not the answer's tokens. The
answers come again from the draft: the data build's answers and boundaries stages are
deterministic (greedy, and sampled with one seed per task), and rebuilding them costs the draft
alone and the tests. Labels (the target's continuations) and the head's features (a target pass
per prefix with the suffix) are what make the build take hours; the tables already hold both.
So this rebuilds the answers, checks them against the table, and runs only the baselines stage
(the KL statistics and the hidden state at the prefix) over the table's rows:

1. per prompt set, the answers and boundaries stages in ``OUT/data-tables/<set>``. Balance
   answers (held-out sets) go to the tasks whose table rows name an answer beyond the task's
   distinct greedy and sampled answers: the build chose them with the target's own answers,
   which are not needed to find them again;
2. every table row is checked against the rebuilt answers: the answer exists, a whole answer has
   the row's length and its tests give the row's label, a prefix's length is one of the answer's
   boundaries. Any row that fails stops the run with the rows named (the rebuilt answers are
   not those the head was scored on);
3. the table's rows become the folder's ``index.jsonl`` and baselines.stage_baselines runs over
   them;
4. on the training sets, compare.train fits the judges that need no suffix hidden state
   (TABLE_JUDGES) and saves them (FITS_FILE); a held-out set is scored with the saved
   fits. Some of the training sets may be given alone (the data of all of them can take longer
   than a sitting): the judges are then fitted on those sets' rows, the training table's other
   rows get no score (NaN), and the report gives the judges' figures set by set
   (scores.figures) and records the sets (``judges_compared.train_sets``). Each table is written again with the judges' columns added (every other column as it
   was), and the report is recomputed from the tables (scores.rescore).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import baselines, compare, data, probe, report, scores

FOLDER = "data-tables"
FITS_FILE = "baseline_judges_tables.npz"  # beside the full build's fits (compare.FITS_FILE), not over them
TABLE_JUDGES = ("suffix_free", "suffix_free_kl")  # fitted judges that need no hidden state at the suffix


class TablesError(Exception):
    """The tables and the rebuilt answers disagree, or a table or the fits are missing."""


def table_rows(table: scores.ScoreTable, split: str) -> np.ndarray:
    """[n] the row numbers of `table` that belong to the set whose split name is `split`."""
    src = table.ex.source
    return np.arange(len(table.ex)) if src is None else np.flatnonzero(src == split)


def balance_picker(items: list[dict], top: dict[str, int]) -> Callable[[list[dict]], list[str]]:
    """data.Job.balance_tasks for a table: the tasks (in the set's order) whose highest answer
    number in the table, `top[task]`, is beyond their distinct greedy and sampled answers."""

    def pick(answers: list[dict]) -> list[str]:
        count = Counter(a["task"] for a in answers)
        return [it["id"] for it in items if top.get(it["id"], -1) >= count.get(it["id"], 0)]

    return pick


def task_id(ex: probe.Examples, i: int) -> str:
    """Row i's task id in its prompt set (a training table prefixes ids two sets share with
    the set's name: probe.Examples.concat)."""
    task = str(ex.task[i])
    src = None if ex.source is None else f"{ex.source[i]}:"
    return task[len(src) :] if src and task.startswith(src) else task


def index_from_table(ex: probe.Examples, rows: np.ndarray, answers: dict[tuple[str, int], dict]) -> list[dict]:
    """The table's rows `rows` as index.jsonl rows, each checked against the rebuilt `answers`
    ((task, answer) -> boundaries.jsonl's row); TablesError names the rows that do not match."""
    out, bad = [], []
    for i in rows:
        task, ans, length, whole = task_id(ex, i), int(ex.answer[i]), int(ex.length[i]), bool(ex.whole[i])
        a = answers.get((task, ans))
        why = None
        if a is None:
            why = "no such answer"
        elif whole and length != len(a["token_ids"]):
            why = f"the answer has {len(a['token_ids'])} tokens"
        elif whole and bool(a["passed"]) != bool(ex.label[i]):
            why = f"its tests give {int(a['passed'])}"
        elif not whole and length not in a["boundaries"][:-1]:
            why = "not one of the answer's boundaries"
        if why:
            bad.append(f"{task} answer {ans} {'whole' if whole else 'prefix'} length {length}: {why}")
        out.append({"task": task, "answer": ans, "kind": "whole" if whole else "prefix", "length": length,
                    "label": int(ex.label[i]), "weight": float(ex.weight[i]), "table_row": int(i)})  # fmt: skip
    if bad:
        raise TablesError(
            f"{len(bad)} of {len(rows)} table rows do not match the rebuilt answers: " + "; ".join(bad[:5])
        )
    return out


def rebuild(job: data.Job, table: scores.ScoreTable, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Steps 1-3 (module docstring) for one prompt set: its rows' KL statistics [n, 6] and
    hidden states at the prefix [n, H], in the order of `rows`."""
    ex = table.ex
    if not len(rows):
        raise TablesError(f"{job.settings.set_name}: the table has no rows of this set")
    top: dict[str, int] = {}
    for i in rows:
        t = task_id(ex, i)
        top[t] = max(top.get(t, -1), int(ex.answer[i]))
    job.balance_tasks = balance_picker(job.items, top)
    job.folder.mkdir(parents=True, exist_ok=True)
    for stage, fn in (("answers", data.stage_answers), ("boundaries", data.stage_boundaries)):
        if not job.done(stage):
            fn(job)
            job.log(f"{stage}: done, {job.seconds(stage) / 60:.1f} min of work")
    answers = {(a["task"], a["answer"]): a for a in data.read_jsonl(job.path("boundaries.jsonl"))}
    index = index_from_table(ex, rows, answers)
    path = job.path("index.jsonl")
    if path.is_file() and data.read_jsonl(path) != index:
        raise TablesError(f"{path} holds other rows than the table's: remove {job.folder} to start again")
    data.write_jsonl(path, index)
    baselines.stage_baselines(job)
    return {"kl": np.load(job.path("kl.npy")), "hidden_at_prefix": np.load(job.path("hidden_at_prefix.npy"))}


def with_baselines(table: scores.ScoreTable, parts: list[tuple[np.ndarray, dict[str, np.ndarray]]]) -> probe.Examples:
    """The table's examples with the baselines arrays of the rows in `parts` ((rows, arrays) per
    set; other rows zeros); the hidden state at the prefix stands in as `hidden` (its width is
    the boost's H)."""
    n = len(table.ex)
    kl, hidden = None, None
    for rows, arrays in parts:
        if kl is None:
            kl = np.zeros((n, arrays["kl"].shape[1]))
            hidden = np.zeros((n, arrays["hidden_at_prefix"].shape[1]), dtype=np.float32)
        kl[rows], hidden[rows] = arrays["kl"], arrays["hidden_at_prefix"]
    ex = table.ex
    return probe.Examples(**{k: getattr(ex, k) for k in probe._ARRAYS if k != "hidden"}, hidden=hidden, how=ex.how,
                          evidence=ex.evidence, source=ex.source, kl=kl, hidden_at_prefix=hidden)  # fmt: skip


def run(out: Path, jobs: list[tuple[data.Job, str]], log=print) -> dict[str, Any]:
    """Steps 1-4 (module docstring) for the prompt sets `jobs` ((job, split name) each): training
    sets (all or some of those the training table holds) or held-out sets (each with its own
    table). Returns the summary, recomputed from the tables and written back."""
    summary_path = out / "summary.json"
    if not summary_path.is_file():
        raise TablesError(f"{summary_path}: no report here whose tables name the examples")
    summary = json.loads(summary_path.read_text())
    train_split = summary.get("train_split")
    files = summary.get("score_files", {})
    train_sets = summary.get("train_sets") or [train_split]
    held = [(job, sp) for job, sp in jobs if sp in files and sp != train_split]
    training = [(job, sp) for job, sp in jobs if sp in train_sets]
    if len(held) + len(training) != len(jobs) or (training and held):
        raise TablesError(
            f"give either the training sets ({', '.join(train_sets)}) or held-out sets with a table "
            f"({', '.join(s for s in files if s != train_split)}); got {', '.join(sp for _, sp in jobs)}"
        )
    groups = [(train_split, training)] if training else [(sp, [(job, sp)]) for job, sp in held]
    for split, sets in groups:
        path = out / files[split]
        table = scores.read(path)
        parts = []
        for job, sp in sets:
            rows = table_rows(table, sp) if training else np.arange(len(table.ex))
            parts.append((rows, rebuild(job, table, rows)))
            summary.setdefault("data_for_judges", {})[sp] = {
                "folder": str(job.folder), "rows": len(rows), "answers_rebuilt": job.done("boundaries")["answers"],
                "stage_seconds": {s: job.seconds(s) for s in ("answers", "boundaries", baselines.STAGE)},
                **({"kl_check": json.loads(c.read_text())} if (c := job.path("kl_check.json")).is_file() else {}),
            }  # fmt: skip
        given = np.zeros(len(table.ex), dtype=bool)
        for rows, _ in parts:
            given[rows] = True
        ex = with_baselines(table, parts)
        if training:
            got = compare.train(ex.subset(given), (), log=log, judges=TABLE_JUDGES)
            compare.save(out / FITS_FILE, got["kl_statistic"], got["fits"])
            judges = {}
            for name, z in got["oof"].items():  # rows of training sets not given: no score (NaN)
                judges[name] = np.full(len(ex), np.nan)
                judges[name][given] = z
            summary["judges_compared"] = {
                "train_sets": [sp for _, sp in training],
                "kl_statistic": got["kl_statistic"],
                "kl_statistic_aucs": got["kl_statistic_aucs"],
                "features": {n: list(f.features) for n, f in got["fits"].items()},
                "C": got["C"],
                "examples": "the score tables' own rows, their answers rebuilt (tables.py)",
            }
        else:
            fits = out / FITS_FILE
            if not fits.is_file():
                raise TablesError(f"{fits}: fit the judges on the training sets first")
            judges = compare.score(ex, *compare.load(fits))
        merged = {**(table.judges or {}), **judges}
        scores.write(path, ex, table.head, table.old_head, merged)
        log(f"{path}: the compared judges' scores added ({', '.join(judges)})")
    summary = scores.rescore(out, summary)
    report.write(out, summary)
    return summary
