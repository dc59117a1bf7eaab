"""Scores, the recommendation, and the report files of `parse-vllm eval` (no vLLM here).

A row is one (prompt set, config, τ, guard, batch) run. :func:`score` adds, against the
target-alone row of the same prompt set and batch: ``speedup`` (tokens/s over the target's),
``accuracy`` (share of checkable items answered right; null where none is checkable),
``accuracy_drop`` (target's − this), ``nll_vs_target`` (this row's NLL per token over the
target's), ``rouge_l`` (against the target's text), ``repeat_3gram``.

:func:`recommend`: per batch size, the fastest non-target setting (config, τ, guard) whose
loss stays within the budget on every prompt set -- accuracy drop ≤ ``max_accuracy_drop``
where answers are checked, ``nll_vs_target`` ≤ 1 + ``max_nll_increase`` -- and that is faster
than the target (geometric mean of its speed-ups over the prompt sets > 1). The reported
recommendation is batch 1's (the smallest batch run when batch 1 was not).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from parse_vllm.tools.benchmarks import common

from . import metrics

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
    "tokens",
    "wall_s",
    "tok_s",
    "speedup",
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
)


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


def score(rows: list[dict]) -> None:
    """Fill in every row's figures against its target-alone row (in place). Rows carry
    ``outputs`` (token ids), ``correct`` (per item: True/False, None where not checkable),
    ``nll_logprobs`` (per output: the target's log-probabilities of its tokens) and ``tok_s``."""
    for r in rows:
        ref = _target(rows, r["set"], r["batch"])
        r["speedup"] = r["tok_s"] / ref["tok_s"] if ref["tok_s"] else None
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
                "within_budget": all(_within(per_set[s], max_accuracy_drop, max_nll_increase) for s in sets),
                "per_set": {
                    s: {k: per_set[s][k] for k in ("speedup", "accuracy", "accuracy_drop", "nll_vs_target", "rouge_l")}
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
        cands = [
            c
            for c in candidates(rows, b, max_accuracy_drop, max_nll_increase)
            if c["within_budget"] and c["speedup"] > 1.0
        ]
        best = cands[0] if cands else None
        by_batch[str(b)] = best
        sentences[str(b)] = describe(best, max_accuracy_drop, max_nll_increase) if best else NO_SETTING
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


def describe(entry: dict, max_accuracy_drop: float, max_nll_increase: float) -> str:
    parts = []
    for name, f in entry["per_set"].items():
        bit = (
            f"{name}: {f['speedup']:.2f}x, NLL ×{f['nll_vs_target']:.3f}"
            if f["nll_vs_target"] is not None
            else f"{name}: {f['speedup']:.2f}x"
        )
        if f["accuracy_drop"] is not None:
            bit += f", accuracy {f['accuracy']:.2f} ({-f['accuracy_drop']:+.2f})"
        parts.append(bit)
    return (
        f"{label(entry)} at batch {entry['batch']}: {entry['speedup']:.2f}x the target alone "
        f"(geometric mean over the prompt sets; {'; '.join(parts)}), the fastest setting whose accuracy "
        f"drop stays within {max_accuracy_drop:g} and NLL increase within {max_nll_increase:.0%}"
    )


# -- files ---------------------------------------------------------------------------------

COLS = [
    ("set", "prompts", ""),
    ("config", "config", ""),
    ("tau", "τ", ""),
    ("guard", "guard", ""),
    ("batch", "bs", ""),
    ("tok_s", "tok/s", ".1f"),
    ("speedup", "speedup", ".2f"),
    ("accuracy", "accuracy", ".2f"),
    ("nll_per_token", "NLL/token", ".3f"),
    ("nll_vs_target", "NLL ratio", ".3f"),
    ("repeat_3gram", "rep. 3-grams", ".3f"),
    ("rouge_l", "ROUGE-L", ".3f"),
    ("exact", "same text", ".2f"),
    ("sem_accepted", "accepted semantic", ""),
    ("tok_accepted", "accepted token-level", ""),
    ("acceptance_rate", "draft tokens accepted", ".2f"),
]


def _table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        acc = r.get("acceptance") or {}
        out.append(
            dict(
                r,
                sem_accepted=acc.get("tokens_accepted_semantic"),
                tok_accepted=acc.get("tokens_accepted_token_level"),
                acceptance_rate=acc.get("acceptance_rate"),
            )
        )
    return out


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
    lines += ["", "## Results", ""]
    for name in summary["sets"]:
        rows = [r for r in summary["rows"] if r["set"] == name]
        n = {r["batch"]: r["n_prompts"] for r in rows}
        lines += [
            f"### {name} ({', '.join(f'{v} prompts at batch {k}' for k, v in sorted(n.items()))})",
            "",
            common.table(_table_rows(rows), ([("run", "run", "")] if any("run" in r for r in rows) else []) + COLS[1:]),
            "",
        ]
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
                    mk = "s" if r["config"] == "target" else "D" if r["config"].startswith("token") else "o"
                    ax.scatter(r[xkey], r["speedup"], marker=mk, color=color, s=36, zorder=3)
                    ax.annotate(
                        label(r).replace("parse ", ""),
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
            ax.set(xlabel=xlabel, ylabel="speedup over target alone", title=f"{name}: speed vs {xlabel.split(' (')[0]}")
    for ax in grid.flat:
        ax.scatter([], [], marker="s", color="gray", label="target")
        ax.scatter([], [], marker="D", color="gray", label="token-level")
        ax.scatter([], [], marker="o", color="gray", label="parse (τ)")
    common.save_panels(fig, list(grid.flat), path)


def write(summary: dict, out: Path) -> dict[str, Path]:
    paths = {"json": out / "summary.json", "md": out / "summary.md", "png": out / "eval.png"}
    common.write_json(paths["json"], summary)
    paths["md"].write_text(markdown(summary))
    plot(summary, paths["png"])
    return paths
