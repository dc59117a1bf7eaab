#!/usr/bin/env python
"""The adaptive window policy against today's `continue`, from `parse-vllm eval` runs
(`make bench-adaptive` makes them): bench/adaptive/summary.json and summary.md.

Rows, one per (pair, config, τ, batch, split): `pair` (coder | smollm2), `config`
(target | token-k4 | continue | adaptive, and for SmolLM2 with its EAGLE-3 head: eagle3,
parse-alone), `tau` (null where none), `batch`, `tok_s`, `pass_at_1` (HumanEval, the Coder
pair; null otherwise), `split`, and `ratio`: tok/s over the best of the target alone and
token-level speculation in the same run (the goal: adaptive ≥ 0.95 of it at every τ).

    python scripts/bench_adaptive.py --coder bench/adaptive/coder-even bench/adaptive/coder-odd \
        --smollm2 bench/adaptive/smollm2-eagle3 --out bench/adaptive
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# eval row config -> this report's (the token-level arm of the Coder runs is k 4; of the
# SmolLM2 runs, the EAGLE-3 head)
CODER = {
    "target": "target",
    "token-k4": "token-k4",
    r"parse W=\d+ k4": "continue",
    r"parse W=\d+ adaptive-k4": "adaptive",
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
    """Rows of one eval run (summary.json), tok/s summed over its prompt sets' work."""
    summary = json.loads((run / "summary.json").read_text())
    table = CODER if pair == "coder" else SMOLLM2
    merged: dict[tuple, dict] = {}
    for r in summary["rows"]:
        config = _config(r["config"], table)
        if config is None or r.get("tok_s") is None:
            continue
        key = (config, r.get("tau"), r["batch"], r.get("split"))
        m = merged.setdefault(key, {"tokens": 0, "wall_s": 0.0, "passed": 0.0, "n": 0})
        m["tokens"] += r["tokens"]
        m["wall_s"] += r["wall_s"]
        if r.get("pass_at_1") is not None:
            m["passed"] += r["pass_at_1"] * r["n"]
            m["n"] += r["n"]
    out = []
    for (config, tau, batch, split), m in merged.items():
        out.append(
            {
                "pair": pair,
                "config": config,
                "tau": tau,
                "batch": batch,
                "tok_s": m["tokens"] / m["wall_s"],
                "pass_at_1": m["passed"] / m["n"] if m["n"] and pair == "coder" else None,
                "split": split,
                "n": m["n"] or None,
                "run": str(run),
            }
        )
    for r in out:  # the baseline of the same run and batch: the best of target and token-level
        same = [x["tok_s"] for x in out if x["batch"] == r["batch"] and x["config"] in ("target", "token-k4", "eagle3")]
        r["ratio"] = r["tok_s"] / max(same) if same else None
    return out


def render(rows: list[dict]) -> str:
    lines = [
        "| pair | split | batch | τ | configuration | tok/s | × best of target and token-level | pass@1 |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    order = {"target": 0, "token-k4": 1, "eagle3": 1, "parse-alone": 2, "continue": 3, "adaptive": 4}
    for r in sorted(rows, key=lambda r: (r["pair"], r["split"] or "", r["batch"], r["tau"] or -1, order[r["config"]])):
        tau = "—" if r["tau"] is None else f"{r['tau']:g}"
        p = "—" if r["pass_at_1"] is None else f"{r['pass_at_1']:.3f}"
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['pair']} | {r['split'] or '—'} | {r['batch']} | {tau} | {r['config']} | {r['tok_s']:.1f} | {ratio} | {p} |"
        )
    return "\n".join(lines) + "\n"


def goals(rows: list[dict]) -> list[str]:
    """The issue's goals, row by row: adaptive ≥ 0.95x the best of the target and
    token-level speculation (SmolLM2: ≥ the best of EAGLE-3 alone and PARSE alone), and its
    pass@1 no worse than `continue`'s at the same τ by more than one problem."""
    lines = [
        "| pair | split | batch | τ | adaptive × best baseline | goal | adaptive × continue | pass@1 adaptive − continue (problems) |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    key = lambda r: (r["pair"], r["split"], r["batch"], r["tau"])  # noqa: E731
    by = {(key(r), r["config"]): r for r in rows}
    for r in sorted(
        (r for r in rows if r["config"] == "adaptive"),
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
        lines.append(f"| {k[0]} | {k[1] or '—'} | {k[2]} | {tau} | {ratio:.2f} | ≥ {bound:g}: {met} | {vs} | {dp} |")
    return lines


def section(rows: list[dict]) -> str:
    """BENCHMARKS.md's section (tools/benchmarks/report.py appends bench/adaptive/section.md)."""
    return (
        "\n".join(
            [
                "## Adaptive windows (`make bench-adaptive`)",
                "",
                "`on_reject: adaptive` against today's `continue` (`scripts/bench_adaptive.py`, `bench/adaptive/`): each "
                "row is one `parse-vllm eval` run's, beside the target alone and token-level speculation measured in the "
                "same run (the Coder pair: W 128, k 4 by the draft as the token-level arm, two-stage judging, greedy, "
                "384 tokens; the even rows judge zero-shot, the odd rows with the shipped judge head; SmolLM2: W 48, its EAGLE-3 head k 3, τ 0.9, 8 MT-Bench + 8 checkable prompts, batch 1). "
                "Ratios are to the best of the target alone and token-level speculation of the same run and batch.",
                "",
                render(rows).rstrip("\n"),
                "",
                *goals(rows),
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({"rows": rows}, indent=1))
    (args.out / "summary.md").write_text(render(rows))
    (args.out / "section.md").write_text(section(rows))
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
