"""Regenerate BENCHMARKS.md from a full benchmark run (``scripts/bench_report.py``).

Reads ``<results>/{verify,e2e}.json`` and ``summary.json`` written by the two benchmarks,
copies them and their plots to ``bench/full/`` (committed), and writes BENCHMARKS.md, with
the latency section from ``bench/latency/`` (``scripts/bench_latency.py --compare``):
every figure in it comes from those files -- nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from . import common, e2e, projection, verify


def _dtype(e: dict) -> str:
    return {"bfloat16": "bf16", "float32": "float32"}.get(e.get("dtype", "bfloat16"), e.get("dtype"))


def _ge(bound):
    return lambda x: x >= bound


def _le(bound):
    return lambda x: x <= bound


def _fmt(v, f=".3f"):
    return "—" if v is None else format(v, f)


def _goal(ok: bool | None) -> str:
    return "not measured" if ok is None else ("**met**" if ok else "**not met**")


def _faithful(rows: list[dict], batch: int) -> str:
    bar = next((r["rouge_l"] for r in rows if r["config"] == "token-k4" and r["batch"] == batch), None)
    if bar is None:
        return f"- bs {batch}: no token-level run"
    ok = [r for r in rows if r["batch"] == batch and r["config"].startswith("parse") and r["rouge_l"] >= bar - 0.05]
    if not ok:
        return f"- bs {batch}: none (token-k4 ROUGE-L {bar:.3f})"
    r = max(ok, key=lambda r: r["speedup"])
    return (
        f"- bs {batch}: `{r['config']}` τ = {r['tau']}: {r['speedup']:.2f}× the target alone, "
        f"ROUGE-L {r['rouge_l']:.3f} (token-k4: {bar:.3f})"
    )


def _all_questions(acc: dict | None) -> list[str]:
    """The draft's own figure on all 80 questions, if its trainer measured it (training.json)."""
    if not acc:
        return []
    return [
        "",
        f"On all {acc['prompts']} questions (`parse-vllm train-draft --eval-acceptance`, k = {acc['k']}, "
        f"max_tokens {acc['max_tokens']}, batch 16): acceptance rate {_fmt(acc['acceptance_rate'])}, mean "
        f"acceptance length {_fmt(acc['mean_acceptance_length'], '.2f')}.",
    ]


def _baselines(bases: list[dict] | None) -> list[str]:
    """The target-alone baseline timed first and last in the run (older runs timed it once)."""
    if not bases:
        return ["The target-alone baseline was timed once, first in the run (no drift check)."]
    parts = [
        f"bs {b['batch']}: {b['tok_s_first']:.1f} tok/s first, {b['tok_s_again']:.1f} last (drift {b['drift']:+.1%})"
        for b in bases
    ]
    out = [
        "Target-alone baseline, timed first and again last in the run (speedups are against the mean of "
        "the two): " + "; ".join(parts) + "."
    ]
    bad = [str(b["batch"]) for b in bases if b["drift_flagged"]]
    if bad:
        out += [
            "",
            f"**Warning: the baseline drifted by more than {common.DRIFT_LIMIT:.0%} at batch size "
            f"{', '.join(bad)}: the machine was not quiet during this run, and its ratios are suspect.**",
        ]
    return out


def _drift_warning(bases: list[dict] | None) -> list[str]:
    bad = [b for b in bases or [] if b["drift_flagged"]]
    if not bad:
        return []
    drift = ", ".join(f"{b['drift']:+.0%} at bs {b['batch']}" for b in bad)
    return [
        "",
        f"**The end-to-end run's target-alone baseline drifted ({drift}; section 2): the bracket and "
        f"speedup figures from it are suspect.**",
    ]


def render(
    results: Path,
    figures: str,
    latency: Path | None = None,
    eagle3: Path | None = None,
    gpu_costs: Path | None = None,
    counters: tuple[Path, ...] = projection.DEFAULT_COUNTERS,
    sections: tuple[Path, ...] = (),
) -> str:
    """BENCHMARKS.md: the full runs in `results`, then the latency section from
    `latency` (bench_latency.py --compare), the EAGLE-3 section from `eagle3`
    (`make bench-eagle3`) when given and present, the Markdown `sections` that other
    benchmarks wrote (each file as it is, those present), and the projection of the eval
    summaries `counters` on the GPU of `gpu_costs` (scripts/gpu_costs.py) when given."""
    text = _render_full(results, figures)
    section = latency_section(latency) if latency is not None else []
    section += eagle3_section(eagle3) if eagle3 is not None else []
    for path in sections:
        if path.is_file():
            section += ([""] if section else []) + path.read_text().rstrip("\n").splitlines()
    section += gpu_projection_section(gpu_costs, counters) if gpu_costs is not None else []
    return "\n".join([text.rstrip("\n"), "", *section]).rstrip("\n") + "\n" if section else text


#: sections of BENCHMARKS.md that other benchmarks write (scripts/bench_adaptive.py, the
#: runner's before/after latency run)
SECTIONS = (Path("bench/latency-restructure/section.md"), Path("bench/adaptive/section.md"))


def committed(root: Path) -> str:
    """BENCHMARKS.md as the committed results under `root` render it (bench/full, the latency and
    EAGLE-3 runs, every section present): what a benchmark that rewrote one section writes back."""
    return render(
        root / "bench" / "full",
        "bench/full",
        root / "bench" / "latency",
        root / "bench" / "eagle3",
        sections=tuple(root / p for p in SECTIONS),
    )


def gpu_projection_section(gpu_costs: Path, counters) -> list[str]:
    """The projection of the eval summaries' counters (each row at its batch) on the GPU that measured `gpu_costs`."""
    costs = json.loads(gpu_costs.read_text())
    proj = projection.projection(costs, projection.load_summaries(counters))
    return projection.section(proj, costs, gpu_costs.name)


# -- PARSE with EAGLE-3 (bench/eagle3/: a `parse-vllm eval` run at batch 1) --


def _bs1(rows: list[dict], config: str, tau=None) -> list[dict]:
    return [r for r in rows if r["config"] == config and r["batch"] == 1 and (tau is None or r["tau"] == tau)]


def _tok_s(rows: list[dict]) -> float | None:
    """Tokens per second over every set of the rows (total tokens / total time)."""
    wall = sum(r["wall_s"] for r in rows)
    return sum(r["tokens"] for r in rows) / wall if rows and wall else None


def eagle3_figures(summary: dict) -> dict:
    """The EAGLE-3 keys of bench/full/summary.json from the eval run's summary: speed-ups
    over the target alone at batch 1 (every prompt set together): EAGLE-3 alone, and at
    each τ ≤ 1 PARSE alone (its fastest variant without EAGLE-3) and with EAGLE-3; the
    top-level keys at the largest such τ; lossless PARSE + EAGLE-3 (τ > 1) over EAGLE-3
    alone."""
    rows = summary["rows"]
    target = _tok_s(_bs1(rows, "target"))
    eagle = next(r["config"] for r in rows if r["config"].startswith("eagle3-k"))
    with_e3 = sorted({r["config"] for r in rows if r["config"].endswith(" e3")})
    alone = sorted({r["config"] for r in rows if r["config"].startswith("parse") and r["config"] not in with_e3})
    taus = sorted({r["tau"] for r in rows if r["config"] in with_e3})
    lossless = min(t for t in taus if t > 1)

    def ratio(config, t=None):
        x = _tok_s(_bs1(rows, config, t))
        return x / target if x and target else None

    by_tau = {
        str(t): {
            "parse_eagle3_speedup_bs1": ratio(with_e3[0], t),
            "parse_speedup_bs1": max(ratio(c, t) for c in alone),
            "parse_speedup_bs1_config": max(alone, key=lambda c: ratio(c, t)),
        }
        for t in taus
        if t <= 1
    }
    tau = max(t for t in taus if t <= 1)
    return {
        "eagle3_speedup_bs1": ratio(eagle),
        **by_tau[str(tau)],
        "parse_eagle3_tau": tau,
        "parse_eagle3_by_tau": by_tau,
        "parse_eagle3_lossless_over_eagle3_bs1": ratio(with_e3[0], lossless) / ratio(eagle),
        # vLLM's own counters on the EAGLE-3-alone row, MT-Bench: 1 + accepted / drafts
        "eagle3_acceptance_length": next(
            (r["acceptance"] or {}).get("mean_acceptance_length") for r in _bs1(rows, eagle) if r["set"] == "mtbench"
        ),
        "eagle3_k": int(eagle[len("eagle3-k") :]),
    }


def eagle3_section(path: Path) -> list[str]:
    """BENCHMARKS.md's EAGLE-3 section: the eval rows at batch 1, the acceptance of
    vLLM's EAGLE-3 with the head on MT-Bench, and the issue's goals; empty without a run."""
    if not (path / "summary.json").is_file():
        return []
    summary = json.loads((path / "summary.json").read_text())
    f = eagle3_figures(summary)
    rows = [r for r in summary["rows"] if r["batch"] == 1]
    target = {r["set"]: r["tok_s"] for r in rows if r["config"] == "target"}
    out = [
        "## PARSE with EAGLE-3 (`make bench-eagle3`)",
        "",
        f"SmolLM2-135M-Instruct with its draft (windows) and its EAGLE-3 head "
        f"(`parse_vllm/drafts/smollm2-135m-instruct-eagle3/`), batch 1, greedy, "
        f"max_tokens {summary['args']['max_tokens']}, one `parse-vllm eval` run (`bench/eagle3/`): every row "
        "beside its quality. `eagle3-kK` is vLLM's own EAGLE-3 alone; `parse … e3` is PARSE whose "
        "token-level drafts come from the head (`token_proposer`), `parse … kN` from the draft model, "
        "`parse W=…` alone (the target after a rejection).",
        "",
        "| set | row | τ | tok/s | × target | accuracy | exact (= target's text) | ROUGE-L |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["set"], r["config"] != "target", r["config"], r["tau"] or 0)):
        acc_s = "—" if r.get("accuracy") is None else f"{r['accuracy']:.3f}"
        out.append(
            f"| {r['set']} | {r['config']} | {'—' if r['tau'] is None else r['tau']} | {r['tok_s']:.1f} | "
            f"{r['tok_s'] / target[r['set']]:.2f} | {acc_s} | {r['exact']:.2f} | {r['rouge_l']:.3f} |"
        )
    out += [
        "",
        f"Over both sets (tokens / time): EAGLE-3 alone **{f['eagle3_speedup_bs1']:.2f}x** the target; "
        f"lossless PARSE + EAGLE-3 (τ > 1) **{f['parse_eagle3_lossless_over_eagle3_bs1']:.2f}x** EAGLE-3 alone; "
        "PARSE at each τ:",
        "",
        "| τ | PARSE alone (fastest variant) | PARSE + EAGLE-3 | EAGLE-3 alone |",
        "|---:|---:|---:|---:|",
    ]
    for t, g in f["parse_eagle3_by_tau"].items():
        out.append(
            f"| {t} | {g['parse_speedup_bs1']:.2f} (`{g['parse_speedup_bs1_config']}`) | "
            f"{g['parse_eagle3_speedup_bs1']:.2f} | {f['eagle3_speedup_bs1']:.2f} |"
        )
    out += [
        "",
        f"vLLM's EAGLE-3 with the head alone, k = {f['eagle3_k']}, on the MT-Bench rows: mean acceptance length "
        f"**{f['eagle3_acceptance_length']:.2f}** (1 + accepted / drafts, vLLM's spec-decode counters).",
    ]
    goals = [
        (
            f"PARSE + EAGLE-3 ≥ max(PARSE alone, EAGLE-3 alone) at τ {t}",
            g["parse_eagle3_speedup_bs1"] >= max(f["eagle3_speedup_bs1"], g["parse_speedup_bs1"]),
            f"{g['parse_eagle3_speedup_bs1']:.2f} against {max(f['eagle3_speedup_bs1'], g['parse_speedup_bs1']):.2f}",
        )
        for t, g in f["parse_eagle3_by_tau"].items()
    ] + [
        (
            "lossless PARSE + EAGLE-3 ≥ 0.95x EAGLE-3 alone",
            f["parse_eagle3_lossless_over_eagle3_bs1"] >= 0.95,
            f"{f['parse_eagle3_lossless_over_eagle3_bs1']:.2f}",
        ),
    ]
    out += ["", "| goal | met | measured |", "|---|---|---|"]
    out += [f"| {g} | {'yes' if ok else '**no**'} | {m} |" for g, ok, m in goals]
    return out


def _render_full(results: Path, figures: str) -> str:
    v = json.loads((results / "verify.json").read_text())
    e = json.loads((results / "e2e.json").read_text())
    s = json.loads((results / "summary.json").read_text())
    m = e["machine"]
    out = [
        "# PARSE benchmarks (CPU)",
        "",
        "Generated by `make bench-full` (`scripts/bench_verify.py`, `scripts/bench_e2e.py`, then "
        "`scripts/bench_report.py`) — do not edit by hand. Raw results: `bench/full/*.json`.",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']}, vLLM {m['vllm']}; bench_e2e run {m['date']}, "
        f"bench_verify run {v['machine']['date']}. "
        f"Target `{Path(e['target']).name}`, draft `{Path(e['draft']).name}` ({_dtype(e)}, eager), "
        f"window W = {e['window']}, max_tokens {e['max_tokens']}. "
        f"Engine mode: {common.engine_mode(m)}; compare figures within one mode only. "
        "This machine is shared and noisy: only ratios measured side by side in one run are reported.",
        "",
        "## Goals",
        "",
        "| goal | measured | |",
        "|---|---:|---|",
    ]
    vb, tb = s.get("verify_over_floor_N256_K8"), s.get("verify_token_bound_N256_K8")
    seq = s.get("sequential_over_parallel_N256_K8")
    rate = s.get("draft_token_acceptance_rate")
    length = s.get("draft_mean_acceptance_length")
    measured = f"{_fmt(rate, '.3f')} (mean length {_fmt(length, '.2f')})"
    every = e.get("draft_acceptance_mtbench")  # the trainer's figure on all 80 questions, if measured
    if every:
        # The goal is defined on the 80 evaluation questions; this run's own
        # figure comes from its 8 + 32 and is shown beside it.
        measured = (
            f"{_fmt(every['acceptance_rate'], '.3f')} on all {every['prompts']} questions (mean length "
            f"{_fmt(every['mean_acceptance_length'], '.2f')}); {measured} on this run's "
            f"{sum(len(q) for q in e['prompts'].values())}"
        )
        rate = every["acceptance_rate"]
    out += [
        f"| verification (b)/(a) within 10% of (N+K·S)/N, N=256 K=8 | {_fmt(vb)} vs bound {_fmt(tb)} | "
        f"{_goal(None if vb is None else vb <= 1.1 * tb)} |",
        f"| sequential/parallel (c)/(b) ≥ K/2 = 4 at N=256 K=8 | {_fmt(seq, '.2f')} | "
        f"{_goal(None if seq is None else seq >= 4)} |",
        *[
            f"| {label} | {_fmt(s.get(key), '.2f')} | {_goal(None if s.get(key) is None else ok(s[key]))} |"
            for label, key, ok in (
                ("τ=0 (accept all) ≥ 90% of the draft-bound ideal, bs 1", "accept_all_fraction_of_ideal_bs1", _ge(0.9)),
                ("τ=0 ≥ 90% of the ideal, bs 16", "accept_all_fraction_of_ideal_bs16", _ge(0.9)),
                ("τ=0 ≥ 90% of the ideal, bs 64", "accept_all_fraction_of_ideal_bs64", _ge(0.9)),
                (
                    "reject-all (τ=1, judged) overhead ≤ 1.10× its ideal, bs 1",
                    "reject_all_over_ideal_overhead_bs1",
                    _le(1.1),
                ),
                ("reject-all overhead ≤ 1.10× its ideal, bs 16", "reject_all_over_ideal_overhead_bs16", _le(1.1)),
                ("τ>1 (never drafts) ≥ 0.90× the target alone, bs 16", "reject_all_speedup_bs16", _ge(0.9)),
                ("PARSE off per request ≥ 0.95× the target alone, bs 16", "parse_off_speedup_bs16", _ge(0.95)),
            )
        ],
        f"| draft token-level acceptance (vLLM draft_model, k=4) ≥ 30% | {measured} | "
        f"{_goal(None if rate is None else rate >= 0.3)} |",
        *_drift_warning(e.get("baselines")),
        "",
        "## 1. Verification pass inside vLLM (`bench_verify.py`)",
        "",
        verify.__doc__.split("\n\n", 1)[1].strip(),
        "",
        f"Medians of {v['reps']} repetitions ({v['mode']} mode).",
        "",
        common.table(v["rows"], verify.COLS),
        "",
        "Logits materialized by the verification pass (the K label rows only, never N×vocab):",
        "",
        common.table(
            v["memory"],
            [
                ("N", "N", ""),
                ("copies_in_pass", "copies", ""),
                ("verify_logit_rows_max", "logit rows", ""),
                ("verify_logits_bytes", "logits bytes", ","),
                ("all_rows_logits_bytes", "(N+K·S)×vocab bytes", ","),
            ],
        ),
        "",
        f"![verification]({figures}/verify.png)",
        "",
        "## 2. End to end on MT-Bench (`bench_e2e.py`)",
        "",
        e2e.__doc__.split("\n\n", 1)[1].strip(),
        "",
        f"W = {e['window']}, max_tokens = {e['max_tokens']}; questions at batch 1: {e['prompts']['1']}; "
        f"at batch 16: {len(e['prompts']['16'])} questions.",
        "",
        common.table(e["rows"], e2e.COLS),
        "",
        *_baselines(e.get("baselines")),
        "",
        f"![e2e]({figures}/e2e.png)",
        "",
        f"Greedy decoding in {_dtype(e)} is not batch-invariant: vLLM's own (lossless) token-level speculation "
        "already departs from the target-alone text (the `token-k4` rows), so its ROUGE-L is the bar for "
        '"no visible loss" here. Fastest PARSE run at that bar (ROUGE-L ≥ token-k4\'s − 0.05), per batch size:',
        "",
        *[_faithful(e["rows"], b) for b in (1, 16)],
        "",
        "### Brackets",
        "",
        common.table(
            e["brackets"],
            [
                ("batch", "bs", ""),
                ("accept_all_speedup", "τ=0 speedup", ".2f"),
                ("accept_all_ideal_speedup", "ideal", ".2f"),
                ("accept_all_fraction_of_ideal", "fraction", ".2f"),
                ("reject_all_tau", "reject-all τ", ""),
                ("reject_all_overhead_s", "overhead s", ".2f"),
                ("reject_all_ideal_overhead_s", "ideal s", ".2f"),
                ("reject_all_over_ideal_overhead", "ratio", ".2f"),
                ("reject_all_speedup", "τ>1 speedup", ".2f"),
                ("parse_off_speedup", "PARSE-off speedup", ".2f"),
            ],
        ),
        "",
        "### The draft, token level",
        "",
        f"vLLM `draft_model` speculation, k = 4, on the questions above: acceptance rate "
        f"{_fmt(rate)}, mean acceptance length {_fmt(s.get('draft_mean_acceptance_length'), '.2f')} "
        f"({e['token_level_k4']['accepted']:.0f} of {e['token_level_k4']['draft_tokens']:.0f} draft tokens in "
        f"{e['token_level_k4']['drafts']:.0f} drafts).",
        *_all_questions(e.get("draft_acceptance_mtbench")),
        "",
        "## summary.json",
        "",
        "```json",
        json.dumps({k: s.get(k) for k in common.SUMMARY_KEYS}, indent=2),
        "```",
        "",
    ]
    return "\n".join(out)


def latency_section(latency: Path) -> list[str]:
    """BENCHMARKS.md's latency section from `scripts/bench_latency.py --compare`
    (<latency>/summary.json, <label>/<pair>.json, itl.png); empty without it."""
    summary_path = latency / "summary.json"
    if not summary_path.exists():
        return []
    summary = json.loads(summary_path.read_text())
    labels = [d.name for d in sorted(latency.iterdir()) if d.is_dir() and any(d.glob("*.json"))]
    labels.sort(key=lambda x: (x != "before", x))  # today's code first
    runs = {
        label: {p.stem: json.loads(p.read_text()) for p in sorted((latency / label).glob("*.json"))} for label in labels
    }
    out = [
        "## Latency under load (`scripts/bench_latency.py`)",
        "",
        "What a PARSE server's other users see. Per pair and batch B (`--max-num-seqs`), 2B streaming "
        "requests arrive on one seeded schedule; half have PARSE on (the preset's τ), half off. The same "
        "requests at the same times then go to the target alone. Inter-token latency (ITL) is the gap "
        "between chunks that carry tokens. Each label is one run of the script, figures within a label side "
        "by side: " + ", ".join(f"`{x}`" for x in labels) + ". The ITL distributions: `bench/latency/itl.png`.",
        "",
        "| pair | bs | PARSE-off ITL p99, target alone (s) | "
        + " | ".join(f"{x}: in the PARSE engine (s) | {x}: ratio" for x in labels)
        + " |",
        "|---|---:|---:|" + "---:|---:|" * len(labels),
    ]
    for pair in sorted({p for r in runs.values() for p in r}):
        for b in sorted({int(b) for r in runs.values() if pair in r for b in r[pair]["batches"]}):
            cells, alone = [], None
            for label in labels:
                row = runs[label].get(pair, {}).get("batches", {}).get(str(b))
                if row is None:
                    cells += ["—", "—"]
                    continue
                alone = alone or row["target"]["figures"]["parse_off"]["itl_p99"]
                cells += [
                    _fmt(row["parse"]["figures"]["parse_off"]["itl_p99"], ".2f"),
                    _fmt(row["itl_p99_ratio_parse_off"], ".2f"),
                ]
            out.append(f"| {pair} | {b} | {_fmt(alone, '.2f')} | " + " | ".join(cells) + " |")
    out += [
        "",
        "| pair | " + " | ".join(f"{x}: PARSE e2e bs 1 (s) | {x}: throughput bs 16 (tok/s)" for x in labels) + " |",
        "|---|" + "---:|---:|" * len(labels),
    ]
    for pair in sorted({p for r in runs.values() for p in r}):
        cells = []
        for label in labels:
            r = runs[label].get(pair)
            bs16 = (r or {}).get("batches", {}).get("16")
            cells += [
                _fmt(r["parse_bs1"]["figures"]["e2e_mean"], ".2f") if r else "—",
                _fmt(bs16["parse"]["figures"]["throughput_tok_s"], ".1f") if bs16 else "—",
            ]
        out.append(f"| {pair} | " + " | ".join(cells) + " |")
    out += ["", "![ITL distributions](bench/latency/itl.png)"]
    out += _latency_goals(summary)
    out += _latency_sweep(latency / "sweep")
    out += [
        "",
        "`bench/latency/summary.json`:",
        "",
        "```json",
        json.dumps(summary, indent=2),
        "```",
        "",
    ]
    return out


def _latency_goals(summary: dict) -> list[str]:
    """The issue's goals against summary.json, per pair (ratios within one run)."""
    goals = [
        ("itl_p99_ratio_parse_off_bs8", "PARSE-off ITL p99 over the target alone's, bs 8", _le(1.25), "≤ 1.25"),
        ("itl_p99_ratio_parse_off_bs16", "PARSE-off ITL p99 over the target alone's, bs 16", _le(1.25), "≤ 1.25"),
        ("parse_e2e_ratio_bs1", "PARSE e2e bs 1, before over after", _ge(1 / 1.1), "≥ 1/1.1"),
        ("throughput_ratio_bs16", "throughput bs 16, after over before", _ge(1.0), "≥ 1"),
    ]
    out = ["", "| pair | goal | bound | measured | |", "|---|---|---:|---:|---|"]
    for pair, s in sorted(summary.items()):
        for key, text, ok, bound in goals:
            if key in s:
                out.append(f"| {pair} | {text} | {bound} | {_fmt(s[key], '.2f')} | {_goal(ok(s[key]))} |")
    return out


def _latency_sweep(sweep: Path) -> list[str]:
    """A table of runs in <sweep>/<label>/<pair>.json (one PARSE option varied,
    `bench_latency.py --parse-option`), each run with its own target-alone rows."""
    paths = sweep.glob("*/*.json") if sweep.is_dir() else []
    runs = [(path, json.loads(path.read_text())) for path in paths]
    if not runs:
        return []
    out = [
        "",
        "Runs varying one PARSE option (`bench/latency/sweep/`, one run each, each with its own target-alone "
        "rows; a noisy machine):",
        "",
        "| pair | run | options | PARSE-off ITL p99 ratio bs 8 | bs 16 | PARSE-on e2e bs 8 (s) | throughput bs 16 "
        "(tok/s) | PARSE e2e bs 1 (s) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]

    def order(run):
        path, d = run
        options = d.get("parse_options") or {}
        return path.stem, sorted((k, str(v).zfill(8)) for k, v in options.items()), path.parent.name

    for path, d in sorted(runs, key=order):
        b = d["batches"]

        def cell(batch, get, f=".2f", b=b):
            return _fmt(get(b[batch]), f) if batch in b else "—"

        out.append(
            f"| {path.stem} | {path.parent.name} | `{json.dumps(d.get('parse_options') or {})}` | "
            f"{cell('8', lambda r: r['itl_p99_ratio_parse_off'])} | {cell('16', lambda r: r['itl_p99_ratio_parse_off'])} | "
            f"{cell('8', lambda r: r['parse']['figures']['parse_on']['e2e_mean'])} | "
            f"{cell('16', lambda r: r['parse']['figures']['throughput_tok_s'], '.1f')} | "
            f"{_fmt(d['parse_bs1']['figures']['e2e_mean'], '.2f')} |"
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=Path("bench/results"))
    ap.add_argument("--full-dir", type=Path, default=Path("bench/full"))
    ap.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"))
    ap.add_argument("--latency", type=Path, default=Path("bench/latency"), help="bench_latency.py --compare output")
    ap.add_argument("--eagle3", type=Path, default=Path("bench/eagle3"), help="make bench-eagle3 output")
    ap.add_argument(
        "--sections",
        type=Path,
        nargs="*",
        default=list(SECTIONS),
        help="Markdown sections other benchmarks wrote, appended as they are (those present)",
    )
    ap.add_argument(
        "--gpu-costs",
        type=Path,
        default=None,
        help="a gpu_costs.json (scripts/gpu_costs.py): adds the projection of the --counters runs on that GPU",
    )
    ap.add_argument(
        "--counters",
        type=Path,
        nargs="+",
        default=list(projection.DEFAULT_COUNTERS),
        help="eval summary.json files whose PARSE counters --gpu-costs projects (each row at its batch)",
    )
    args = ap.parse_args(argv)
    if args.gpu_costs is not None and not args.gpu_costs.is_file():
        ap.error(f"--gpu-costs {args.gpu_costs} does not exist")
    if args.gpu_costs is not None and not projection.load_summaries(args.counters):
        ap.error("--gpu-costs: none of the --counters summaries exists: " + ", ".join(map(str, args.counters)))
    for name in ("verify.json", "e2e.json", "summary.json"):
        if not (args.results / name).exists():
            ap.error(f"{args.results / name} is missing: run the benchmarks in full mode first (make bench-full)")
    for mode_file in ("verify.json", "e2e.json"):
        if json.loads((args.results / mode_file).read_text()).get("mode") != "full":
            ap.error(f"{args.results / mode_file} is from a quick run; BENCHMARKS.md takes full runs only")
    args.full_dir.mkdir(parents=True, exist_ok=True)
    for f in ("verify.json", "e2e.json", "summary.json", "verify.png", "e2e.png"):
        if (args.results / f).exists() and (args.results / f).resolve() != (args.full_dir / f).resolve():
            shutil.copy2(args.results / f, args.full_dir / f)
    if (args.eagle3 / "summary.json").is_file():  # its keys join the full run's summary
        path = args.full_dir / "summary.json"
        summary = json.loads(path.read_text())
        summary.update(eagle3_figures(json.loads((args.eagle3 / "summary.json").read_text())))
        path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    args.out.write_text(
        render(
            args.full_dir,
            str(args.full_dir),
            args.latency,
            args.eagle3,
            args.gpu_costs,
            tuple(args.counters),
            tuple(args.sections),
        )
    )
    print(f"wrote {args.out} and {args.full_dir}/")
    return 0
