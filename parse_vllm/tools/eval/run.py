"""`parse-vllm eval`: speed against quality, the target alone vs token-level speculation vs
PARSE over a τ sweep, side by side in one run.

Configurations (engines one at a time: a GPU preset's target does not fit twice):

1. ``target``   -- the target alone;
2. ``token-kK`` -- vLLM's ``draft_model`` token-level speculation with the same draft, k = K;
3. ``parse``    -- a PARSE engine (window W, the preset's or given PARSE options), every
   τ × guard of the sweep set per request (``parse_threshold``, ``parse_guard``);
4. last, untimed: the target's NLL of every row's text -- one prompt-logprobs pass over
   prompt + output per distinct text.

Each runs every prompt set at batch 1 and at ``--batch`` (requests kept in flight with
``tools.engine.run_batch``), greedy, ``--max-tokens``, ``--repeats`` times, interleaved, every
timed job from the same state, timed per task (timing.py: the schedule, the process and
fresh engine per job, the warm-up, the emptied prefix cache, time per task, ratios with
bootstrap intervals, the noise floor). Each finished job is saved at once in
``--out``/timings.jsonl: a run cut short (or stopped by ``--max-jobs``) resumes at the first
job not saved when the same command is run again. Answers are checked
after the engines are closed (code runs in subprocesses, which must not share the CPU with
a timing). Results: ``summary.json``, ``summary.md`` and ``eval.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from parse_vllm.config import HEAD_THRESHOLD

from . import checks, report, tasks, timing

DEFAULT_TAUS = (0.0, 0.5, 0.9, 1.5)
DEFAULT_WINDOW = 128  # bench_e2e's full run


class EvalError(Exception):
    """A bad argument or input: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="parse-vllm eval",
        allow_abbrev=False,  # the parent re-runs its own argv for each job process, less --fresh
        description="Speed against quality: the target alone, token-level speculation and PARSE over a τ sweep, "
        "on MT-Bench, a checkable task set and/or your own JSONL, with a recommendation.",
    )
    m = ap.add_argument_group("models (default: the bundled CPU pair, SmolLM2-135M-Instruct and its draft)")
    m.add_argument(
        "--config",
        "--parse-config",
        dest="config",
        metavar="PRESET.yaml",
        help="a preset (configs/): model, speculative_config (draft, W), parse and engine sections",
    )
    m.add_argument("--target", help="target model (HF name or folder); overrides the preset's")
    m.add_argument("--draft", help="draft model; overrides the preset's")
    m.add_argument("--window", type=int, help=f"PARSE draft window W (default: the preset's, else {DEFAULT_WINDOW})")
    m.add_argument("--parse", metavar="JSON", help="PARSE options (additional_config['parse']), over the preset's")
    m.add_argument(
        "--engine",
        metavar="JSON",
        help="more vllm.LLM arguments for every engine, e.g. "
        '\'{"dtype": "float32"}\' (over the preset\'s engine section)',
    )
    m.add_argument(
        "--spec-k",
        type=int,
        nargs="*",
        default=[4],
        metavar="K",
        help="draft tokens of the token-level configurations, one row each (default 4; none: no such row)",
    )
    m.add_argument(
        "--draft-alone", action="store_true", help="also a row of the draft model alone (quality floor, speed ceiling)"
    )
    m.add_argument(
        "--eagle3",
        metavar="HEAD",
        help="an EAGLE-3 head for the target (parse-vllm train-eagle3): a row of vLLM's EAGLE-3 alone "
        "(--eagle3-k tokens), and the variant e3 (PARSE engines whose token-level drafts come from the head)",
    )
    m.add_argument("--eagle3-k", type=int, default=3, metavar="K", help="tokens the EAGLE-3 head proposes (default 3)")
    s = ap.add_argument_group("sweep")
    s.add_argument(
        "--taus",
        type=_tau_arg,
        nargs="*",
        default=list(DEFAULT_TAUS),
        metavar="τ",
        help="τ values of the PARSE rows (default: 0 0.5 0.9 1.5; none: no PARSE engine); head: the "
        "τ_head recorded in the judge head the PARSE options name",
    )
    s.add_argument(
        "--variant-taus",
        nargs="+",
        default=[],
        metavar="V=τ,τ",
        help="τ values for one variant instead of --taus, e.g. adaptive-k4=0.7 or adaptive-k4=head (the others "
        "keep --taus)",
    )
    s.add_argument(
        "--guards",
        type=int,
        nargs="+",
        default=None,
        metavar="K",
        help="token-guard values (parse_guard: top-k, 0 = off) of the PARSE rows (default: the engine's, 0)",
    )
    s.add_argument(
        "--windows",
        type=int,
        nargs="+",
        metavar="W",
        help="PARSE windows, one engine each (default: --window)",
    )
    s.add_argument(
        "--variants",
        nargs="+",
        metavar="V",
        help="what a PARSE engine does after a rejection, one engine each: continue, redraft, kN "
        "(continue with token-level speculation of N draft tokens), or e3 (continue with the --eagle3 head "
        "proposing --eagle3-k tokens; also PARSE-off and τ > 1 requests); adaptive, adaptive-kN, adaptive-e3: "
        "the same token-level arm, windows chosen by the adaptive policy; any of them with -parts (k4-parts, "
        "adaptive-k4-parts): windows judged in parts as they are drafted, judge_chunks (default: the PARSE options')",
    )
    p = ap.add_argument_group("prompts")
    p.add_argument(
        "--prompts",
        nargs="+",
        default=["mtbench", "checkable"],
        metavar="SET",
        help="mtbench, checkable, humaneval, an MBPP file (PATH[:SPLIT], e.g. mbpp.jsonl:test, MBPP's official "
        "split by task id), and/or JSONL files (prompt or messages; optional id, reference, test)",
    )
    p.add_argument(
        "--split",
        choices=tasks.SPLITS,
        default="all",
        help="humaneval: the even task ids (tune on these), the odd ones (validation: once, with the "
        "settings chosen on even) or all (default all)",
    )
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per set at --batch (default 16)")
    p.add_argument(
        "--bs1-prompts", type=int, default=4, help="prompts per set at batch 1 (default 4; 0: no batch-1 run)"
    )
    p.add_argument("--batch", type=int, default=16, help="the big batch size (default 16)")
    p.add_argument(
        "--allow-few-tasks",
        action="store_true",
        help=f"run batch-1 rows on fewer than {timing.MIN_BS1_TASKS} tasks per prompt set (a smoke run: those rows "
        "are marked too few and claim nothing); refused otherwise",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the checkable task set (default 0)")
    p.add_argument("--max-tokens", type=int, default=256, help="answer cap (default 256)")
    p.add_argument(
        "--code-timeout",
        type=float,
        default=checks.CODE_TIMEOUT_S,
        help=f"seconds a code answer may run with its asserts (default {checks.CODE_TIMEOUT_S:g})",
    )
    t = ap.add_argument_group("timing (timing.py)")
    t.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="times every configuration runs its task lists, interleaved with the others "
        "(repeat 1 of all, then repeat 2 of all, ...); rows report the median and spread (default 2, at least 2)",
    )
    t.add_argument(
        "--engine-per-job",
        action="store_true",
        help="with --same-process: a fresh engine for every timed job (default there: one per configuration and "
        "repeat, the prefix cache emptied between its jobs; adaptive PARSE engines, whose window policy learns, "
        "get one per job anyway). Without --same-process every job has a process and an engine of its own",
    )
    t.add_argument(
        "--same-process",
        action="store_true",
        help="every timed job in this one process (default: each timed job in a process of its own, started by "
        "this one: a long-lived process slows down as it ages -- docs/benchmarks.md -- so jobs late in a "
        "run would be timed on another machine than the first ones)",
    )
    t.add_argument(
        "--max-jobs",
        type=int,
        metavar="N",
        help="time at most N jobs not yet saved, then stop (exit status 3 while jobs remain, no report): a long "
        "run in stages; the same command again resumes it",
    )
    # internal: the process the parent starts for one job (implies --same-process; no report)
    t.add_argument("--job-process", action="store_true", help=argparse.SUPPRESS)
    t.add_argument(
        "--fresh",
        action="store_true",
        help="discard the timings a cut run saved in --out (default: resume from them when the settings match)",
    )
    b = ap.add_argument_group("budget and output")
    b.add_argument(
        "--max-accuracy-drop",
        type=float,
        default=0.0,
        help="accuracy loss allowed against the target, absolute fraction (default 0)",
    )
    b.add_argument(
        "--max-nll-increase",
        type=float,
        default=0.10,
        help="NLL-per-token increase allowed against the target (default 0.10: ratio ≤ 1.10)",
    )
    b.add_argument(
        "--no-nll",
        action="store_true",
        help="skip the target's NLL of every text (a prompt-logprobs pass per distinct answer; "
        "where answers are checked, their accuracy is the quality figure)",
    )
    b.add_argument("--out", type=Path, default=Path("bench/results/eval"), help="results folder")
    b.add_argument("--save-outputs", action="store_true", help="also write every answer to outputs.jsonl")
    b.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="run nothing: merge the reports in these folders (each one eval run, its rows scored against its "
        "own target-alone row) into one report in --out, the recommendation made over all their rows",
    )
    b.add_argument(
        "--rescore",
        action="store_true",
        help="run nothing: recompute the speed figures and the recommendation of the finished run in --out from "
        "its timings.jsonl (each repeat's ratio, intervals over repeats and tasks) and rewrite its report",
    )
    b.add_argument(
        "--judge",
        action="store_true",
        help="does the judge discriminate: its P(Correct) on the draft-alone answers (whole, and cut at line "
        "ends) against whether they pass their tests; ROC AUC and histograms in the report and judge.png "
        "(needs --draft-alone and a checkable prompt set)",
    )
    return ap


def _json_arg(value: str | None, flag: str) -> dict:
    if value is None:
        return {}
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise EvalError(f"{flag}: not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise EvalError(f"{flag}: expected a JSON object, got {value!r}")
    return obj


def check_args(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "batch", "max_tokens"):
        if getattr(args, name) < 1:
            raise EvalError(f"--{name.replace('_', '-')} must be >= 1")
    if any(k < 1 for k in args.spec_k) or any(w < 1 for w in args.windows or ()):
        raise EvalError("--spec-k and --windows take integers >= 1")
    for v in args.variants or ():
        base = _variant_base(v)
        if base not in ("continue", "redraft", "e3") and not (
            base[:1] == "k" and base[1:].isdigit() and int(base[1:]) >= 1
        ):
            raise EvalError(
                f"--variants: {v!r} is not continue, redraft, kN (N >= 1) or e3, or adaptive-<one of them>, "
                "each optionally -parts"
            )
        if base == "e3" and not args.eagle3:
            raise EvalError(f"--variants {v} needs --eagle3 HEAD")
    if args.eagle3_k < 1:
        raise EvalError("--eagle3-k must be >= 1")
    if args.judge and not args.draft_alone:
        raise EvalError("--judge scores the draft-alone answers: add --draft-alone")
    if args.bs1_prompts < 0 or (args.window is not None and args.window < 1):
        raise EvalError("--bs1-prompts must be >= 0 and --window >= 1")
    if any(t != HEAD_TAU and t < 0 for t in args.taus):
        raise EvalError("--taus: τ must be >= 0")
    for v, taus in variant_taus(args).items():
        if v not in (args.variants or []):
            raise EvalError(f"--variant-taus {v}: not one of --variants {args.variants or []}")
        if not taus or any(t != HEAD_TAU and t < 0 for t in taus):
            raise EvalError(f"--variant-taus {v}: give τ values >= 0, e.g. {v}=0.7")
    if args.guards is not None and any(g < 0 for g in args.guards):
        raise EvalError("--guards: a guard is an integer >= 0 (0 = off)")
    if args.max_accuracy_drop < 0 or args.max_nll_increase < 0:
        raise EvalError("the budget (--max-accuracy-drop, --max-nll-increase) must be >= 0")
    if args.max_jobs is not None and args.max_jobs < 1:
        raise EvalError("--max-jobs must be >= 1")
    if args.repeats < 2:
        raise EvalError(
            "--repeats must be >= 2: every configuration is timed at least twice, interleaved, "
            "so the report can state its noise floor"
        )


def check_task_counts(counts: dict[tuple[str, int], int], allow_few: bool) -> None:
    """Batch-1 rows on fewer than MIN_BS1_TASKS tasks of a prompt set are refused (a ratio
    over 2 or 4 prompts is noise), unless --allow-few-tasks."""
    few = {name: n for (name, b), n in counts.items() if b == 1 and n < timing.MIN_BS1_TASKS}
    if few and not allow_few:
        got = ", ".join(f"{name}: {n}" for name, n in few.items())
        raise EvalError(
            f"batch-1 rows need at least {timing.MIN_BS1_TASKS} tasks per prompt set for a timing "
            f"that says anything (this run has {got} at batch 1): give --bs1-prompts "
            f"{timing.MIN_BS1_TASKS} or more (with --batch 1: --num-prompts), --bs1-prompts 0 for no "
            "batch-1 rows, or --allow-few-tasks for a smoke run whose batch-1 rows claim nothing"
        )


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Models, window, PARSE options and the engines' common LLM arguments (without
    max_model_len when the preset leaves it out) from the preset and the flags."""
    from parse_vllm.config import ParseConfig, ParseConfigError

    preset = None
    if args.config:
        from parse_vllm.presets import load_preset

        try:
            preset = load_preset(args.config)
        except (SystemExit, ParseConfigError) as e:  # PresetError is a SystemExit with the message
            raise EvalError(str(e.code if isinstance(e, SystemExit) else e)) from None
    spec = dict(preset.speculative_config or {}) if preset else {}
    parse = dict(preset.parse) if preset else {}
    parse.update(_json_arg(args.parse, "--parse"))
    try:
        ParseConfig.from_dict(parse)
    except (ParseConfigError, TypeError) as e:
        raise EvalError(f"--parse: {e}") from None
    engine = {k.replace("-", "_"): v for k, v in (preset.engine if preset else {}).items()}
    engine.update(_json_arg(args.engine, "--engine"))
    window = args.window or spec.get("num_speculative_tokens") or DEFAULT_WINDOW
    return {
        "preset": preset,
        "target": args.target or (preset and preset.model),
        "draft": args.draft or spec.get("model"),
        "spec": spec,
        "window": window,
        "parse": parse,
        "engine": engine,
    }


def engine_kwargs(res: dict, target: str, max_model_len: int, max_num_seqs: int) -> dict:
    from parse_vllm.tools.benchmarks import common

    if res["preset"] is not None:
        # a preset says how its engines are built (GPU ones especially): only fill the gaps
        kw = {"model": target, "seed": 0, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs}
        kw.update(res["engine"])
        kw["model"] = target
        return kw
    kw = common.engine_kwargs(Path(target), max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    kw.update(res["engine"])
    return kw


def spec_config(res: dict, draft: str, k: int) -> dict:
    spec = dict(res["spec"], method="draft_model", model=draft, num_speculative_tokens=k)
    return spec


def parse_engines(args: argparse.Namespace, res: dict) -> list[tuple[str, int, dict]]:
    """(row config name, W, PARSE options) of every PARSE engine: --windows × --variants,
    or the one PARSE engine of the preset and flags ("parse")."""
    if not args.windows and not args.variants:
        return [("parse", res["window"], res["parse"])]
    out = []
    for w in args.windows or [res["window"]]:
        for v in args.variants or [res["parse"].get("on_reject", "continue")]:
            opts = dict(res["parse"])
            base = _variant_base(v)
            if base == "redraft":
                opts.update(on_reject="redraft")
            elif base == "e3":
                opts.update(
                    on_reject="continue",
                    spec_tokens=args.eagle3_k,
                    token_proposer={"method": "eagle3", "model": str(args.eagle3)},
                )
            else:
                opts.update(on_reject="continue", spec_tokens=int(base[1:]) if base.startswith("k") else 0)
            if v.startswith("adaptive"):
                opts.update(on_reject="adaptive")
            if v.endswith(PARTS):
                opts.update(judge_chunks=True)
            out.append((f"parse W={w}" + ("" if v == "continue" else f" {v}"), w, opts))
    return out


HEAD_TAU = HEAD_THRESHOLD  # a τ given as this word: the judge head's own τ_head (head_tau)


def _tau_arg(value: str) -> float | str:
    if value == HEAD_TAU:
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a number, or {HEAD_TAU} (the judge head's τ_head)") from None


def variant_taus(args: argparse.Namespace) -> dict[str, list[float | str]]:
    """--variant-taus V=τ,τ ... -> {V: [τ, ...]}."""
    out = {}
    for item in getattr(args, "variant_taus", None) or []:
        v, sep, rest = item.partition("=")
        try:
            out[v] = [_tau_arg(t.strip()) for t in rest.split(",") if t.strip()] if sep else []
        except argparse.ArgumentTypeError:
            raise EvalError(f"--variant-taus {item}: expected VARIANT=τ[,τ...], e.g. adaptive-k4=0.7") from None
    return out


def head_tau(args: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any] | None:
    """Where --taus or --variant-taus say `head`: the τ_head that the judge head named by the
    PARSE options records (the rule it was trained with chose it), put in their place. Both
    lists come back as numbers, each τ once (a cut run then resumes whichever way its τ were
    written). Returns {"tau", "judge_head"}, or None when no τ says `head`."""
    given = [*args.taus, *(t for ts in variant_taus(args).values() for t in ts)]
    tau = name = None
    if HEAD_TAU in given:
        from parse_vllm.judge_head import JudgeHeadError, head_tau

        name = res["parse"].get("judge_head")
        if not name:
            raise EvalError(f"τ {HEAD_TAU}: the PARSE options name no judge_head (--parse or the preset)")
        try:
            tau = head_tau(str(name))
        except JudgeHeadError as e:
            raise EvalError(f"τ {HEAD_TAU}: {e}") from None

    def numbers(taus):
        return list(dict.fromkeys(float(tau if t == HEAD_TAU else t) for t in taus))

    args.taus = numbers(args.taus)
    args.variant_taus = [f"{v}=" + ",".join(map(repr, numbers(ts))) for v, ts in variant_taus(args).items()]
    return None if tau is None else {"tau": tau, "judge_head": str(name)}


def _variant_of(name: str, window: int) -> str:
    """The --variants entry of a PARSE engine's row name ("parse W=128 adaptive-k4" -> adaptive-k4)."""
    return name[len(f"parse W={window}") :].strip() or "continue" if name.startswith("parse W=") else name


PARTS = "-parts"  # a variant's suffix: its windows judged in parts as drafted (judge_chunks)


def _variant_base(v: str) -> str:
    """A variant's token-level arm: adaptive-k4 -> k4, adaptive -> continue, k4-parts -> k4."""
    v = v.removesuffix(PARTS)
    return (v[len("adaptive") :].lstrip("-") or "continue") if v.startswith("adaptive") else v


# -- running -----------------------------------------------------------------------------


class _Tracked:
    """``llm`` for :func:`parse_vllm.tools.engine.run_batch`, ticking a progress bar per finished request."""

    class _Engine:
        def __init__(self, engine, bar):
            self._engine, self._bar = engine, bar

        def add_request(self, *a, **kw):
            return self._engine.add_request(*a, **kw)

        def has_unfinished_requests(self):
            return self._engine.has_unfinished_requests()

        def step(self):
            outs = self._engine.step()
            done = sum(1 for o in outs if o.finished)
            if done:
                self._bar.update(done)
            return outs

    def __init__(self, llm, bar):
        self.llm_engine = self._Engine(llm.llm_engine, bar)


def _acceptance(config: str, spec: dict, stats: dict | None) -> dict | None:
    if config in ("target", "draft"):
        return None
    acc: dict[str, Any] = {f"vllm_{k}": int(v) for k, v in spec.items()}
    # one definition for every speculative row: vLLM's own spec-decode counters (which count
    # PARSE's accepted prefixes as accepted draft tokens), accepted / proposed draft tokens
    acc["acceptance_rate"] = spec["accepted"] / spec["draft_tokens"] if spec["draft_tokens"] else None
    acc["mean_acceptance_length"] = 1 + spec["accepted"] / spec["drafts"] if spec["drafts"] else None
    if stats is not None:  # PARSE's own counters beside them
        acc.update({k: v for k, v in stats.items()})
    else:
        acc["tokens_accepted_token_level"] = int(spec["accepted"])
    return acc


_JOBS_IN_THIS_PROCESS = itertools.count()  # numbers the timed jobs this process runs (0: its first)


def _job_key(job: dict) -> tuple:
    return (job["config"], job["set"], job["batch"], job["tau"], job["guard"], job["repeat"])


def run_engine(
    config: str,
    kw: dict,
    jobs: list[dict],
    *,
    max_tokens: int,
    is_parse: bool,
    progress,
    warmup: list[int],
    on_done=None,
) -> list[dict]:
    """One engine, fresh: every job on it (prompt set, batch, τ, guard, repeat), each from the
    same state -- the same warm-up request (``warmup``, at most 16 tokens, the job's own
    PARSE settings), then the prefix cache emptied (vLLM's ``reset_prefix_cache``) and the
    counters read -- then timed per task. ``on_done(record)`` gets each finished job's
    record at once (saved by the caller, so a cut run resumes)."""
    import torch
    from tqdm.auto import tqdm

    import parse_vllm
    from parse_vllm._vllm import LLM, SamplingParams
    from parse_vllm._vllm.platform import ENGINE_MULTIPROCESSING_ENV
    from parse_vllm.tools.engine import (
        SpeedProbe,
        close,
        prefix_cache_counters,
        reset_prefix_cache,
        run_batch,
        spec_counters,
    )

    progress.set_description(f"starting {config}")
    llm = LLM(**kw, disable_log_stats=False)
    # the machine's speed before every step (timing.py: probe units); a CPU probe, so only
    # where the engine runs on the CPU, in this process
    in_process = os.environ.get(ENGINE_MULTIPROCESSING_ENV) == "0"
    probe = SpeedProbe() if in_process and not torch.cuda.is_available() else None
    records = []
    try:
        for i, job in enumerate(jobs):
            name = report.label(
                {"config": config, "tau": job["tau"], "guard": job["guard"] if job["pass_guard"] else 0}
            )
            where = f"{name} {job['set']} bs={job['batch']} repeat {job['repeat'] + 1}"
            progress.set_description(where)
            extra = None
            if is_parse:
                extra = {"parse": True, "parse_threshold": job["tau"]}
                if job["pass_guard"]:
                    extra["parse_guard"] = job["guard"]
            llm.generate(
                [{"prompt_token_ids": warmup}],
                SamplingParams(temperature=0.0, max_tokens=min(16, max_tokens), extra_args=extra),
                use_tqdm=False,
            )
            reset_prefix_cache(llm)
            params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra) for _ in job["prompts"]]
            if is_parse:
                parse_vllm.reset_stats(llm)
            spec0, cache0 = spec_counters(llm), prefix_cache_counters(llm)
            with tqdm(total=len(job["prompts"]), desc=f"  {where}", unit="req", leave=False, file=sys.stderr) as bar:
                res = run_batch(_Tracked(llm, bar), job["prompts"], params, job["batch"], probe=probe)
            spec1, cache1 = spec_counters(llm), prefix_cache_counters(llm)
            process_job = next(_JOBS_IN_THIS_PROCESS)
            stats = parse_vllm.get_stats(llm) if is_parse else None
            per_request = parse_vllm.get_request_stats(llm) if is_parse else {}
            record = {
                **{k: job[k] for k in ("config", "set", "batch", "tau", "guard", "repeat", "order", "item_ids")},
                "engine": "fresh" if i == 0 else "reused, prefix cache emptied",
                "pid": os.getpid(),
                "process_job": process_job,  # 0: the first timed job of its process
                **{
                    k: res[k]
                    for k in (
                        *("wall_s", "tokens", "tok_s", "task_s", "task_probe", "probe_s"),
                        *("latency_s", "latency_p50_s", "latency_p90_s"),
                    )
                },
                "outputs": res["outputs"],
                "acceptance": _acceptance(config, {k: spec1[k] - spec0[k] for k in spec1}, stats),
                # per task: PARSE's counters of its request (parse_vllm.get_request_stats)
                "task_acceptance": [per_request.get(rid) for rid in res["request_ids"]] if is_parse else None,
                "prefix_cache": {"emptied": True, **{k: int(cache1[k] - cache0[k]) for k in cache1}},
                # on_reject adaptive: the step costs the policy chose with, as learnt by the job's end
                "step_costs": parse_vllm.get_step_costs(llm) if is_parse else None,
            }
            progress.write(
                f"[eval] {name:22s} {job['set']:>10s} bs={job['batch']:<3d} r{job['repeat'] + 1} "
                f"{res['wall_s'] / len(job['prompts']):7.2f} s/task {res['tok_s']:7.1f} tok/s "
                f"({res['tokens']} tokens in {res['wall_s']:.1f} s)"
            )
            progress.update(1)
            records.append(record)
            if on_done is not None:
                on_done(record)
    finally:
        close(llm)
    return records


def nll_logprobs(kw: dict, sequences: list[list[int]], progress) -> list:
    """The target's prompt log-probabilities of each sequence (one engine, untimed)."""
    from parse_vllm._vllm import LLM, SamplingParams
    from parse_vllm.tools.engine import close

    progress.set_description(f"NLL of {len(sequences)} texts")
    llm = LLM(**kw)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": s} for s in sequences],
            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
            use_tqdm=True,
        )
    finally:
        close(llm)
    progress.update(1)
    return [o.prompt_logprobs for o in outs]


def sessions(engines: list[dict], repeats: int, per_job: bool) -> list[tuple[dict, list[dict]]]:
    """(engine, its jobs) in the order they run (timing.schedule: every configuration's repeat
    r before any repeat r + 1, the same order each time). An engine runs its jobs of one
    repeat, or one job where a fresh engine per job is wanted (--engine-per-job, or an
    adaptive PARSE engine: its window policy's state outlives a cache reset). Each job gets
    its repeat and its place in the whole order (``order``)."""
    out = []
    for name, r in timing.schedule([e["name"] for e in engines], repeats):
        e = next(e for e in engines if e["name"] == name)
        jobs = [dict(j, config=name, repeat=r) for j in e["jobs"]]
        if per_job or e["per_job"]:
            out += [(e, [j]) for j in jobs]
        else:
            out.append((e, jobs))
    order = 0
    for _, jobs in out:
        for j in jobs:
            j["order"] = order
            order += 1
    return out


class Timings:
    """``--out``/timings.jsonl: the settings on the first line, then one finished job a line.
    A run with the same settings resumes from it; other settings are refused (or --fresh)."""

    def __init__(self, path: Path, settings: dict, fresh: bool):
        self.path = path
        self.done: dict[tuple, dict] = {}
        settings = json.loads(json.dumps(settings, sort_keys=True, default=str))
        if path.is_file() and not fresh:
            lines = path.read_text().splitlines()
            saved = json.loads(lines[0])["settings"] if lines else None
            if saved is not None:
                saved.setdefault("processes", "one for the run")  # timings saved before a process per job
            if saved != settings:
                diff = sorted(k for k in set(saved or {}) | set(settings) if (saved or {}).get(k) != settings.get(k))
                if diff == ["machine"]:
                    raise EvalError(
                        f"{path} holds timings taken on another machine, or before this one rebooted "
                        f"({(saved or {}).get('machine', 'not recorded')}; here: {settings['machine']}): times "
                        "from two machines are not side by side: --fresh to time the whole run here"
                    )
                raise EvalError(
                    f"{path} holds timings of a run with other settings ({', '.join(diff)}): "
                    "give another --out, or --fresh to discard them"
                )
            self.reload()
            path.write_text("".join(x + "\n" for x in [lines[0]] + [json.dumps(r) for r in self.done.values()]))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"settings": settings}) + "\n")

    def reload(self) -> None:
        """Read the saved jobs (also those another process saved since)."""
        for line in self.path.read_text().splitlines()[1:]:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # the line a kill cut short: that job runs again
                continue
            self.done[_job_key(rec)] = rec

    def add(self, record: dict) -> None:
        self.done[_job_key(record)] = record
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def build_row(records: list[dict]) -> dict:
    """One row from the repeats of one (set, config, τ, guard, batch): figures per repeat,
    their median and spread, per-task times (the median of each task's), and intervals over
    tasks (timing.py)."""
    recs = sorted(records, key=lambda r: r["repeat"])
    first = recs[0]
    n = len(first["item_ids"])
    task_s = timing.per_task([r["task_s"] for r in recs])
    task_tokens = timing.per_task([[len(o) for o in r["outputs"]] for r in recs])
    per_repeat = [statistics.fmean(r["task_s"]) for r in recs]
    tok_s_repeats = [r["tok_s"] for r in recs]
    s_per_task = statistics.fmean(task_s)
    return {
        **{k: first[k] for k in ("set", "config", "tau", "guard", "batch", "item_ids", "outputs", "acceptance")},
        "task_acceptance": first.get("task_acceptance"),  # the first repeat's (greedy: each repeat's alike)
        "n_prompts": n,
        "repeats": len(recs),
        "order": [r["order"] for r in recs],
        "s_per_task": s_per_task,
        "s_per_task_ci": timing.mean_ci(task_s),
        "s_per_task_repeats": per_repeat,
        "s_per_task_spread": timing.spread(per_repeat),
        "task_s": task_s,
        "task_s_repeats": [r["task_s"] for r in recs],  # [repeats][tasks]: the intervals resample both
        # the same in probe units (timing.py), where every repeat was probed
        "task_probe_repeats": [r["task_probe"] for r in recs] if all(r.get("task_probe") for r in recs) else None,
        "probe_s_repeats": [r.get("probe_s") for r in recs],
        "task_tokens": task_tokens,
        "tokens": first["tokens"],
        "wall_s": statistics.median(r["wall_s"] for r in recs),
        "tok_s": sum(task_tokens) / sum(task_s) if sum(task_s) > 0 else None,
        "tok_s_ci": timing.tok_s_ci(task_tokens, task_s),
        "tok_s_repeats": tok_s_repeats,
        "tok_s_spread": timing.spread(tok_s_repeats),
        "latency_p50_s": statistics.median(r["latency_p50_s"] for r in recs),
        "latency_p90_s": statistics.median(r["latency_p90_s"] for r in recs),
        "same_text_repeats": statistics.fmean(
            float(all(r["outputs"][i] == first["outputs"][i] for r in recs)) for i in range(n)
        ),
        "prefix_cache_hits": [r["prefix_cache"]["hits"] for r in recs],
        "engine": [r["engine"] for r in recs],
        "windows_repeats": [report.windows_opened(r) for r in recs],
        "few_tasks": first["batch"] == 1 and n < timing.MIN_BS1_TASKS,
    }


def _render(tok, item: dict) -> list[int]:
    from parse_vllm.tools.prompts import chat_prompt_ids

    if item.get("messages"):
        text = tok.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)
    return chat_prompt_ids(tok, item["prompt"])


def _judge(args, res: dict, base: dict, tok, rows: list[dict], ids: dict, items: dict) -> dict | None:
    """The judge's P(Correct) on the draft-alone answers of the checkable sets (the largest
    batch's rows), whole and cut at line ends, against whether they passed (judge.py)."""
    from parse_vllm.config import ParseConfig
    from parse_vllm.templates import build_template
    from parse_vllm.tools.engine import close

    from . import judge

    drafts = [r for r in rows if r["config"] == "draft" and any(c is not None for c in r["correct"])]
    if not drafts:
        return None
    batch = max(r["batch"] for r in drafts)
    template = build_template(tok, ParseConfig.from_dict(res["parse"]))
    whole, whole_ok, cut, cut_ok = [], [], [], []
    for r in (r for r in drafts if r["batch"] == batch):
        for prompt, out, ok in zip(ids[(r["set"], r["batch"])], r["outputs"], r["correct"]):
            if ok is None or not out:
                continue
            whole.append(list(prompt) + list(out))
            whole_ok.append(bool(ok))
            for c in judge.line_end_cuts(tok, out):
                cut.append(list(prompt) + list(out[:c]))
                cut_ok.append(bool(ok))
    from parse_vllm._vllm import LLM

    llm = LLM(**dict(base, enable_prefix_caching=True))
    try:
        p_whole = judge.p_yes(llm, template, whole)
        p_cut = judge.p_yes(llm, template, cut) if cut else []
    finally:
        close(llm)
    return {
        "title": f"judge {Path(res['target']).name} on the draft's answers ({', '.join(sorted({r['set'] for r in drafts}))})",
        "question": template.suffix_text,
        "whole": judge.discrimination(p_whole, whole_ok),
        "line_ends": judge.discrimination(p_cut, cut_ok) if cut else None,
        "p_yes_whole": p_whole,
    }


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    try:
        return _main(args, argv)
    except (EvalError, tasks.PromptSetError) as e:
        print(f"parse-vllm eval: error: {e}", file=sys.stderr)
        return 2


def combine(args: argparse.Namespace) -> int:
    """--combine: one report from several runs' (rows, baselines, judge, machines)."""
    import shutil

    runs = []
    for d in args.combine:
        path = d / "summary.json"
        if not path.is_file():
            raise EvalError(f"--combine: {path} does not exist")
        runs.append((d, json.loads(path.read_text())))
    rows = [dict(r, run=d.name) for d, s in runs for r in s["rows"]]
    first = runs[0][1]
    summary = {
        **{k: first[k] for k in ("machine", "models", "args")},
        "runs": {d.name: {"machine": s["machine"], "args": s["args"], "models": s["models"]} for d, s in runs},
        "sets": list(dict.fromkeys(n for _, s in runs for n in s["sets"])),
        "rows": rows,
        **report.recommend(rows, args.max_accuracy_drop, args.max_nll_increase),
        "baselines": [dict(b, run=d.name) for d, s in runs for b in s["baselines"]],
        "noise_floor": report.noise_floor_summary(
            [dict(b, set=f"{d.name}: {b['set']}") for d, s in runs for b in s["baselines"]]
        ),
        "judge": next((s["judge"] for _, s in runs if s.get("judge")), None),
        "wall_minutes": sum(s.get("wall_minutes", 0) for _, s in runs),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for d, s in runs:
        if s.get("judge") and (d / "judge.png").is_file():
            shutil.copy(d / "judge.png", args.out / "judge.png")
            break
    paths = report.write(summary, args.out)
    print(report.markdown(summary))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


# how speed ratios and their intervals are computed (timing.speed_figures), as the report's harness says
SPEED_RATIO = (
    "the reference's mean time per task over the row's on the same tasks, pooled over the repeats (> 1: faster), "
    "with each repeat's own ratio (repeat r against repeat r) beside it"
)
CI = (
    f"{timing.CONFIDENCE:.0%} percentile bootstrap resampling repeats and tasks independently, pairs kept together "
    f"({timing.RESAMPLES} resamples, seed 0); faster or slower only where the interval excludes 1.0 and every "
    "repeat's ratio is on that side, else no difference"
)


def rescore(args: argparse.Namespace) -> int:
    """--rescore: the run in --out re-scored from its saved timings, no model loaded."""
    path = args.out / "summary.json"
    if not path.is_file():
        raise EvalError(f"--rescore: {path} does not exist (a finished run's folder is needed)")
    summary = json.loads(path.read_text())
    load_repeats(summary, args.out)
    if summary.get("harness"):
        summary["harness"].update(speed_ratio=SPEED_RATIO, ci=CI)
    budget = summary.get("budget") or {}
    summary.update(
        report.recommend(
            summary["rows"],
            budget.get("max_accuracy_drop", args.max_accuracy_drop),
            budget.get("max_nll_increase", args.max_nll_increase),
        )
    )
    paths = report.write(summary, args.out)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def load_repeats(summary: dict, folder: Path) -> dict:
    """A run's summary with every row's per-task times by repeat (from the run's timings.jsonl
    where the summary predates them) and its speed-up against the target recomputed from
    them (in place; returned). A run timed before per-task times is returned as it is."""
    if not any(r.get("task_s") is not None for r in summary["rows"]):
        return summary
    try:
        timing.with_repeats(summary["rows"], folder / "timings.jsonl")
    except ValueError as e:
        raise EvalError(str(e)) from None
    report.speeds(summary["rows"])
    return summary


def processes(args: argparse.Namespace) -> str:
    """How this run's timed jobs are spread over processes (a setting, and in the report)."""
    return "one for the run" if args.same_process and not args.job_process else "one per job"


def run_job_processes(argv: list[str], plan: list, saved: Timings, max_jobs: int | None) -> None:
    """The jobs not yet saved (at most ``max_jobs``), each in a process of its own: this command
    again (less --fresh) with ``--job-process --max-jobs 1``, which times the first job not
    saved, saves it and exits."""
    import subprocess

    todo = [j for _, js in plan for j in js if _job_key(j) not in saved.done][:max_jobs]
    child = [a for a in argv if a != "--fresh"] + ["--job-process", "--max-jobs", "1"]
    total = sum(len(js) for _, js in plan)
    for job in todo:
        name = report.label({"config": job["config"], "tau": job["tau"], "guard": job["guard"]})
        print(
            f"[eval] job {job['order'] + 1} of {total}: {name} {job['set']} "
            f"bs={job['batch']} repeat {job['repeat'] + 1}, in a process of its own",
            file=sys.stderr,
            flush=True,
        )
        rc = subprocess.run([sys.executable, "-m", "parse_vllm.cli", "eval", *child]).returncode
        saved.reload()
        if rc != 0 or _job_key(job) not in saved.done:
            raise EvalError(
                f"the process timing {name} {job['set']} bs={job['batch']} repeat {job['repeat'] + 1} ended with "
                f"status {rc} without saving it (its output is above); the jobs saved so far are kept in "
                f"{saved.path}: the same command resumes"
            )


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.combine:
        return combine(args)
    if args.rescore:
        return rescore(args)
    check_args(args)
    res = resolve(args)
    tau_head = head_tau(args, res)
    batches = sorted({b for b, n in ((1, args.bs1_prompts), (args.batch, args.num_prompts)) if n > 0})
    counts = {1: args.bs1_prompts, args.batch: args.num_prompts} if args.batch != 1 else {1: args.num_prompts}
    sets = tasks.load_sets(args.prompts, checkable_n=max(counts.values()), seed=args.seed, split=args.split)

    from parse_vllm.tools.benchmarks import common

    common.setup_env()
    # one model runner for every engine (PARSE needs V1; vLLM >= 0.33 may pick V2 for the others)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    if res["target"] is None or res["draft"] is None:
        target, draft = common.resolve_models(
            res["target"] and Path(res["target"]), res["draft"] and Path(res["draft"])
        )
        res["target"], res["draft"] = res["target"] or str(target), res["draft"] or str(draft)
    target, draft = str(res["target"]), str(res["draft"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    chosen = {(s.name, b): s.take(counts[b]) for s in sets for b in batches}
    check_task_counts({key: len(items) for key, items in chosen.items()}, args.allow_few_tasks)
    ids = {key: [_render(tok, it) for it in items] for key, items in chosen.items()}
    variants = parse_engines(args, res)
    longest_draft = max([w for _, w, _ in variants] + list(args.spec_k))
    mlen = max(len(p) for ps in ids.values() for p in ps) + args.max_tokens + longest_draft + 64
    base = engine_kwargs(res, target, mlen, max(batches))
    guards = args.guards or [int(res["parse"].get("guard", 0))]
    pass_guard = args.guards is not None and args.guards != [int(res["parse"].get("guard", 0))]

    def jobs(taus, gs):
        return [
            {
                "set": s.name,
                "batch": b,
                "tau": t,
                "guard": g,
                "pass_guard": pass_guard,
                "prompts": ids[(s.name, b)],
                "item_ids": [it["id"] for it in chosen[(s.name, b)]],
            }
            for s in sets
            for b in batches
            for t in taus
            for g in gs
        ]

    def engine(name, kw, js, is_parse, per_job=False):
        return {"name": name, "kw": kw, "jobs": js, "is_parse": is_parse, "per_job": per_job}

    engines = [engine("target", base, jobs([None], [None]), False)]
    if args.draft_alone:
        engines.append(engine("draft", dict(base, model=draft), jobs([None], [None]), False))
    for k in args.spec_k:
        engines.append(
            engine(
                f"token-k{k}", dict(base, speculative_config=spec_config(res, draft, k)), jobs([None], [None]), False
            )
        )
    if args.eagle3:
        eagle = {"method": "eagle3", "model": str(args.eagle3), "num_speculative_tokens": args.eagle3_k}
        engines.append(
            engine(f"eagle3-k{args.eagle3_k}", dict(base, speculative_config=eagle), jobs([None], [None]), False)
        )
    own_taus = variant_taus(args)
    for name, window, opts in variants if args.taus or own_taus else []:
        taus = own_taus.get(_variant_of(name, window), args.taus)
        if not taus:
            continue
        kw = dict(base, speculative_config=spec_config(res, draft, window), additional_config={"parse": opts})
        # the adaptive policy learns step costs and judge rates engine-wide: a job of its own engine each
        engines.append(engine(name, kw, jobs(taus, guards), True, per_job=opts.get("on_reject") == "adaptive"))
    plan = sessions(engines, args.repeats, args.engine_per_job)
    # the same warm-up request before every timed job: the first prompt of the first task list
    warmup = ids[(sets[0].name, batches[0])][0]
    settings = {
        "args": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k
            not in (
                *("out", "fresh", "repeats", "save_outputs", "no_nll", "judge", "code_timeout", "combine", "rescore"),
                *("same_process", "max_jobs", "job_process"),
            )
            and not k.startswith("max_accuracy")
            and k != "max_nll_increase"
        },
        "models": {"target": target, "draft": draft},
        "engines": {e["name"]: e["kw"] for e in engines},
        "prompts": {f"{name} bs {b}": [it["id"] for it in items] for (name, b), items in chosen.items()},
        "processes": processes(args),
        "machine": common.machine_identity(),
    }
    saved = Timings(args.out / "timings.jsonl", settings, args.fresh and not args.job_process)
    budget = args.max_jobs  # jobs this process may still time
    if processes(args) == "one per job" and not args.job_process:
        run_job_processes(argv, plan, saved, args.max_jobs)
        budget = 0  # every job is timed in a process of its own; this one reads their records
    from tqdm.auto import tqdm

    total = sum(len(js) for _, js in plan) + (0 if args.no_nll else 1)
    records: list[dict] = []
    t0 = time.perf_counter()
    with tqdm(total=total, desc="eval", unit="job", file=sys.stderr) as progress:
        for e, js in plan:
            todo = [j for j in js if _job_key(j) not in saved.done]
            records += [saved.done[_job_key(j)] for j in js if _job_key(j) in saved.done]
            progress.update(len(js) - len(todo))
            if budget is not None:
                todo, budget = todo[:budget], budget - len(todo[:budget])
            if todo:
                records += run_engine(
                    e["name"],
                    e["kw"],
                    todo,
                    max_tokens=args.max_tokens,
                    is_parse=e["is_parse"],
                    progress=progress,
                    warmup=warmup,
                    on_done=saved.add,
                )
        left = sum(len(js) for _, js in plan) - len(records)
        if args.job_process:
            return 0
        if left:
            progress.write(
                f"[eval] stopped after --max-jobs {args.max_jobs}: {left} jobs left; the same command resumes"
            )
            return 3
        groups: dict[tuple, list[dict]] = {}
        for rec in records:
            groups.setdefault(_job_key(rec)[:5], []).append(rec)
        rows = [build_row(g) for g in groups.values()]
        rows.sort(key=lambda r: min(r["order"]))
        # the target's NLL of every distinct text any row wrote (untimed)
        seqs: dict[tuple[int, ...], int] = {}
        for r in rows:
            for p, o in zip(ids[(r["set"], r["batch"])], r["outputs"]):
                seqs.setdefault(tuple(p) + tuple(o), len(seqs))
        logprobs = None if args.no_nll else nll_logprobs(base, [list(s) for s in seqs], progress)
    from . import metrics

    baselines = []
    for r in rows:
        if r["config"] != "target":
            continue
        reps = sorted(
            (x for x in records if _job_key(x)[:5] == _job_key(dict(r, repeat=0))[:5]), key=lambda x: x["repeat"]
        )
        drift = reps[-1]["tok_s"] / reps[0]["tok_s"] - 1.0
        baselines.append(
            {
                "set": r["set"],
                "batch": r["batch"],
                "tok_s_first": reps[0]["tok_s"],
                "tok_s_last": reps[-1]["tok_s"],
                "drift": drift,
                "drift_flagged": abs(drift) > common.DRIFT_LIMIT,
                "same_text": r["same_text_repeats"],
                **timing.noise_floor([x["task_s"] for x in reps]),
                **timing.probe_noise_floor([x.get("task_probe") for x in reps]),
            }
        )
    # answers checked and NLL read now that no engine is running
    items = {(s.name, b): {it["id"]: it for it in chosen[(s.name, b)]} for s in sets for b in batches}
    cache: dict[tuple, bool | None] = {}
    for r in tqdm(rows, desc="checking answers", unit="row", file=sys.stderr):
        texts = [tok.decode(o, skip_special_tokens=True) for o in r["outputs"]]
        r["texts"] = texts
        r["correct"] = []
        for item_id, text in zip(r["item_ids"], texts):
            spec = items[(r["set"], r["batch"])][item_id]["check"]
            key = (text, json.dumps(spec, sort_keys=True))
            if key not in cache:
                cache[key] = checks.check(text, spec, timeout=args.code_timeout)
            r["correct"].append(cache[key])
        r["nll_logprobs"] = (
            None
            if logprobs is None
            else [
                metrics.output_logprobs(logprobs[seqs[tuple(p) + tuple(o)]], list(p) + list(o), len(p))
                for p, o in zip(ids[(r["set"], r["batch"])], r["outputs"])
            ]
        )
    # a set of code tasks (HumanEval, MBPP) is named "<set>-<split>" and scored as pass@1
    code_sets = {s.name for s in sets if s.items and all(it["kind"] == "code" for it in s.items)}
    for r in rows:
        r["split"] = r["set"].split("-", 1)[1] if r["set"] in code_sets and "-" in r["set"] else None
        r["n"] = r["n_prompts"]
    report.score(rows)
    for r in rows:
        r["pass_at_1"] = r["accuracy"] if r["split"] is not None else None
    judge_result = None
    if args.judge:
        judge_result = _judge(args, res, base, tok, rows, ids, items)
        if judge_result is not None:
            from . import judge

            args.out.mkdir(parents=True, exist_ok=True)
            judge.plot(judge_result, args.out / "judge.png")
    rec = report.recommend(rows, args.max_accuracy_drop, args.max_nll_increase)
    summary = {
        "machine": common.machine(),
        "models": {
            "target": target,
            "draft": draft,
            "window": res["window"],
            "windows": [w for _, w, _ in variants],
            "spec_k": args.spec_k,
            "parse": res["parse"],
            "preset": args.config,
            "engine": {k: v for k, v in base.items() if k != "model"},
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "tau_head": tau_head,
        "sets": [s.name for s in sets],
        "prompts": {s.name: {str(b): [it["id"] for it in chosen[(s.name, b)]] for b in batches} for s in sets},
        "rows": [report.summary_row(r) for r in rows],
        **rec,
        "baselines": baselines,
        "noise_floor": report.noise_floor_summary(baselines),
        "harness": harness(args, engines),
        "jobs": [{k: x.get(k) for k in JOB_KEYS} for x in sorted(records, key=lambda x: x["order"])],
        "judge": judge_result,
        "wall_minutes": (time.perf_counter() - t0) / 60,
        "timed_minutes": sum(x["wall_s"] for x in records) / 60,
    }
    paths = report.write(summary, args.out)
    if args.save_outputs:
        with open(args.out / "outputs.jsonl", "w") as f:
            for r in rows:
                per_task = r.get("task_acceptance") or [None] * len(r["item_ids"])
                for item_id, text, ok, out, acc in zip(r["item_ids"], r["texts"], r["correct"], r["outputs"], per_task):
                    f.write(
                        json.dumps(
                            {
                                "set": r["set"],
                                "config": r["config"],
                                "tau": r["tau"],
                                "guard": r["guard"],
                                "batch": r["batch"],
                                "id": item_id,
                                "correct": ok,
                                "tokens": len(out),
                                "semantic_tokens": None if acc is None else acc["semantic"],
                                "token_level_tokens": None if acc is None else acc["token_level"],
                                "text": text,
                            }
                        )
                        + "\n"
                    )
    print(report.markdown(summary))
    for b in baselines:
        if b["drift_flagged"]:
            print(
                f"** target-alone timing drifted {b['drift']:+.1%} ({b['set']} bs {b['batch']}): "
                "the machine was not quiet, ratios suspect **",
                file=sys.stderr,
            )
    print(report.noise_floor_line(summary["noise_floor"]))
    print(f"recommendation: {rec['recommendation']}")
    print("wrote " + ", ".join(str(p) for p in paths.values()) + f", {args.out / 'timings.jsonl'}")
    return 0


# a job's record as summary.json lists it (pid and process_job: absent from runs before them)
JOB_KEYS = ("order", "config", "set", "batch", "tau", "guard", "repeat", "engine", "pid", "process_job", "wall_s")


def harness(args: argparse.Namespace, engines: list[dict]) -> dict:
    """How this run timed (timing.py), for the report and summary.json."""
    per_job = [e["name"] for e in engines if e["per_job"] or args.engine_per_job]
    return {
        "repeats": args.repeats,
        "processes": processes(args),
        "order": "interleaved (ABAB): repeat 1 of every configuration, then repeat 2 of every configuration in "
        "the same order, and so on",
        "state": (
            "a process of its own and a fresh engine for every timed job"
            if processes(args) == "one per job"
            else "one process for the run; a fresh engine per configuration and repeat"
            + (f" (per timed job: {', '.join(per_job)})" if per_job else "")
        )
        + "; before every timed job the same warm-up request (the first prompt of the first task list, 16 "
        "tokens, the job's own PARSE settings), then the prefix cache emptied (LLM.reset_prefix_cache)",
        "per_task_time": "each engine step's wall time divided evenly among the requests in flight during it "
        "(they add up to the job's wall time; at batch 1 a task's time is its whole request); a row's per-task time is "
        "the median of its repeats', s_per_task their mean",
        "speed_ratio": SPEED_RATIO,
        "ci": CI,
        "noise_floor": "the target alone measured twice: repeat 2's time per task over repeat 1's, and the "
        "spread of its repeats",
        "min_bs1_tasks": timing.MIN_BS1_TASKS,
    }


if __name__ == "__main__":
    sys.exit(main())
