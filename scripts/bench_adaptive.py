#!/usr/bin/env python
"""The adaptive window policy against today's `continue`, from `parse-vllm eval` runs
(`make bench-adaptive` makes them): bench/adaptive/summary.json and summary.md.

Rows, one per (pair, config, τ, batch, split): `pair` (coder | smollm2), `config`
(target | token-k4 | continue | adaptive, and for SmolLM2 with its EAGLE-3 head: eagle3,
parse-alone), `tau` (null where none), `batch`, `tok_s`, `pass_at_1` (HumanEval, the Coder
pair; null otherwise), `split`, `n`, `run`, and `ratio`: the speed over the best of the
target alone and token-level speculation in the same run and batch -- from wall time per
task on the same tasks (parse_vllm/tools/eval/timing.py; the best baseline is the one with
the shorter mean time per task). Each speed figure has its 95% interval over tasks
(`tok_s_ci`, `ratio_ci`, `s_per_task_ci`) and `verdict` says what the ratio's interval
supports (faster, slower, no difference, too few tasks at batch 1). `windows`: windows the
PARSE row opened; `label`: the configuration as the tables name it -- a PARSE row that
opened none says "no window opened: token-level" (it measured token-level speculation
through the PARSE engine, not PARSE). Runs made before per-task timing (no `task_s` in their
rows) keep their tok/s ratios, without intervals, and the tables say so.

    python scripts/bench_adaptive.py --coder bench/adaptive/coder-even bench/judge-coder/e2e-odd \
        --smollm2 bench/adaptive/smollm2-eagle3 --out bench/adaptive
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
from pathlib import Path

from parse_vllm.tools.benchmarks import report as bench_report
from parse_vllm.tools.eval import report as eval_report
from parse_vllm.tools.eval import timing

BASELINES = ("target", "token-k4", "eagle3")
PARSE_CONFIGS = ("continue", "adaptive", "parse-alone", "continue-parts", "adaptive-parts")
OLD_RUN = "tok/s, no interval: a run before per-task timing"

# eval row config -> this report's (the token-level arm of the Coder runs is k 4; of the
# SmolLM2 runs, the EAGLE-3 head)
CODER = {
    "target": "target",
    "token-k4": "token-k4",
    r"parse W=\d+ k4": "continue",
    r"parse W=\d+ adaptive-k4": "adaptive",
    r"parse W=\d+ k4-parts": "continue-parts",  # windows judged in parts as drafted (judge_chunks)
    r"parse W=\d+ adaptive-k4-parts": "adaptive-parts",
}
SMOLLM2 = {
    "target": "target",
    r"eagle3-k\d+": "eagle3",
    r"parse W=\d+": "parse-alone",
    r"parse W=\d+ e3": "continue",
    r"parse W=\d+ adaptive-e3": "adaptive",
}


def _config(name: str, table: dict[str, str]) -> str | None:
    return next((ours for pattern, ours in table.items() if re.fullmatch(pattern, name)), None)


def rows_of(run: Path, pair: str) -> list[dict]:
    """Rows of one eval run (summary.json), merged over its prompt sets: their tasks side by
    side (per-task times and tokens), tok/s over their work, pass@1 over their tasks."""
    summary = json.loads((run / "summary.json").read_text())
    timing.with_repeats(summary["rows"], run / "timings.jsonl")
    experiment = experiment_of(run)
    table = CODER if pair == "coder" else SMOLLM2
    merged: dict[tuple, dict] = {}
    for r in summary["rows"]:
        config = _config(r["config"], table)
        if config is None or r.get("tok_s") is None:
            continue
        key = (config, r.get("tau"), r["batch"], r.get("split"))
        m = merged.setdefault(
            key,
            {
                "tokens": 0,
                "wall_s": 0.0,
                "passed": 0.0,
                "n": 0,
                "sets": [],
                "windows": None,
                "repeats": [],
                "drafts": {},
                "token_k": {},
            },
        )
        for k, v in discarded_counts(r).items():
            m["drafts"][k] = m["drafts"].get(k, 0) + v
        for k, v in ((r.get("acceptance") or {}).get("token_level_k_steps") or {}).items():
            m["token_k"][str(k)] = m["token_k"].get(str(k), 0) + v
        m["tokens"] += r["tokens"]
        m["wall_s"] += r["wall_s"]
        m["sets"].append(r)
        if r.get("pass_at_1") is not None:
            m["passed"] += r["pass_at_1"] * r["n"]
            m["n"] += r["n"]
        w = r.get("windows") if "windows" in r else eval_report.windows_opened(r)
        if w is not None:
            m["windows"] = (m["windows"] or 0) + w
    out = []
    for (config, tau, batch, split), m in merged.items():
        sets = m["sets"]
        timed = all(r.get("task_s") is not None for r in sets)
        row = {
            "pair": pair,
            "config": config,
            "tau": tau,
            "batch": batch,
            "tok_s": m["tokens"] / m["wall_s"],
            "pass_at_1": m["passed"] / m["n"] if m["n"] and pair == "coder" else None,
            "split": split,
            "n": m["n"] or None,
            "run": str(run),
            "experiment": experiment,
            "windows": m["windows"] if config in PARSE_CONFIGS else None,
            # the adaptive policy's token-level arm: its steps at each k (0: the target alone)
            "token_k_steps": m["token_k"] or None,
            "tasks": sum(r.get("n_prompts") or len(r.get("task_s") or []) for r in sets),
            **m["drafts"],
        }
        if timed:
            task_s = [t for r in sets for t in r["task_s"]]
            # the sets side by side in each repeat (every set ran every repeat)
            task_s_repeats = _side_by_side([timing.row_repeats(r) for r in sets])
            task_tokens = [t for r in sets for t in (r.get("task_tokens") or [0] * len(r["task_s"]))]
            reps = min(len(r.get("s_per_task_repeats") or []) for r in sets)
            per_repeat = [
                sum(r["s_per_task_repeats"][i] * len(r["task_s"]) for r in sets) / len(task_s) for i in range(reps)
            ]
            probed = [timing.row_repeats(r, probe=True) for r in sets]
            task_probe_repeats = _side_by_side(probed) if all(probed) else None
            row.update(
                task_s=task_s,
                task_s_repeats=task_s_repeats,
                task_probe_repeats=task_probe_repeats,
                tok_s=sum(task_tokens) / sum(task_s),
                tok_s_ci=timing.tok_s_ci(task_tokens, task_s),
                s_per_task=statistics.fmean(task_s),
                s_per_task_ci=timing.mean_ci(task_s),
                s_per_task_spread=timing.spread(per_repeat),
                repeats=reps,
            )
        row["label"] = label(row)
        out.append(row)
    for r in out:  # the baseline of the same run and batch: the best of target and token-level
        same = [x for x in out if x["batch"] == r["batch"] and x["split"] == r["split"] and x["config"] in BASELINES]
        few = r["batch"] == 1 and r["tasks"] < timing.MIN_BS1_TASKS
        if same and all("task_s" in x for x in same + [r]):
            best = min(same, key=lambda x: x["s_per_task"])
            r["baseline"] = best["config"]
            f = speed(best, r, few)
            r["ratio"], r["ratio_ci"], r["ratio_by_repeat"], r["verdict"] = (
                f["ratio"],
                f["ci"],
                f["by_repeat"],
                f["verdict"],
            )
        else:  # a run timed before per-task timing: tok/s
            r["ratio"] = r["tok_s"] / max(x["tok_s"] for x in same) if same else None
            r["ratio_ci"], r["ratio_by_repeat"], r["verdict"] = None, None, (timing.TOO_FEW if few else None)
        r["tok_s_ci"] = r.get("tok_s_ci")
    return out


def experiment_of(run: Path) -> str | None:
    """What the run timed, as a digest of its timings.jsonl settings (models, prompts, every
    argument, the machine): two runs with the same digest are the same experiment run twice,
    whose repeats the goals pool. None for a run without saved settings."""
    path = run / "timings.jsonl"
    if not path.is_file():
        return None
    with path.open() as f:
        first = f.readline()
    settings = json.loads(first).get("settings") if first.strip() else None
    if settings is None:
        return None
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def pooled(rows: list[dict]) -> list[dict]:
    """Rows of several runs of one experiment as one run's: per configuration and τ, the runs'
    repeats one after the other (repeat r of a run still beside repeat r of the same run's other
    rows), s_per_task their mean. A configuration missing from a run is left out."""
    runs = list(dict.fromkeys(r["run"] for r in rows))
    out = []
    for key in dict.fromkeys((r["config"], r["tau"]) for r in rows):
        group = [r for r in rows if (r["config"], r["tau"]) == key]
        if [r["run"] for r in group] != runs:
            continue
        reps = [rep for r in group for rep in timing.row_repeats(r)]
        probe = [timing.row_repeats(r, probe=True) for r in group]
        task_s = timing.per_task(reps)
        out.append(
            dict(
                group[-1],
                run=", ".join(runs),
                task_s_repeats=reps,
                task_probe_repeats=[rep for p in probe for rep in p] if all(probe) else None,
                task_s=task_s,
                s_per_task=statistics.fmean(task_s),
            )
        )
    return out


def _side_by_side(by_set: list[list[list[float]]]) -> list[list[float]]:
    """Per-task figures by repeat of several sets ([set][repeat][task]) as one set's
    ([repeat][tasks of every set]): every set ran every repeat."""
    return [[t for reps in by_set for t in reps[i]] for i in range(min(len(reps) for reps in by_set))]


def discarded_counts(r: dict) -> dict:
    """Of an eval row's judged windows (its PARSE counters): ``window_draft_tokens`` (their text),
    ``window_tokens_taken`` (taken token-level or by the judge), ``rejected_windows``; empty
    for a row without windows."""
    a = r.get("acceptance") or {}
    needed = ("drafts", "draft_tokens", "tokens_accepted_semantic", "tokens_accepted_token_level", "rejections")
    if not a.get("drafts") or any(k not in a for k in needed):
        return {}
    return {
        "window_draft_tokens": a["draft_tokens"],
        "window_tokens_taken": a["tokens_accepted_semantic"] + a["tokens_accepted_token_level"],
        "rejected_windows": a["rejections"],
    }


def discarded_per_rejection(r: dict) -> float | None:
    """Draft tokens thrown away per rejected window: the windows' text not taken (a window taken
    whole throws none away) over the windows rejected."""
    if not r.get("rejected_windows"):
        return None
    return (r["window_draft_tokens"] - r["window_tokens_taken"]) / r["rejected_windows"]


# an eval run's split -> the set it names in the keys
GOAL_SETS = {"odd": "odd", "test": "mbpp_test"}
GOAL_BASELINES = ("target", "token-k4", "continue")


POLICY_CONFIGS = ("adaptive-parts", "adaptive")  # the policy's row: judged in parts where the run has it
CONTINUE_CONFIGS = ("continue", "continue-parts")


def goal_keys(rows: list[dict], tau: float | None = None) -> dict:
    """The policy's goals as summary.json keys, from the Coder rows at the head's τ (``tau``:
    the τ of the adaptive rows, default the one they all share):
    ``policy_over_best_{set}_bs{b}`` (the fastest of the target, token-level k 4 and `continue`,
    whole or judged in parts, over the policy row's time per task, > 1: the policy is faster;
    goal ≥ 0.97), with ``_ci``, ``_by_repeat``, ``_baseline``, ``_policy`` (adaptive or
    adaptive-parts) and ``_run``, and where the run probed the machine's speed the same ratio in
    probe units (``_probe``, ``_probe_ci``, ``_probe_by_repeat``: timing.py); ``policy_pass_at_1_{set}`` and ``target_pass_at_1_{set}``
    (batch 8); ``discarded_draft_per_rejection_before``: `continue`'s draft tokens thrown away
    per rejected window, ``_after``: the same judged in parts (eval variant k4-parts), both at
    the largest batch where both were run (``_batch``; the Coder sets pooled).

    Ratios compare rows of one run only (timed side by side): for a set and batch, the last
    run given with a policy row; in it, adaptive-parts where it ran, else adaptive. Earlier runs
    of the same experiment (experiment_of) are pooled with it, their repeats as more repeats
    (``_run`` names every run pooled)."""
    coder = [r for r in rows if r["pair"] == "coder" and r["split"] in GOAL_SETS]
    taus = {r["tau"] for r in coder if r["config"] in POLICY_CONFIGS}
    if tau is None:
        if len(taus) > 1:
            raise ValueError(f"the adaptive rows ran at several τ {sorted(taus)}: name one")
        tau = next(iter(taus), None)
    out: dict = {}
    for split, name in GOAL_SETS.items():
        for batch in (1, 8):
            same = [r for r in coder if r["split"] == split and r["batch"] == batch and r.get("task_s") is not None]
            runs = [r["run"] for r in same if r["config"] in POLICY_CONFIGS and r["tau"] == tau]
            if not runs:
                continue
            exp = next(r.get("experiment") for r in same if r["run"] == runs[-1])
            pool = {r["run"] for r in same if exp is not None and r.get("experiment") == exp} | {runs[-1]}
            same = [r for r in same if r["run"] in pool]
            if len(pool) > 1:
                same = pooled(same)
            policy = next(r for c in POLICY_CONFIGS for r in same if r["config"] == c and r["tau"] == tau)
            base = [
                r
                for r in same
                if r["config"] in ("target", "token-k4") or (r["config"] in CONTINUE_CONFIGS and r["tau"] == tau)
            ]
            if not base:
                continue
            best = min(base, key=lambda x: x["s_per_task"])
            f = speed(best, policy)
            key = f"policy_over_best_{name}_bs{batch}"
            out[key], out[f"{key}_ci"], out[f"{key}_by_repeat"] = f["ratio"], f["ci"], f["by_repeat"]
            out[f"{key}_baseline"], out[f"{key}_policy"], out[f"{key}_run"] = (
                best["config"],
                policy["config"],
                policy["run"],
            )
            if p := speed(best, policy, probe=True):  # the machine's changing speed taken out
                out[f"{key}_probe"], out[f"{key}_probe_ci"] = p["ratio"], p["ci"]
                out[f"{key}_probe_by_repeat"] = p["by_repeat"]
        at8 = [r for r in coder if r["split"] == split and r["batch"] == 8]
        for configs, prefix in ((POLICY_CONFIGS, "policy"), (("target",), "target")):
            got = [r for c in configs for r in at8 if r["config"] == c and (c == "target" or r["tau"] == tau)]
            if got and got[0]["pass_at_1"] is not None:
                out[f"{prefix}_pass_at_1_{name}"] = got[0]["pass_at_1"]
    per_batch = {}
    for batch in sorted({r["batch"] for r in coder}, reverse=True):
        got = {}
        for config, key in (("continue", "before"), ("continue-parts", "after")):
            rows_ = [r for r in coder if r["config"] == config and r["tau"] == tau and r["batch"] == batch]
            merged = {
                k: sum(r.get(k, 0) for r in rows_)
                for k in ("window_draft_tokens", "window_tokens_taken", "rejected_windows")
            }
            if (value := discarded_per_rejection(merged)) is not None:
                got[key] = value
        per_batch[batch] = got
    both = [b for b, got in per_batch.items() if len(got) == 2]
    for key in ("before", "after"):
        batch = both[0] if both else next((b for b, got in per_batch.items() if key in got), None)
        if batch is not None:
            out[f"discarded_draft_per_rejection_{key}"] = per_batch[batch][key]
            out[f"discarded_draft_per_rejection_{key}_batch"] = batch
    return out


def goal_lines(keys: dict) -> list[str]:
    """The policy's goals (goal_keys) as a table: adaptive's time per task against the best of the
    target, token-level k 4 and `continue` per set and batch (goal ≥ 0.97 pooled and in each
    repeat), pass@1 against the target's (goal: at most one problem per 40 tasks lost), and the
    draft tokens thrown away per rejected window (goal: 3x fewer judged in parts)."""
    lines = [
        "| set | batch | policy × best (time per task) [95% CI]; by repeat | policy | best | tasks' run | goal ≥ 0.97 |",
        "|---|---:|---|---|---|---|---|",
    ]
    for name in GOAL_SETS.values():
        for batch in (1, 8):
            key = f"policy_over_best_{name}_bs{batch}"
            if key not in keys:
                lines.append(f"| {name} | {batch} | not measured | — | — | — | — |")
                continue
            ratio, by = keys[key], keys[f"{key}_by_repeat"]
            met = "met" if ratio >= 0.97 and all(b is not None and b >= 0.97 for b in by) else "**not met**"
            text = timing.describe_ratio(ratio, keys[f"{key}_ci"], by_repeat=by)
            if f"{key}_probe" in keys:
                probe = timing.describe_ratio(
                    keys[f"{key}_probe"], keys[f"{key}_probe_ci"], by_repeat=keys[f"{key}_probe_by_repeat"]
                )
                text += f"; in probe units {probe}"
            lines.append(
                f"| {name} | {batch} | {text} | {keys.get(f'{key}_policy', 'adaptive')} | {keys[f'{key}_baseline']} | "
                f"{', '.join(f'`{run}`' for run in keys.get(f'{key}_run', '—').split(', '))} | {met} |"
            )
    lines += ["", "| set | pass@1 adaptive | pass@1 target |", "|---|---:|---:|"]
    for name in GOAL_SETS.values():
        a, t = keys.get(f"policy_pass_at_1_{name}"), keys.get(f"target_pass_at_1_{name}")
        lines.append(f"| {name} | {'—' if a is None else f'{a:.3f}'} | {'—' if t is None else f'{t:.3f}'} |")
    before, after = keys.get("discarded_draft_per_rejection_before"), keys.get("discarded_draft_per_rejection_after")
    b_before, b_after = (keys.get(f"discarded_draft_per_rejection_{k}_batch") for k in ("before", "after"))
    lines += [
        "",
        "Draft tokens thrown away per rejected window, `continue`: "
        + ("—" if before is None else f"{before:.1f} judged whole (batch {b_before})")
        + ", "
        + ("not measured judged in parts" if after is None else f"{after:.1f} judged in parts (batch {b_after})")
        + " (goal: 3x fewer).",
    ]
    return lines


def speed(ref: dict, row: dict, few: bool = False, probe: bool = False) -> dict | None:
    """ref's time per task over row's, pooled, by repeat, with the interval over repeats and
    tasks and the verdict (timing.speed_figures); probe: the same in probe units (None
    where either row was not probed)."""
    a, b = timing.row_repeats(ref, probe), timing.row_repeats(row, probe)
    return timing.speed_figures(a, b, few) if a and b else None


def label(r: dict) -> str:
    """The configuration as the tables name it: a PARSE row that opened no window says so, and
    an adaptive row says which k its token-level arm chose (share of its steps)."""
    notes = [eval_report.TOKEN_LEVEL_TAG] if r["config"] in PARSE_CONFIGS and r.get("windows") == 0 else []
    if steps := r.get("token_k_steps"):
        total = sum(steps.values())
        mix = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(steps.items(), key=lambda kv: int(kv[0])))
        notes.append(f"token-level k {mix}")
    return f"{r['config']} ({'; '.join(notes)})" if notes else r["config"]


def _timed(rows: list[dict]) -> bool:
    return any(r.get("s_per_task") is not None for r in rows)


def _ci(v: float | None, ci, fmt: str = ".2f") -> str:
    if v is None:
        return "—"
    return format(v, fmt) + (f" [{format(ci[0], fmt)}, {format(ci[1], fmt)}]" if ci else "")


ORDER = {
    "target": 0, "token-k4": 1, "eagle3": 1, "parse-alone": 2, "continue": 3, "continue-parts": 4, "adaptive": 5,
    "adaptive-parts": 6,
}  # fmt: skip


def _sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r["pair"], r["split"] or "", r["batch"], r["tau"] or -1, ORDER[r["config"]]))


def render(rows: list[dict]) -> str:
    if not _timed(rows):
        return _render_tok_s(rows)
    lines = [
        "| pair | split | batch | τ | configuration | tasks | s/task [95% CI] | spread of repeats | "
        "speed × best of target and token-level (time per task) [95% CI] | tok/s [95% CI] | pass@1 |",
        "|---|---|---:|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in _sorted(rows):
        tau = "—" if r["tau"] is None else f"{r['tau']:g}"
        p = "—" if r["pass_at_1"] is None else f"{r['pass_at_1']:.3f}"
        few = r.get("verdict") == timing.TOO_FEW
        ratio = (
            timing.describe_ratio(r["ratio"], r.get("ratio_ci"), few, r.get("ratio_by_repeat"))
            if r["config"] not in BASELINES
            else (f"{r['ratio']:.2f}x" if r["ratio"] is not None else "—")
        )
        if r.get("s_per_task") is None and r["ratio"] is not None:
            ratio += f" ({OLD_RUN})"
        spread = "—" if r.get("s_per_task_spread") is None else f"{r['s_per_task_spread']:.1%}"
        lines.append(
            f"| {r['pair']} | {r['split'] or '—'} | {r['batch']} | {tau} | {r['label']} | {r['tasks']} | "
            f"{_ci(r.get('s_per_task'), r.get('s_per_task_ci'))} | {spread} | {ratio} | "
            f"{_ci(r['tok_s'], r.get('tok_s_ci'), '.1f')} | {p} |"
        )
    return "\n".join(lines) + "\n"


def _render_tok_s(rows: list[dict]) -> str:
    """The table of runs timed before per-task timing (tok/s, no intervals)."""
    lines = [
        "| pair | split | batch | τ | configuration | tok/s | × best of target and token-level | pass@1 |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in _sorted(rows):
        tau = "—" if r["tau"] is None else f"{r['tau']:g}"
        p = "—" if r["pass_at_1"] is None else f"{r['pass_at_1']:.3f}"
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['pair']} | {r['split'] or '—'} | {r['batch']} | {tau} | {r.get('label', r['config'])} | "
            f"{r['tok_s']:.1f} | {ratio} | {p} |"
        )
    return "\n".join(lines) + "\n"


def goals(rows: list[dict]) -> list[str]:
    """The issue's goals, row by row: adaptive ≥ 0.95x the best of the target and
    token-level speculation (SmolLM2: ≥ the best of EAGLE-3 alone and PARSE alone), and its
    pass@1 no worse than `continue`'s at the same τ by more than one problem. Speeds from
    time per task with their intervals; an adaptive row that opened no window says so."""
    if not _timed(rows):
        return _goals_tok_s(rows)
    lines = [
        "| pair | split | batch | τ | adaptive | adaptive × best baseline [95% CI] | goal | adaptive × continue [95% CI] "
        "| pass@1 adaptive − continue (problems) |",
        "|---|---|---:|---:|---|---:|---|---:|---:|",
    ]
    key = lambda r: (r["pair"], r["split"], r["batch"], r["tau"], r["run"])  # noqa: E731 (one run: timed side by side)
    by = {(key(r), r["config"]): r for r in rows}
    for r in sorted(
        (r for r in rows if r["config"] == "adaptive"),
        key=lambda r: (r["pair"], r["split"] or "", r["batch"], r["tau"]),
    ):
        k, cont = key(r), by.get((key(r), "continue"))
        few = r.get("verdict") == timing.TOO_FEW
        if r.get("task_s") is None:  # a run before per-task timing beside re-measured ones
            same_run = [x for x in rows if x["run"] == r["run"]]
            lines += _goals_tok_s(same_run, only=r)
            continue
        if r["pair"] == "smollm2":
            pool = [
                x
                for x in rows
                if x["pair"] == "smollm2" and x["config"] in ("eagle3", "parse-alone") and x.get("task_s") is not None
            ]
            best = min(pool, key=lambda x: x["s_per_task"]) if pool else None
            f = speed(best, r) if best else {"ratio": None, "ci": None, "by_repeat": None}
            ratio, ci, by_repeat, bound = f["ratio"], f["ci"], f["by_repeat"], 1.0
        else:
            ratio, ci, by_repeat, bound = r["ratio"], r.get("ratio_ci"), r.get("ratio_by_repeat"), 0.95
        met = "met" if ratio is not None and ratio >= bound else "**not met**"
        vs = "—"
        if cont and cont.get("task_s") is not None and r.get("task_s") is not None:
            f = speed(cont, r, few)
            vs = timing.describe_ratio(f["ratio"], f["ci"], few, f["by_repeat"])
        dp = "—"
        if cont and r["pass_at_1"] is not None and cont["pass_at_1"] is not None and r["n"]:
            dp = f"{round((r['pass_at_1'] - cont['pass_at_1']) * r['n']):+d}"
        tau = "—" if k[3] is None else f"{k[3]:g}"
        lines.append(
            f"| {k[0]} | {k[1] or '—'} | {k[2]} | {tau} | {r['label']} | {timing.describe_ratio(ratio, ci, few, by_repeat)} | "
            f"≥ {bound:g}: {met} | {vs} | {dp} |"
        )
    return lines


def _goals_tok_s(rows: list[dict], only: dict | None = None) -> list[str]:
    """The goals table of runs timed before per-task timing (tok/s ratios, no intervals);
    with ``only``, that adaptive row's line alone (in the re-measured table's columns)."""
    lines = (
        []
        if only is not None
        else [
            "| pair | split | batch | τ | adaptive × best baseline | goal | adaptive × continue | pass@1 adaptive − continue (problems) |",
            "|---|---|---:|---:|---:|---|---:|---:|",
        ]
    )
    key = lambda r: (r["pair"], r["split"], r["batch"], r["tau"], r["run"])  # noqa: E731 (one run: timed side by side)
    by = {(key(r), r["config"]): r for r in rows}
    for r in sorted(
        (r for r in rows if r["config"] == "adaptive" and (only is None or r is only)),
        key=lambda r: (r["pair"], r["split"] or "", r["batch"], r["tau"]),
    ):
        k, cont = key(r), by.get((key(r), "continue"))
        if r["pair"] == "smollm2":
            best = max(x["tok_s"] for x in rows if x["pair"] == "smollm2" and x["config"] in ("eagle3", "parse-alone"))
            ratio, bound = r["tok_s"] / best, 1.0
        else:
            ratio, bound = r["ratio"], 0.95
        met = "met" if ratio is not None and ratio >= bound else "**not met**"
        vs = f"{r['tok_s'] / cont['tok_s']:.2f}" if cont else "—"
        dp = "—"
        if cont and r["pass_at_1"] is not None and cont["pass_at_1"] is not None and r["n"]:
            dp = f"{round((r['pass_at_1'] - cont['pass_at_1']) * r['n']):+d}"
        tau = "—" if k[3] is None else f"{k[3]:g}"
        note = f" ({eval_report.TOKEN_LEVEL_TAG})" if r.get("windows") == 0 else ""
        if only is not None:  # the re-measured table's columns
            lines.append(
                f"| {k[0]} | {k[1] or '—'} | {k[2]} | {tau} | {label(r)} | {ratio:.2f} ({OLD_RUN}) | "
                f"≥ {bound:g}: {met} | {vs} | {dp} |"
            )
            continue
        lines.append(
            f"| {k[0]} | {k[1] or '—'} | {k[2]} | {tau} | {ratio:.2f}{note} | ≥ {bound:g}: {met} | {vs} | {dp} |"
        )
    return lines


def noise_lines(noise: dict[str, dict]) -> list[str]:
    """Each run's noise floor (the target alone measured twice), as the eval report states it."""
    return [
        f"- `{run}`"
        + (f" (processes: {nf['processes']})" if nf.get("processes") else "")
        + f": {eval_report.noise_floor_line(nf)}"
        for run, nf in noise.items()
    ]


def section(rows: list[dict], noise: dict[str, dict] | None = None) -> str:
    """BENCHMARKS.md's section (tools/benchmarks/report.py appends bench/adaptive/section.md)."""
    if _timed(rows):
        how = (
            "Speed is wall time per task on the same tasks (every configuration timed twice or more, interleaved, "
            "each timed job from a fresh engine or an emptied prefix cache after the same warm-up, in a process of "
            "its own or, in runs of short jobs, in the run's one process: each run's line below says which); ratios "
            "are the best of the target alone and token-level speculation of the same run and batch over the row's time per "
            "task, pooled over the repeats and each repeat's own beside it, with 95% intervals from resampling repeats and tasks; "
            "a ratio is faster or slower only where its interval excludes 1.0 and every repeat agrees, else no difference. "
            f'A PARSE row that opened no window is labelled "{eval_report.TOKEN_LEVEL_TAG}".'
        )
    else:
        how = (
            "Ratios are to the best of the target alone and token-level speculation of the same run and batch "
            "(tok/s: these runs predate per-task timing, so the ratios carry no interval and order effects inside an "
            "engine are not controlled)."
        )
    return (
        "\n".join(
            [
                "## Adaptive windows (`make bench-adaptive`)",
                "",
                "`on_reject: adaptive` against today's `continue` (`scripts/bench_adaptive.py`, `bench/adaptive/`): each "
                "row is one `parse-vllm eval` run's, beside the target alone and token-level speculation measured in the "
                "same run (the Coder pair: W 128, k 4 by the draft as the token-level arm, two-stage judging, greedy, "
                "384 tokens; the even rows judge zero-shot, the odd rows with the shipped judge head; SmolLM2: W 48, its EAGLE-3 head k 3, τ 0.9, MT-Bench and checkable prompts, batch 1; the tasks column counts them). "
                + how,
                "",
                render(rows).rstrip("\n"),
                "",
                *goals(rows),
                "",
                "The policy's goals (issue 47), from the Coder rows at the head's τ:",
                "",
                *goal_lines(goal_keys(rows)),
                *(["", "Noise floor of each run:", "", *noise_lines(noise)] if noise else []),
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--coder", nargs="*", type=Path, default=[], help="eval runs on the Qwen2.5-Coder pair")
    ap.add_argument("--smollm2", nargs="*", type=Path, default=[], help="eval runs on SmolLM2 with its EAGLE-3 head")
    ap.add_argument("--out", type=Path, default=Path("bench/adaptive"))
    args = ap.parse_args(argv)
    rows = [r for run in args.coder for r in rows_of(run, "coder")]
    rows += [r for run in args.smollm2 for r in rows_of(run, "smollm2")]
    if not rows:
        print("bench_adaptive: no rows (give --coder and/or --smollm2 eval runs)", file=sys.stderr)
        return 2
    noise = {}
    for run in [*args.coder, *args.smollm2]:
        summary = json.loads((run / "summary.json").read_text())
        nf = eval_report.with_probe_noise_floor(summary.get("noise_floor"), run / "timings.jsonl")
        if nf and nf.get("by_set_batch"):
            # runs before a process per job name none: they ran in one
            noise[str(run)] = dict(nf, processes=(summary.get("harness") or {}).get("processes", "one for the run"))
    args.out.mkdir(parents=True, exist_ok=True)
    out = {**goal_keys(rows), "rows": rows, **({"noise_floor": noise} if noise else {})}
    (args.out / "summary.json").write_text(json.dumps(out, indent=1))
    (args.out / "summary.md").write_text(render(rows) + ("\n" + "\n".join(noise_lines(noise)) + "\n" if noise else ""))
    (args.out / "section.md").write_text(section(rows, noise))
    root = Path(__file__).resolve().parents[1]
    if (root / "BENCHMARKS.md").is_file() and (args.out / "section.md").resolve() in {
        (root / p).resolve() for p in bench_report.SECTIONS
    }:  # the section is BENCHMARKS.md's: keep the two in step
        (root / "BENCHMARKS.md").write_text(bench_report.committed(root))
        print("wrote BENCHMARKS.md")
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
