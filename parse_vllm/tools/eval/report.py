"""Scores, the recommendation, and the report files of `parse-vllm eval` (no vLLM here).

A row is one (prompt set, config, τ, guard, batch), timed ``repeats`` times (timing.py).
:func:`score` adds, against the target-alone row of the same prompt set and batch:
``speedup`` (the target's mean time per task over this row's, on the same tasks; > 1:
faster, pooled over the repeats), ``speedup_by_repeat`` (each repeat's own), ``speedup_ci``
(its 95% bootstrap interval over repeats and tasks), ``speedup_verdict`` (faster or slower
where the interval excludes 1.0 and every repeat agrees, else no difference; too few tasks
for batch-1 rows on fewer than 12), ``speedup_tok_s`` (tokens/s over the target's: secondary, it
rewards longer answers), ``accuracy`` (share of checkable items answered right; null where
none is checkable), ``accuracy_drop`` (target's − this), ``nll_vs_target`` (this row's NLL
per token over the target's), ``rouge_l`` (against the target's text), ``repeat_3gram``,
and ``label``: the configuration as every table and plot names it -- a PARSE row that
opened no window says so, "token-level": it measured token-level speculation through the
PARSE engine, not PARSE.

:func:`recommend`: per batch size, the fastest non-target setting (config, τ, guard) whose
loss stays within the budget on every prompt set -- accuracy drop ≤ ``max_accuracy_drop``
where answers are checked, ``nll_vs_target`` ≤ 1 + ``max_nll_increase`` -- and that is
faster than the target on every prompt set (its interval above 1.0; ordered by the
geometric mean of its speed-ups). The reported recommendation is batch 1's (the smallest
batch run when batch 1 was not).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from parse_vllm.tools.benchmarks import common

from . import metrics, timing

NO_SETTING = "no setting is faster than the target within this budget"
ROW_KEYS = (
    "set",
    "split",
    "n",
    "pass_at_1",
    "config",
    "tau",
    "guard",
    "batch",
    "n_prompts",
    "label",
    "windows",
    "windows_repeats",
    "repeats",
    "tokens",
    "wall_s",
    "s_per_task",
    "s_per_task_ci",
    "s_per_task_spread",
    "s_per_task_repeats",
    "task_s",
    "task_s_repeats",
    "task_tokens",
    "tok_s",
    "tok_s_ci",
    "tok_s_spread",
    "tok_s_repeats",
    "speedup",
    "speedup_ci",
    "speedup_by_repeat",
    "speedup_verdict",
    "speedup_tok_s",
    "few_tasks",
    "order",
    "engine",
    "prefix_cache_hits",
    "same_text_repeats",
    "accuracy",
    "accuracy_drop",
    "n_checkable",
    "nll_per_token",
    "nll_vs_target",
    "repeat_3gram",
    "rouge_l",
    "exact",
    "latency_p50_s",
    "latency_p90_s",
    "acceptance",
    "item_ids",  # per task, in order: its id, its tests' verdict, PARSE's counters of its request
    "correct",
    "task_acceptance",
)


# A row's figures in probe units (timing.py), kept only where its run probed the machine's speed.
PROBE_KEYS = (
    "speedup_probe",
    "speedup_probe_ci",
    "speedup_probe_by_repeat",
    "speedup_probe_verdict",
    "task_probe_repeats",
    "probe_s_repeats",
)


def summary_row(r: dict) -> dict:
    """A row as summary.json keeps it: ROW_KEYS, and PROBE_KEYS where the run probed."""
    probed = {k: r[k] for k in PROBE_KEYS if r.get(k) is not None}
    if not all(probed.get("probe_s_repeats") or [None]):  # some repeat not probed (a run resumed across the change)
        probed.pop("probe_s_repeats", None)
    return {**{k: r.get(k) for k in ROW_KEYS}, **probed}


def setting(row: dict) -> tuple:
    return (row["config"], row.get("tau"), row.get("guard"))


def _target(rows: list[dict], name: str, batch: int) -> dict:
    for r in rows:
        if r["config"] == "target" and r["set"] == name and r["batch"] == batch:
            return r
    raise ValueError(f"no target-alone row for prompt set {name!r} at batch {batch}")


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b == 0:
        return 1.0 if a == 0 else float("inf")
    return a / b


def is_parse(row: dict) -> bool:
    return row["config"].startswith("parse")


def windows_opened(row: dict) -> int | None:
    """Windows a PARSE row opened (drafts judged semantically, or windows the adaptive policy
    opened, whichever is more; None for other rows and rows without counters)."""
    acc = row.get("acceptance")
    if not is_parse(row) or acc is None:  # no counters: not known
        return None
    opened = acc.get("windows_opened") or {}
    return max(int(acc.get("drafts") or 0), sum(int(v) for v in opened.values()))


TOKEN_LEVEL_TAG = "no window opened: token-level"


def display(row: dict) -> str:
    """The configuration as tables and plots name it: :func:`label`, and for a PARSE row that
    opened no window (``windows`` 0, or its counters say so) the tag that it measured
    token-level speculation through the PARSE engine."""
    windows = row.get("windows") if "windows" in row else windows_opened(row)
    name = label(row)
    return f"{name} ({TOKEN_LEVEL_TAG})" if is_parse(row) and windows == 0 else name


def _speed(r: dict, ref: dict) -> None:
    r["speedup_tok_s"] = r["tok_s"] / ref["tok_s"] if ref.get("tok_s") and r.get("tok_s") is not None else None
    if r.get("task_s") is None or ref.get("task_s") is None:  # a run before per-task timing: tok/s
        r["speedup"], r["speedup_ci"], r["speedup_verdict"] = r["speedup_tok_s"], None, None
        r["speedup_by_repeat"] = None
        return
    f = timing.speed_figures(timing.row_repeats(ref), timing.row_repeats(r), bool(r.get("few_tasks")))
    r["speedup"], r["speedup_by_repeat"] = f["ratio"], f["by_repeat"]
    r["speedup_ci"] = [1.0, 1.0] if r is ref else f["ci"]
    r["speedup_verdict"] = None if r is ref else f["verdict"]
    # the same in probe units (timing.py): the machine's changing speed taken out
    ref_units, units = timing.row_repeats(ref, probe=True), timing.row_repeats(r, probe=True)
    p = timing.speed_figures(ref_units, units, bool(r.get("few_tasks"))) if ref_units and units else None
    if p is not None:
        r["speedup_probe"], r["speedup_probe_by_repeat"] = p["ratio"], p["by_repeat"]
        r["speedup_probe_ci"] = [1.0, 1.0] if r is ref else p["ci"]
        r["speedup_probe_verdict"] = None if r is ref else p["verdict"]


def speeds(rows: list[dict]) -> None:
    """Every row's speed-up against its target-alone row (in place): ``speedup``,
    ``speedup_by_repeat``, ``speedup_ci``, ``speedup_verdict``, ``speedup_tok_s``."""
    for r in rows:
        _speed(r, _target(rows, r["set"], r["batch"]))


def score(rows: list[dict]) -> None:
    """Fill in every row's figures against its target-alone row (in place). Rows carry
    ``outputs`` (token ids), ``correct`` (per item: True/False, None where not checkable),
    ``nll_logprobs`` (per output: the target's log-probabilities of its tokens), ``task_s``
    (per-task seconds, and ``task_s_repeats`` by repeat) and ``tok_s``."""
    speeds(rows)
    for r in rows:
        ref = _target(rows, r["set"], r["batch"])
        reps = [w for w in r.get("windows_repeats") or [] if w is not None]
        r["windows"] = max(reps) if reps else windows_opened(r)  # 0: none in any repeat
        r["label"] = display(r)
        judged = [c for c in r.get("correct") or [] if c is not None]
        r["n_checkable"] = len(judged)
        r["accuracy"] = sum(judged) / len(judged) if judged else None
        r["nll_per_token"] = metrics.nll_per_token(r["nll_logprobs"]) if r.get("nll_logprobs") is not None else None
        r["repeat_3gram"] = metrics.repeat_3gram(r["outputs"])
        r["rouge_l"] = metrics.mean_rouge_l(r["outputs"], ref["outputs"])
        r["exact"] = statistics.mean(float(list(o) == list(t)) for o, t in zip(r["outputs"], ref["outputs"]))
    for r in rows:  # second pass: the target's own figures are all in now
        ref = _target(rows, r["set"], r["batch"])
        r["nll_vs_target"] = 1.0 if r is ref else _ratio(r["nll_per_token"], ref["nll_per_token"])
        r["accuracy_drop"] = (
            None if r["accuracy"] is None or ref["accuracy"] is None else ref["accuracy"] - r["accuracy"]
        )


def _within(r: dict, max_accuracy_drop: float, max_nll_increase: float) -> bool:
    if r["accuracy_drop"] is not None and r["accuracy_drop"] > max_accuracy_drop + 1e-9:
        return False
    if r["nll_vs_target"] is not None and r["nll_vs_target"] > 1.0 + max_nll_increase + 1e-9:
        return False
    return True


def _geomean(xs: list[float]) -> float:
    return math.exp(statistics.mean(math.log(x) for x in xs)) if all(x > 0 for x in xs) else 0.0


def faster(r: dict) -> bool:
    """Faster than the target: its interval above 1.0 (a row timed before per-task timing,
    without an interval: its ratio above 1.0)."""
    if r.get("speedup_verdict") is None and r.get("speedup_ci") is None:
        return r["speedup"] is not None and r["speedup"] > 1.0
    return r.get("speedup_verdict") == timing.FASTER


def _total_windows(rows: list[dict]) -> int | None:
    """Windows opened over a setting's prompt sets (None where a row's are not known)."""
    counts = [r.get("windows") for r in rows]
    return None if any(c is None for c in counts) else sum(counts)


def candidates(rows: list[dict], batch: int, max_accuracy_drop: float, max_nll_increase: float) -> list[dict]:
    """Every non-target setting run at ``batch`` on all prompt sets, with its figures and
    whether it stays within the budget; fastest first."""
    sets = sorted({r["set"] for r in rows})
    by_setting: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["batch"] == batch and r["config"] != "target":
            by_setting.setdefault(setting(r), {})[r["set"]] = r
    out = []
    for key, per_set in by_setting.items():
        if set(per_set) != set(sets) or any(r["speedup"] is None for r in per_set.values()):
            continue
        speed = _geomean([per_set[s]["speedup"] for s in sets])
        out.append(
            {
                "config": key[0],
                "tau": key[1],
                "guard": key[2],
                "batch": batch,
                "speedup": speed,
                "faster": all(faster(per_set[s]) for s in sets),
                "within_budget": all(_within(per_set[s], max_accuracy_drop, max_nll_increase) for s in sets),
                "windows": _total_windows([per_set[s] for s in sets]),
                "per_set": {
                    s: {
                        k: per_set[s].get(k)
                        for k in (
                            "speedup",
                            "speedup_ci",
                            "speedup_by_repeat",
                            "speedup_verdict",
                            "few_tasks",
                            "accuracy",
                            "accuracy_drop",
                            "nll_vs_target",
                            "rouge_l",
                        )
                    }
                    for s in sets
                },
            }
        )
    return sorted(out, key=lambda c: -c["speedup"])


def recommend(rows: list[dict], max_accuracy_drop: float, max_nll_increase: float) -> dict[str, Any]:
    """``{"recommended": entry or None, "recommendation": sentence, "by_batch": {batch: entry or None}}``."""
    by_batch: dict[str, dict | None] = {}
    sentences: dict[str, str] = {}
    for b in sorted({r["batch"] for r in rows}):
        within = [c for c in candidates(rows, b, max_accuracy_drop, max_nll_increase) if c["within_budget"]]
        cands = [c for c in within if c["faster"]]
        best = cands[0] if cands else None
        by_batch[str(b)] = best
        if best:
            sentences[str(b)] = describe(best, max_accuracy_drop, max_nll_increase)
        elif within and within[0]["speedup"] > 1.0:  # faster on its face, not resolved by the timing
            sentences[str(b)] = f"{NO_SETTING} (the fastest within it, {unresolved(within[0])})"
        else:
            sentences[str(b)] = NO_SETTING
    first = "1" if "1" in by_batch else (min(by_batch, key=int) if by_batch else None)
    return {
        "recommended": by_batch.get(first) if first else None,
        "recommendation": sentences.get(first, NO_SETTING),
        "recommendation_batch": first and int(first),
        "by_batch": by_batch,
        "recommendation_by_batch": sentences,
        "budget": {"max_accuracy_drop": max_accuracy_drop, "max_nll_increase": max_nll_increase},
    }


def label(entry: dict) -> str:
    s = entry["config"]
    if entry.get("tau") is not None:
        s += f" τ={entry['tau']:g}"
    if entry.get("guard"):
        s += f" guard={entry['guard']}"
    return s


def _entry_name(entry: dict) -> str:
    name = label(entry)
    return f"{name} ({TOKEN_LEVEL_TAG})" if entry.get("windows") == 0 else name


def _describe_speed(r: dict, key: str = "speedup") -> str:
    """A row's (or a candidate's per-set) speed-up against the target, its interval and each
    repeat's figure, as the tables write it (key "speedup_probe": the same in probe units)."""
    return timing.describe_ratio(r[key], r.get(f"{key}_ci"), bool(r.get("few_tasks")), r.get(f"{key}_by_repeat"))


def unresolved(entry: dict) -> str:
    """A candidate faster on its face whose intervals do not show it."""
    bits = [f"{name}: {_describe_speed(f)}" for name, f in entry["per_set"].items()]
    return f"{_entry_name(entry)} at batch {entry['batch']}: {'; '.join(bits)}"


def describe(entry: dict, max_accuracy_drop: float, max_nll_increase: float) -> str:
    parts = []
    for name, f in entry["per_set"].items():
        speed = timing.describe_ratio(f["speedup"], f.get("speedup_ci"), by_repeat=f.get("speedup_by_repeat"))
        bit = (
            f"{name}: {speed}, NLL ×{f['nll_vs_target']:.3f}" if f["nll_vs_target"] is not None else f"{name}: {speed}"
        )
        if f["accuracy_drop"] is not None:
            bit += f", accuracy {f['accuracy']:.2f} ({-f['accuracy_drop']:+.2f})"
        parts.append(bit)
    return (
        f"{_entry_name(entry)} at batch {entry['batch']}: {entry['speedup']:.2f}x the target alone's speed "
        f"(time per task; geometric mean over the prompt sets; {'; '.join(parts)}), the fastest setting faster "
        f"than the target on every prompt set whose accuracy drop stays within {max_accuracy_drop:g} and NLL "
        f"increase within {max_nll_increase:.0%}"
    )


# -- files ---------------------------------------------------------------------------------

COLS = [
    ("set", "prompts", ""),
    ("label", "config", ""),
    ("tau", "τ", ""),
    ("guard", "guard", ""),
    ("batch", "bs", ""),
    ("n_prompts", "tasks", ""),
    ("s_per_task_text", "s/task [95% CI]", ""),
    ("spread_text", "spread of repeats", ""),
    ("speed_text", "speed vs target alone (time per task) [95% CI]", ""),
    ("tok_s", "tok/s", ".1f"),
    ("speedup_tok_s", "tok/s ratio", ".2f"),
    ("accuracy", "accuracy", ".2f"),
    ("nll_per_token", "NLL/token", ".3f"),
    ("nll_vs_target", "NLL ratio", ".3f"),
    ("repeat_3gram", "rep. 3-grams", ".3f"),
    ("rouge_l", "ROUGE-L", ".3f"),
    ("exact", "same text", ".2f"),
    ("windows", "windows", ""),
    ("sem_accepted", "accepted semantic", ""),
    ("tok_accepted", "accepted token-level", ""),
    ("acceptance_rate", "draft tokens accepted", ".2f"),
]


PROBE_COL = ("speed_probe_text", "the same in probe units (the machine's speed out) [95% CI]", "")


def _columns(rows: list[dict]) -> list[tuple]:
    """COLS, with the run where rows come from several, and the speed in probe units where
    some row has it."""
    cols = ([("run", "run", "")] if any("run" in r for r in rows) else []) + COLS[1:]
    if any(r.get("speedup_probe") is not None for r in rows):
        at = next(i for i, c in enumerate(cols) if c[0] == "speed_text") + 1
        cols.insert(at, PROBE_COL)
    return cols


def _table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        acc = r.get("acceptance") or {}
        s_ci = r.get("s_per_task_ci")
        s_text = None
        if r.get("s_per_task") is not None:
            s_text = f"{r['s_per_task']:.2f}" + (f" [{s_ci[0]:.2f}, {s_ci[1]:.2f}]" if s_ci else "")
        spread = r.get("s_per_task_spread")
        speed = None
        if r["config"] != "target" and r.get("speedup") is not None:
            speed = _describe_speed(r)
            if r.get("speedup_ci") is None:
                speed += " (tok/s: a run without per-task times)"
        speed_probe = None
        if r["config"] != "target" and r.get("speedup_probe") is not None:
            speed_probe = _describe_speed(r, "speedup_probe")
        out.append(
            dict(
                r,
                label=display(r),
                speed_probe_text=speed_probe,
                s_per_task_text=s_text,
                spread_text=None if spread is None else f"{spread:.1%} ({r.get('repeats')} repeats)",
                speed_text=speed,
                sem_accepted=acc.get("tokens_accepted_semantic"),
                tok_accepted=acc.get("tokens_accepted_token_level"),
                acceptance_rate=acc.get("acceptance_rate"),
            )
        )
    return out


def noise_floor_summary(baselines: list[dict]) -> dict:
    """The run's noise floor: the target alone measured twice per prompt set and batch (the
    baselines' self-ratio and spread), and the largest spread of them."""
    keys = ("s_per_task_repeats", "spread", "self_ratio", "self_ratio_ci")
    entries = [
        {
            **{k: b.get(k) for k in ("set", "batch", *keys)},
            **{f"probe_{k}": b[f"probe_{k}"] for k in keys if f"probe_{k}" in b},
        }
        for b in baselines
        if b.get("s_per_task_repeats") is not None
    ]
    return {
        "config": "target",
        "what": "the target alone, timed in every repeat: repeat 2's time per task over repeat 1's (self_ratio, "
        "with its interval over tasks), and the spread of its repeats' mean time per task; probe_*: the same "
        "in probe units (timing.py), where every repeat was probed",
        "by_set_batch": entries,
        "max_spread": _largest(entries, "spread"),
        "max_spread_probe": _largest(entries, "probe_spread"),
    }


def _largest(entries: list[dict], key: str) -> float | None:
    """The largest `key` of the noise floor's entries that have one."""
    values = [e[key] for e in entries if e.get(key) is not None]
    return max(values) if values else None


def with_probe_noise_floor(nf: dict, timings_path) -> dict:
    """A run's noise floor (noise_floor_summary) with its probe-unit figures taken from the
    run's timings.jsonl where the summary was saved without them (runs from before they were
    computed): the target's per-task probe units by repeat, on the same set and batch. The
    timings must give the summary's own repeats in seconds (else they are another run's)."""
    import os

    if not nf or not os.path.exists(timings_path):
        return nf
    seconds = timing.repeats_in_timings(timings_path)
    probes = timing.repeats_in_timings(timings_path, field="task_probe")
    entries = []
    for e in nf.get("by_set_batch", []):
        if "probe_spread" not in e:
            key = next((k for k in seconds if (k[0], k[1], k[4]) == (e["set"], "target", e["batch"])), None)
            if key is not None:
                means = [statistics.fmean(r) for r in seconds[key]]
                saved = e["s_per_task_repeats"]
                if len(means) != len(saved) or not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(means, saved)):
                    raise ValueError(
                        f"{timings_path}: the target's repeats on {e['set']} bs {e['batch']} do not give the "
                        "noise floor's time per task: they are another run's"
                    )
                e = {**e, **timing.probe_noise_floor(probes[key])}
        entries.append(e)
    return {**nf, "by_set_batch": entries, "max_spread_probe": _largest(entries, "probe_spread")}


def noise_floor_line(nf: dict) -> str:
    if not nf or not nf.get("by_set_batch"):
        return "noise floor: not measured (a run without repeats)"

    def probed(e: dict) -> str:
        if e.get("probe_spread") is None:
            return ""
        ratio = timing.describe_ratio(e["probe_self_ratio"], e["probe_self_ratio_ci"])
        return f" (in probe units {ratio}, spread {e['probe_spread']:.1%})"

    bits = [
        f"{e['set']} bs {e['batch']}: repeat 2 / repeat 1 {timing.describe_ratio(e['self_ratio'], e['self_ratio_ci'])}, "
        f"spread {e['spread']:.1%}{probed(e)}"
        for e in nf["by_set_batch"]
        if e["spread"] is not None
    ]
    probe = nf.get("max_spread_probe")
    return (
        f"noise floor (the target alone measured twice): repeats differ by up to {nf['max_spread']:.1%}"
        + (f" ({probe:.1%} in probe units, where probed)" if probe is not None else "")
        + "; "
        + "; ".join(bits)
    )


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def markdown(summary: dict) -> str:
    rec = summary["recommendation_by_batch"]
    models = summary["models"]
    budget = summary["budget"]
    lines = [
        "# parse-vllm eval: speed against quality",
        "",
        f"Target `{models['target']}`, draft `{models['draft']}`, W = {models['window']}, "
        f"token-level k = {models['spec_k']}; greedy, max_tokens {summary['args']['max_tokens']}. "
        f"Machine: {summary['machine'].get('cores')} cores, vLLM {summary['machine'].get('vllm')}, "
        f"{summary['machine'].get('date')}; engine mode: {common.engine_mode(summary['machine'])}.",
        "",
        f"Budget: accuracy drop ≤ {budget['max_accuracy_drop']:g}, NLL increase ≤ {budget['max_nll_increase']:.0%} "
        "(the target's own negative log-likelihood of the text per output token, against the target alone's).",
        "",
        "## Recommendation",
        "",
    ]
    for b, sentence in rec.items():
        lines.append(f"- batch {b}: {sentence}")
    lines += ["", f"Speed is wall time per task on the same tasks; {noise_floor_line(summary.get('noise_floor'))}."]
    lines += ["", "## Results", ""]
    for name in summary["sets"]:
        rows = [r for r in summary["rows"] if r["set"] == name]
        n = {r["batch"]: r["n_prompts"] for r in rows}
        lines += [
            f"### {name} ({', '.join(f'{v} prompts at batch {k}' for k, v in sorted(n.items()))})",
            "",
            common.table(_table_rows(rows), _columns(rows)),
            "",
        ]
    nf = summary.get("noise_floor")
    if nf and nf.get("by_set_batch"):
        lines += [
            "## Noise floor",
            "",
            "The target alone, timed in every repeat like every other configuration: what the same "
            "computation measured twice differs by. Ratios within it are not resolved by this run.",
            "",
        ]
        for e in nf["by_set_batch"]:
            reps = ", ".join(f"{x:.3f}" for x in e["s_per_task_repeats"])
            probe = ""
            if e.get("probe_spread") is not None:
                probe = (
                    f"; in probe units (spread {_fmt(e['probe_spread'], '.1%')}): "
                    f"{timing.describe_ratio(e['probe_self_ratio'], e['probe_self_ratio_ci'])}"
                )
            lines.append(
                f"- {e['set']} bs {e['batch']}: {reps} s per task (spread {_fmt(e['spread'], '.1%')}); repeat 2 "
                f"over repeat 1: {timing.describe_ratio(e['self_ratio'], e['self_ratio_ci'])}{probe}"
            )
    else:
        lines += ["Target-alone timing, first and last engine of the run (its rows use the mean):", ""]
        for b in summary["baselines"]:
            flag = (
                f" **over {common.DRIFT_LIMIT:.0%}: the machine was not quiet, ratios suspect**"
                if b["drift_flagged"]
                else ""
            )
            lines.append(
                f"- {b['set']} bs {b['batch']}: {b['tok_s_first']:.1f} tok/s first, {b['tok_s_last']:.1f} last "
                f"(drift {b['drift']:+.1%}; same text {b['same_text']:.2f}){flag}"
            )
    h = summary.get("harness")
    if h:
        lines += [
            "",
            "## How this was timed",
            "",
            f"- Repeats: {h['repeats']}, {h['order']}.",
            f"- Every timed job from the same state: {h['state']}.",
            f"- Time per task: {h['per_task_time']}.",
            f"- Speed ratio: {h['speed_ratio']}; interval: {h['ci']}.",
            f"- Batch-1 rows on fewer than {h['min_bs1_tasks']} tasks claim nothing (too few tasks).",
            *(
                [
                    f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; every job on this boot "
                    f"of it ({m['boot']}): a saved run resumes only there."
                ]
                if "boot" in (m := summary.get("machine") or {})
                else []
            ),
            f'- A PARSE row that opened no window is labelled "{TOKEN_LEVEL_TAG}": it measured token-level '
            "speculation through the PARSE engine.",
        ]
    lines += ["", "![speed against quality](eval.png)", ""]
    j = summary.get("judge")
    if j:
        lines += [
            "## Does the judge discriminate?",
            "",
            f"{j['title']}: P(Correct) against whether the answer passes "
            "its tests (ROC AUC: the chance that a random right answer scores above a random wrong one; "
            "0.5 = no better than chance).",
            "",
        ]
        lines += ["| answers | right | wrong | mean P(Correct) right | wrong | ROC AUC |", "|---|---|---|---|---|---|"]
        for key, name in (("whole", "whole"), ("line_ends", "cut at line ends")):
            d = j.get(key)
            if d:
                lines.append(
                    f"| {name} | {d['n_pass']} | {d['n_fail']} | {_fmt(d['mean_p_yes_pass'], '.3f')} | "
                    f"{_fmt(d['mean_p_yes_fail'], '.3f')} | {_fmt(d['auc'], '.3f')} |"
                )
        d = j["whole"]
        lines += [
            "",
            "Share of answers a threshold τ passes (whole answers):",
            "",
            "| τ | " + " | ".join(d["pass_rate_by_tau"]) + " |",
            "|---" * (len(d["pass_rate_by_tau"]) + 1) + "|",
        ]
        for who in ("right", "wrong"):
            lines.append(f"| {who} | " + " | ".join(_fmt(v[who], ".2f") for v in d["pass_rate_by_tau"].values()) + " |")
        lines += ["", "![judge discrimination](judge.png)", ""]
    return "\n".join(lines)


def pareto(points: list[tuple[float, float]], x_lower_is_better: bool) -> list[int]:
    """Indices of the points no other point beats on both axes (y: higher is better)."""
    sign = -1.0 if x_lower_is_better else 1.0
    front = []
    for i, (x, y) in enumerate(points):
        xi = sign * x
        dominated = any(
            (sign * a >= xi and b >= y) and (sign * a > xi or b > y) for j, (a, b) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = summary["sets"]
    fig, grid = plt.subplots(len(sets), 2, figsize=(12, 4.2 * len(sets)), squeeze=False)
    for (ax_nll, ax_q), name in zip(grid, sets):
        rows = [r for r in summary["rows"] if r["set"] == name]
        checkable = any(r["accuracy"] is not None for r in rows)
        qkey, qlabel = ("accuracy", "accuracy") if checkable else ("rouge_l", "ROUGE-L vs target alone")
        for ax, xkey, xlabel, lower in (
            (ax_nll, "nll_vs_target", "NLL per token / target alone's (lower: better)", True),
            (ax_q, qkey, qlabel, False),
        ):
            for bi, b in enumerate(sorted({r["batch"] for r in rows})):
                rs = [r for r in rows if r["batch"] == b and r[xkey] is not None and r["speedup"] is not None]
                color = f"C{bi}"
                for r in rs:
                    token_level = r["config"].startswith("token") or (is_parse(r) and r.get("windows") == 0)
                    mk = "s" if r["config"] == "target" else "D" if token_level else "o"
                    ax.scatter(r[xkey], r["speedup"], marker=mk, color=color, s=36, zorder=3)
                    ci = r.get("speedup_ci")
                    if ci and r["config"] != "target":
                        ax.errorbar(
                            r[xkey],
                            r["speedup"],
                            yerr=[[r["speedup"] - ci[0]], [ci[1] - r["speedup"]]],
                            color=color,
                            lw=0.8,
                            alpha=0.6,
                            zorder=2,
                        )
                    ax.annotate(
                        display(r).replace("parse ", "").replace(TOKEN_LEVEL_TAG, "no window: token-level"),
                        (r[xkey], r["speedup"]),
                        fontsize=6,
                        xytext=(3, 3),
                        textcoords="offset points",
                    )
                pts = [(r[xkey], r["speedup"]) for r in rs]
                front = pareto(pts, x_lower_is_better=lower)
                if front:
                    ax.plot(
                        [pts[i][0] for i in front],
                        [pts[i][1] for i in front],
                        "-",
                        color=color,
                        alpha=0.6,
                        label=f"bs {b}: Pareto front",
                    )
                    ax.scatter(
                        [pts[i][0] for i in front],
                        [pts[i][1] for i in front],
                        s=140,
                        facecolors="none",
                        edgecolors=color,
                        zorder=2,
                    )
            ax.axhline(1.0, color="k", alpha=0.3, lw=0.8)
            if ax is ax_nll:  # the NLL budget
                ax.axvline(
                    1.0 + summary["budget"]["max_nll_increase"],
                    color="r",
                    ls="--",
                    alpha=0.5,
                    lw=0.8,
                    label="NLL budget",
                )
            ax.set(
                xlabel=xlabel,
                ylabel="speed vs target alone (time per task; 95% CI)",
                title=f"{name}: speed vs {xlabel.split(' (')[0]}",
            )
    for ax in grid.flat:
        ax.scatter([], [], marker="s", color="gray", label="target")
        ax.scatter([], [], marker="D", color="gray", label="token-level (incl. PARSE rows with no window)")
        ax.scatter([], [], marker="o", color="gray", label="parse (τ)")
    common.save_panels(fig, list(grid.flat), path)


def write(summary: dict, out: Path) -> dict[str, Path]:
    paths = {"json": out / "summary.json", "md": out / "summary.md", "png": out / "eval.png"}
    common.write_json(paths["json"], summary)
    paths["md"].write_text(markdown(summary))
    plot(summary, paths["png"])
    return paths
