#!/usr/bin/env python
"""The judge head end to end: a `parse-vllm eval` run on HumanEval's odd ids with the head
(`make bench-adaptive` writes bench/judge-coder/e2e-odd/) -> the issue's keys in
bench/judge-coder/summary.json (odd_pass_at_1_target, odd_pass_at_1_head,
odd_semantic_share_head, odd_speed_head_over_accept_all_bs1, e2e_tau: the τ the head ran at) and the rows in
`e2e_odd`.

    python scripts/judge_e2e.py bench/judge-coder/e2e-odd --summary bench/judge-coder/summary.json

The head's configuration is PARSE `continue` with k 4 after a rejection (eval config
"parse W=… k4") at the head's τ_head (the run's `tau_head`, recorded when it was given `--taus
head`; or --tau); accept-all is the same configuration at τ 0.

Speed figures come from wall time per task on the same tasks (parse_vllm/tools/eval/timing.py):
``odd_speed_head_over_accept_all_bs1`` is accept-all's mean time per task over the head's (> 1:
the head is faster) pooled over the repeats, with ``*_by_repeat`` (each repeat's), ``*_ci`` (95%
interval, resampling repeats and tasks) and ``*_verdict`` (faster or slower where the interval
excludes 1.0 and every repeat agrees, else no difference; too few tasks at batch 1 under 12); the
same at batch 8 and against the target alone where the run has those rows. Every ``e2e_odd``
row carries its time per task, tok/s with intervals, its windows and its ``label`` (a PARSE row
that opened no window: "no window opened: token-level"). A run made before per-task timing
gives tok/s ratios without intervals.

Issue 37's keys: ``odd_time_per_task_head_over_best_bs1`` (+ ``_ci``), the head's time per
task at batch 1 over the faster of the target alone and token-level k 4 (goal ≤ 0.9);
``odd_semantic_share_head_where_draft_passes``, the head's semantic share at batch 8 over the
tasks whose draft-alone answer passes (needs the run's ``--draft-alone`` row and per-task
counters); with ``--mbpp RUN`` (MBPP test, batch 8), ``mbpp_test_e2e_n``,
``mbpp_test_pass_at_1_target`` / ``_head`` / ``_accept_all``, the head's time per task against the
target's and accept-all's (``mbpp_test_speed_*``, with intervals) and the rows in ``e2e_mbpp_test``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from parse_vllm.tools.eval import report as eval_report
from parse_vllm.tools.eval import run as eval_run
from parse_vllm.tools.eval import timing


def _speed(ref: dict, row: dict) -> dict:
    """ref's time per task over row's (> 1: row faster) pooled over the repeats, each repeat's,
    the interval over repeats and tasks and the verdict (timing.speed_figures); tok/s for a run
    without per-task times."""
    if ref.get("task_s") is None or row.get("task_s") is None:
        return {"ratio": row["tok_s"] / ref["tok_s"], "ci": None, "by_repeat": None, "verdict": None}
    few = row["batch"] == 1 and len(row["task_s"]) < timing.MIN_BS1_TASKS
    return timing.speed_figures(timing.row_repeats(ref), timing.row_repeats(row), few)


def _figure(out: dict, key: str, ref: dict | None, row: dict | None) -> None:
    """``key`` (ref's time per task over row's), ``key_ci``, ``key_by_repeat``, ``key_verdict``."""
    if ref is None or row is None:
        return
    f = _speed(ref, row)
    out[key], out[f"{key}_ci"], out[f"{key}_by_repeat"], out[f"{key}_verdict"] = (
        f["ratio"], f["ci"], f["by_repeat"], f["verdict"]
    )  # fmt: skip


def figures(summary: dict, tau: float) -> dict:
    rows = summary["rows"]

    def find(config_re: str, batch: int, t=None) -> list[dict]:
        return [r for r in rows if re.fullmatch(config_re, r["config"]) and r["batch"] == batch and r.get("tau") == t]

    def one(config_re: str, batch: int, t=None) -> dict:
        got = find(config_re, batch, t)
        if len(got) != 1:
            raise SystemExit(f"judge_e2e: expected one row {config_re!r} bs {batch} τ {t}, found {len(got)}")
        return got[0]

    def maybe(config_re: str, batch: int, t=None) -> dict | None:
        got = find(config_re, batch, t)
        return got[0] if len(got) == 1 else None

    head8, head1 = one(r"parse W=\d+ k4", 8, tau), one(r"parse W=\d+ k4", 1, tau)
    all1 = one(r"parse W=\d+ k4", 1, 0.0)
    target8 = one("target", 8)
    out = {
        "e2e_tau": tau,
        "odd_pass_at_1_target": target8["pass_at_1"],
        "odd_pass_at_1_head": head8["pass_at_1"],
        "odd_e2e_n": head8["n"],
        "odd_semantic_share_head": _semantic_share(head8),
        "odd_semantic_share_head_bs1": _semantic_share(head1),
    }
    _figure(out, "odd_speed_head_over_accept_all_bs1", all1, head1)
    _figure(out, "odd_speed_head_over_accept_all_bs8", maybe(r"parse W=\d+ k4", 8, 0.0), head8)
    _figure(out, "odd_speed_head_over_target_bs1", maybe("target", 1), head1)
    _figure(out, "odd_speed_head_over_target_bs8", target8, head8)
    adaptive8 = maybe(r"parse W=\d+ adaptive-k4", 8, tau)
    _figure(out, "odd_speed_head_adaptive_over_target_bs8", target8, adaptive8)
    best1 = _fastest([maybe("target", 1), maybe("token-k4", 1)])
    if best1 is not None and best1.get("task_s") and head1.get("task_s"):
        # the goal: ≤ 0.9 (the head's time per task over the faster baseline's)
        f = timing.speed_figures(timing.row_repeats(head1), timing.row_repeats(best1))
        out["odd_time_per_task_head_over_best_bs1"] = f["ratio"]
        out["odd_time_per_task_head_over_best_bs1_ci"] = f["ci"]
        out["odd_time_per_task_head_over_best_bs1_by_repeat"] = f["by_repeat"]
        out["odd_time_per_task_head_best_baseline_bs1"] = best1["config"]
    # the draft alone at the head row's batch: the task lists differ between batches (12 vs all)
    share = where_draft_passes(head8, maybe("draft", head8["batch"]))
    if share is not None:
        out["odd_semantic_share_head_where_draft_passes"], out["odd_tasks_where_draft_passes"] = share
    out["e2e_odd"] = [_e2e_row(r) for r in rows]
    _noise_floor(out, "odd_e2e_noise_floor", summary)
    return out


def _semantic_share(row: dict) -> float:
    """The row's share of output tokens taken semantically (accepted whole by the judge)."""
    return row["acceptance"]["tokens_accepted_semantic"] / row["tokens"]


def _noise_floor(out: dict, key: str, summary: dict) -> None:
    """The run's noise floor (the target alone timed in each repeat) under ``key``, where it has one."""
    noise = summary.get("noise_floor")
    if noise and noise.get("by_set_batch"):
        out[key] = noise


def _fastest(rows: list[dict | None]) -> dict | None:
    timed = [r for r in rows if r is not None and r.get("s_per_task") is not None]
    return min(timed, key=lambda r: r["s_per_task"]) if timed else None


def where_draft_passes(head: dict, draft: dict | None) -> tuple[float, int] | None:
    """The head row's share of output tokens taken semantically over the tasks whose draft-alone
    answer passes its tests (accepting is right there), and how many tasks those are; None
    without per-task counters or a draft row."""
    if draft is None or not draft.get("correct") or not head.get("task_acceptance") or not head.get("task_tokens"):
        return None
    passes = {i for i, ok in zip(draft["item_ids"], draft["correct"]) if ok}
    picked = [k for k, i in enumerate(head["item_ids"]) if i in passes and head["task_acceptance"][k] is not None]
    tokens = sum(head["task_tokens"][k] for k in picked)
    if not tokens:
        return None
    return sum(head["task_acceptance"][k]["semantic"] for k in picked) / tokens, len(picked)


def mbpp_figures(summary: dict, tau: float) -> dict:
    """MBPP test end to end (`--mbpp RUN`, batch 8): tasks, pass@1 of the target, of the head and
    of accept-all (τ 0, where the run has it), the head's semantic share, its time per task
    against the target's and accept-all's (with intervals), the rows and the noise floor."""
    rows = [r for r in summary["rows"] if r["batch"] == 8]
    target = next(r for r in rows if r["config"] == "target")
    parse = {r.get("tau"): r for r in rows if re.fullmatch(r"parse W=\d+ k4", r["config"])}
    head, accept_all = parse[tau], parse.get(0.0)
    out = {
        "mbpp_test_e2e_n": head["n"],
        "mbpp_test_pass_at_1_target": target["pass_at_1"],
        "mbpp_test_pass_at_1_head": head["pass_at_1"],
        "mbpp_test_semantic_share_head": _semantic_share(head),
    }
    _figure(out, "mbpp_test_speed_head_over_target_bs8", target, head)
    if accept_all is not None:
        out["mbpp_test_pass_at_1_accept_all"] = accept_all["pass_at_1"]
        out["mbpp_test_semantic_share_accept_all"] = _semantic_share(accept_all)
        _figure(out, "mbpp_test_speed_accept_all_over_target_bs8", target, accept_all)
        _figure(out, "mbpp_test_speed_head_over_accept_all_bs8", accept_all, head)
    out["e2e_mbpp_test"] = [_e2e_row(r) for r in summary["rows"]]
    _noise_floor(out, "mbpp_test_e2e_noise_floor", summary)
    return out


def _e2e_row(r: dict) -> dict:
    out = {k: r.get(k) for k in ("config", "tau", "batch", "n", "tok_s", "pass_at_1", "tokens")}
    out["semantic_tokens"] = (r.get("acceptance") or {}).get("tokens_accepted_semantic")
    out["windows"] = r.get("windows") if "windows" in r else eval_report.windows_opened(r)
    out["label"] = eval_report.display(dict(r, windows=out["windows"]))
    for k in (
        "tok_s_ci", "s_per_task", "s_per_task_ci", "s_per_task_spread", "repeats", "speedup", "speedup_ci",
        "speedup_by_repeat",
    ):  # fmt: skip
        if r.get(k) is not None:
            out[k] = r[k]
    if r.get("speedup_verdict") is not None:
        out["speedup_verdict"] = r["speedup_verdict"]
    return out


def load_run(folder: Path) -> dict:
    """An eval run's summary.json, its speed figures recomputed from its timings.jsonl (each
    repeat's ratio, intervals over repeats and tasks: eval.run.load_repeats)."""
    return eval_run.load_repeats(json.loads((folder / "summary.json").read_text()), folder)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the eval run's folder (summary.json)")
    ap.add_argument("--tau", type=float, help="the head's τ (default: the run's τ_head, from `eval --taus head`)")
    ap.add_argument("--summary", type=Path, default=Path("bench/judge-coder/summary.json"))
    ap.add_argument("--mbpp", type=Path, help="the eval run on MBPP's test split (summary.json), run likewise")
    args = ap.parse_args(argv)
    if not (args.run / "summary.json").is_file() or not args.summary.is_file():
        print(f"judge_e2e: {args.run / 'summary.json'} or {args.summary} is missing", file=sys.stderr)
        return 2
    summary = json.loads(args.summary.read_text())
    run = load_run(args.run)
    mbpp = None if args.mbpp is None else load_run(args.mbpp)
    recorded = {
        str(d): t for d, s in ((args.run, run), (args.mbpp, mbpp)) if s and (t := (s.get("tau_head") or {}).get("tau")) is not None
    }  # fmt: skip
    taus = set(recorded.values()) | ({args.tau} if args.tau is not None else set())
    if len(taus) != 1:
        why = "records no τ_head (run it with --taus head): give --tau" if not taus else (
            f"the head ran at different τ: {recorded}{'' if args.tau is None else f', --tau {args.tau}'}")  # fmt: skip
        print(f"judge_e2e: {args.run}: {why}", file=sys.stderr)
        return 2
    tau = taus.pop()
    summary.update(figures(run, tau))
    if mbpp is not None:
        summary.update(mbpp_figures(mbpp, tau))
    args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k.startswith(("odd_", "mbpp_test_", "e2e_tau"))}, indent=1))
    for r in summary["e2e_odd"] + (summary["e2e_mbpp_test"] if mbpp is not None else []):
        speed = "—"
        if r["config"] != "target":
            speed = timing.describe_ratio(r.get("speedup"), r.get("speedup_ci"), by_repeat=r.get("speedup_by_repeat"))
        s_task = "—" if r.get("s_per_task") is None else f"{r['s_per_task']:.2f} s/task"
        print(f"  bs {r['batch']:<2d} {r['label']:50s} τ {r['tau']!s:5s} {s_task:>14s}  vs target {speed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
