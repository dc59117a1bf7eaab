#!/usr/bin/env python
"""Where an engine step's time goes: PARSE beside vLLM's own speculation, under py-spy and
in-process timers.

Runs one in-process engine per configuration and repeat (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
so one process holds the scheduler, the runner and the models) over the first N HumanEval
tasks of a split, `--batch` requests in flight (parse_vllm.tools.engine.run_batch). The
configurations (`--configs`, run in turn, each repeat in the same order: ABAB):

  parse   PARSE: `--parse` options (e.g. '{"on_reject": "adaptive", "spec_tokens": 4}'),
          `--threshold`, W = `--window`
  kN      vLLM's own draft-model speculation with N tokens (no PARSE section)
  target  the target alone

Two views of each run:

py-spy (`record`, sampling, native frames off) sorts every sample into the part of the step
it belongs to, by the innermost frame that names one (in this order: a drafter's logits are
the drafter's):

  drafter        propose_draft_token_ids (PARSE's or vLLM's: catch-up and drafting)
  verification   ParseController.judge (the suffix copies' forward and label logits)
  acceptance     the rest of _sample (rejection sampler, PARSE's step)
  target logits  compute_logits of the target's forward
  target forward the rest of GPUModelRunner.execute_model (the step's forward)
  engine         everything else (scheduling, bookkeeping, detokenizing, Python)

Timers wrap the runner's methods for the whole run and give each engine step its time by
part (each part's own time, its callees' removed):

  engine          the rest of the engine's step (scheduler, outputs, detokenizing)
  update states   _update_states (PARSE: the batch view, the controller's begin_step)
  prepare inputs  _prepare_inputs (positions, metadata, spec-decode indices)
  target forward  _model_forward
  target logits   the target's compute_logits
  execute other   the rest of execute_model
  sampler         the rejection sampler (or the sampler)
  acceptance      the rest of _sample (PARSE: draft batch, checks, the step, the judge)
  verification    ParseController.judge
  draft model     the drafter's propose (its forwards and their metadata)
  drafter host    the rest of propose_draft_token_ids (PARSE: plan, rows, passes, staging)
  sample other    the rest of sample_tokens (bookkeeping, the drafts' copy, PARSE's report)

and a kind: `prefill` (some row prefills a prompt), `judge` (PARSE: a draft longer than
spec_tokens scheduled, or a draft judged), `window` (PARSE: windows open or drafted beside
the decoding rows, or alone), else `token-level` (every row decodes with at most spec_tokens
draft tokens: the step vLLM's kN runs too). The table
compares the token-level steps with the same number of rows, the batch's full width by
default (`--rows`).

Writes <out>/<config>-r<repeat>/{stacks.txt, run.json, steps.jsonl} and <out>/profile.json.

    python scripts/profile_parse.py --pair coder --tasks 4 --window 128 --threshold 0.5
    python scripts/profile_parse.py --configs k4 parse --repeats 2 --batch 8 --tasks 16 \\
        --split odd --max-tokens 256 --threshold 0.75 \\
        --parse '{"on_reject": "adaptive", "spec_tokens": 4, "two_stage": true, "judge_head": "qwen2.5-coder-1.5b-instruct"}'
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (part, frame function name, frame file suffix): the innermost match of a sample decides.
PARTS = (
    ("drafter", "propose_draft_token_ids", ""),
    ("verification", "judge", "parse_vllm/controller.py"),
    ("acceptance", "_sample", ""),
    ("target logits", "compute_logits", ""),
    ("target forward", "execute_model", "gpu_model_runner.py"),
)
# The timers' parts, in the table's order.
TIMED_PARTS = (
    "engine",
    "update states",
    "prepare inputs",
    "target forward",
    "target logits",
    "execute other",
    "sampler",
    "acceptance",
    "verification",
    "draft model",
    "drafter host",
    "sample other",
)


def classify(stack: list[tuple[str, str]]) -> str:
    """stack: (function, file) frames, outermost first; the first part (in PARTS order)
    with a frame in the stack decides (a drafter's logits are the drafter's)."""
    names = {(func.rsplit(".", 1)[-1], path) for func, path in stack}
    for part, name, suffix in PARTS:
        if any(n == name and p.endswith(suffix) for n, p in names):
            return part
    return "engine"


def parse_raw(path: Path) -> Counter:
    """py-spy's --format raw: `frame;frame;... count` lines, frames `func (file:line)`."""
    parts: Counter = Counter()
    for line in path.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not stack_text or "child (profile_parse.py" not in stack_text:
            continue  # not the main thread's (the engine's steps run there, in one process)
        frames = []
        for f in stack_text.split(";"):
            func, _, where = f.partition(" (")
            frames.append((func.strip(), where.rsplit(":", 1)[0]))
        parts[classify(frames)] += int(count)
    return parts


class StepTimers:
    """Each engine step's time by part: `wrap(obj, method, part)` times a method as `part`
    (its own time: the time of wrapped methods it calls goes to theirs); `step()` times one
    engine step, the rest of it going to "engine"."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self._stack: list[list] = []  # [part, start, time of timed callees]
        self.current: dict[str, float] = defaultdict(float)

    def _enter(self, part: str) -> None:
        self._stack.append([part, self.clock(), 0.0])

    def _exit(self) -> None:
        part, start, inner = self._stack.pop()
        elapsed = self.clock() - start
        self.current[part] += elapsed - inner
        if self._stack:
            self._stack[-1][2] += elapsed

    def wrap(self, obj, name: str, part: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._enter(part)
            try:
                return fn(*args, **kwargs)
            finally:
                self._exit()

        setattr(obj, name, timed)

    def step(self, run):
        """run(): one engine step; returns (its result, {part: seconds})."""
        self.current = defaultdict(float)
        self._enter("engine")
        try:
            out = run()
        finally:
            self._exit()
        return out, dict(self.current)


def model_runner(llm):
    """The in-process engine's model runner (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def engine_kwargs(args, config: str, target, draft) -> dict:
    """The LLM keyword arguments of a --configs name."""
    from parse_vllm.tools.benchmarks import common

    max_num_seqs = args.max_num_seqs or max(8, args.batch)
    kw = dict(max_model_len=args.max_model_len, max_num_seqs=max_num_seqs, dtype="float32")
    if config == "parse":
        parse = {"threshold": args.threshold, **json.loads(args.parse)}
        return common.parse_engine(target, draft, args.window, parse, **kw)
    if config == "target":
        return common.engine_kwargs(target, **kw)
    if config.startswith("k") and config[1:].isdigit():
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": int(config[1:])}
        return common.engine_kwargs(target, speculative_config=spec, **kw)
    raise SystemExit(f"--configs: unknown configuration {config!r} (parse, target or kN)")


def step_kind(sched, runner, before, spec_tokens: int) -> tuple[str, int]:
    """(prefill | judge | window | token-level, rows) of an engine step from its scheduler
    output and, under PARSE, the controller's counters before it (`before`: window chunks,
    copies, judged drafts) and after: `judge` a draft longer than spec_tokens scheduled or a
    draft judged, `window` windows open or drafted beside the decoding rows."""
    rows = len(sched.num_scheduled_tokens)
    p = getattr(runner, "parse", None)
    after = parse_counters(p) if p is not None else before
    judged = p is not None and after[1:] != before[1:]
    windows = p is not None and (bool(p.windows) or after[0] != before[0])
    spec = sched.scheduled_spec_decode_tokens
    if rows and any(n > len(spec.get(r, ())) + 1 for r, n in sched.num_scheduled_tokens.items()):
        return "prefill", rows
    if judged or any(len(d) > spec_tokens for d in spec.values()):
        return "judge", rows
    if windows:
        return "window", rows
    return ("token-level" if rows else "empty"), rows


def parse_counters(p) -> tuple[int, int, int]:
    s = p.stats
    return (s.window_chunks, s.copies, s.drafts)


def child(args) -> None:
    """The profiled run (in the process py-spy records)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams

    import parse_vllm
    from parse_vllm.tools.engine import run_batch
    from parse_vllm.tools.eval import tasks
    from parse_vllm.tools.prompts import chat_prompt_ids

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_cores import PAIRS, _paths

    out = Path(args.run_dir)
    target, draft = _paths(PAIRS[args.pair])
    kw = engine_kwargs(args, args.config, target, draft)
    is_parse = args.config == "parse"
    spec_tokens = int(args.config[1:]) if args.config.startswith("k") else 0
    if is_parse:
        spec_tokens = int(json.loads(args.parse).get("spec_tokens", 0))
    llm = LLM(**kw)
    tok = llm.get_tokenizer()
    items = tasks.humaneval_set(args.split).take(args.tasks)
    prompts = [chat_prompt_ids(tok, it["prompt"]) for it in items]
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    if is_parse:
        parse_vllm.reset_stats(llm)

    runner = model_runner(llm)
    timers = StepTimers()
    timers.wrap(runner, "_update_states", "update states")
    timers.wrap(runner, "_prepare_inputs", "prepare inputs")
    timers.wrap(runner, "_model_forward", "target forward")
    timers.wrap(runner.model, "compute_logits", "target logits")
    timers.wrap(runner, "execute_model", "execute other")
    timers.wrap(runner, "sample_tokens", "sample other")
    timers.wrap(runner, "_sample", "acceptance")
    timers.wrap(runner, "rejection_sampler" if getattr(runner, "rejection_sampler", None) else "sampler", "sampler")
    if getattr(runner, "drafter", None) is not None:
        timers.wrap(runner, "propose_draft_token_ids", "drafter host")
        timers.wrap(runner.drafter, "propose", "draft model")
    if is_parse:
        timers.wrap(runner.parse, "judge", "verification")

    engine = llm.llm_engine
    steps: list[dict] = []
    seen: dict = {}
    lengths: dict[str, int] = {}  # output tokens of each request so far

    class Timed:
        """run_batch's engine: each step timed and given its kind."""

        def add_request(self, *a, **k):
            return engine.add_request(*a, **k)

        def has_unfinished_requests(self):
            return engine.has_unfinished_requests()

        def step(self):
            before = parse_counters(runner.parse) if is_parse else None
            schedule = engine.engine_core.engine_core.scheduler.schedule

            def keep(*a, **k):
                seen["sched"] = schedule(*a, **k)
                return seen["sched"]

            engine.engine_core.engine_core.scheduler.schedule = keep
            try:
                result, parts = timers.step(engine.step)
            finally:
                del engine.engine_core.engine_core.scheduler.schedule
            sched = seen.pop("sched", None)
            if sched is not None:
                kind, rows = step_kind(sched, runner, before, spec_tokens)
                gained = 0  # output tokens the step added (the outputs are cumulative)
                for o in result:
                    n = len(o.outputs[0].token_ids)
                    gained += n - lengths.get(o.request_id, 0)
                    lengths[o.request_id] = n
                steps.append({"kind": kind, "rows": rows, "tokens": gained, "parts": parts})
            return result

    class Shim:
        llm_engine = Timed()

    # py-spy attaches now (main): only the runs below are sampled
    (out / "ready").touch()
    while not (out / "go").exists():
        time.sleep(0.1)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0) for _ in prompts]
    res = run_batch(Shim(), prompts, params, args.batch)
    with (out / "steps.jsonl").open("w") as f:
        for s in steps:
            f.write(json.dumps(s) + "\n")
    stats = parse_vllm.get_stats(llm) if is_parse else None
    (out / "run.json").write_text(
        json.dumps(
            {
                "config": args.config,
                "wall_s": res["wall_s"],
                "tokens": res["tokens"],
                "steps": len(steps),
                "stats": stats,
            },
            indent=1,
        )
    )
    print(f"{args.config}: {res['tokens']} tokens in {res['wall_s']:.1f} s, {len(steps)} steps", flush=True)


def profile_one(args, argv: list[str], config: str, run_dir: Path) -> dict:
    """One configuration's run in a child process, under py-spy unless --no-spy."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for f in ("ready", "go", "run.json", "steps.jsonl", "stacks.txt"):
        (run_dir / f).unlink(missing_ok=True)
    raw = run_dir / "stacks.txt"
    cmd = [sys.executable, __file__, "--child", "--config", config, "--run-dir", str(run_dir), *argv]
    proc = subprocess.Popen(cmd)
    while not (run_dir / "ready").exists():
        if proc.poll() is not None:
            raise SystemExit(f"the profiled run failed (exit {proc.returncode})")
        time.sleep(0.2)
    recorder = None
    if args.spy:
        spy = Path(sys.executable).with_name("py-spy")
        # --nonblocking: read the stacks without pausing the process (pausing its OpenMP
        # threads 50 times a second slowed the run it measures); main thread only (idle
        # helper threads are not the step's time)
        recorder = subprocess.Popen(
            [str(spy), "record", "--nonblocking", "--format", "raw", "-r", str(args.rate), "-o", str(raw)]
            + ["--pid", str(proc.pid)]
        )
        time.sleep(2)  # attached
    (run_dir / "go").touch()
    if proc.wait() != 0:
        raise SystemExit(f"the profiled run failed (exit {proc.returncode})")
    if recorder is not None:
        recorder.wait()
    return load_run(run_dir, config)


def load_run(run_dir: Path, config: str) -> dict:
    """A finished run's results, from its folder (run.json, steps.jsonl, stacks.txt)."""
    raw = run_dir / "stacks.txt"
    run = json.loads((run_dir / "run.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    sampled = []
    if raw.is_file():
        parts = parse_raw(raw)
        total = max(1, sum(parts.values()))
        # seconds per part: its share of the samples times the run's wall time
        sampled = [
            {"part": part, "samples": n, "share": n / total, "seconds": n / total * run["wall_s"]}
            for part, n in parts.most_common()
        ]
    return {"config": config, "run": run, "sampled_parts": sampled, "steps": summarize_steps(steps)}


def summarize_steps(steps: list[dict]) -> dict:
    """Per (kind, rows): steps, mean milliseconds per step by part and in all, and each
    step's total and target forward (the lists `compare` takes medians of)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    tokens: Counter = Counter()
    for s in steps:
        groups[f"{s['kind']} rows={s['rows']}"].append(s["parts"])
        tokens[f"{s['kind']} rows={s['rows']}"] += s.get("tokens", 0)
    out = {}
    for key, group in sorted(groups.items()):
        ms = {p: 1e3 * sum(g.get(p, 0.0) for g in group) / len(group) for p in TIMED_PARTS}
        out[key] = {
            "steps": len(group),
            "tokens": tokens[key],
            "ms": ms,
            "total_ms": sum(ms.values()),
            "step_ms": [1e3 * sum(g.values()) for g in group],
            "part_ms": {p: [1e3 * g.get(p, 0.0) for g in group] for p in TIMED_PARTS},
        }
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return 0.0 if not n else (xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2)


def compare(results: list[dict], key: str) -> dict:
    """Per configuration, the `key` steps pooled over its repeats: mean ms by part, the
    median step and median part, and the median over steps of each part over the step's
    target forward (the same 8 x (k + 1) tokens in every configuration: a slow spell of a
    shared machine slows both, so the ratio holds where the milliseconds do not); each
    repeat's mean and median step."""
    table: dict[str, dict] = {}
    for r in results:
        g = r["steps"].get(key)
        if g is None:
            continue
        t = table.setdefault(r["config"], {"steps": 0, "step_ms": [], "part_ms": defaultdict(list), "repeats": []})
        t["steps"] += g["steps"]
        t["step_ms"] += g["step_ms"]
        for p in TIMED_PARTS:
            t["part_ms"][p] += g["part_ms"][p]
        t["repeats"].append({"mean_ms": round(g["total_ms"], 1), "median_ms": round(_median(g["step_ms"]), 1)})
    out = {}
    for c, t in table.items():
        fwd = t["part_ms"]["target forward"]
        out[c] = {
            "steps": t["steps"],
            "ms": {p: sum(v) / t["steps"] for p, v in t["part_ms"].items()},
            "total_ms": sum(t["step_ms"]) / t["steps"],
            "median_ms": {p: _median(v) for p, v in t["part_ms"].items()},
            "median_step_ms": _median(t["step_ms"]),
            "over_forward": {p: _median([x / f for x, f in zip(v, fwd) if f > 0]) for p, v in t["part_ms"].items()},
            "step_over_forward": _median([x / f for x, f in zip(t["step_ms"], fwd) if f > 0]),
            "repeats": t["repeats"],
        }
    return out


def print_table(table: dict, key: str) -> None:
    configs = list(table)
    print(f"\n{key} steps: mean ms | median ms | median of part / the step's target forward")
    print("| part | " + " | ".join(configs) + " |")
    print("|---|" + "---|" * len(configs))
    for p in TIMED_PARTS:
        cells = [
            f"{table[c]['ms'][p]:.1f} \\| {table[c]['median_ms'][p]:.1f} \\| {table[c]['over_forward'][p]:.3f}"
            for c in configs
        ]
        print(f"| {p} | " + " | ".join(cells) + " |")
    cells = [
        f"**{table[c]['total_ms']:.0f} \\| {table[c]['median_step_ms']:.0f} \\| {table[c]['step_over_forward']:.3f}**"
        for c in configs
    ]
    print("| **step** | " + " | ".join(cells) + " |")
    print("| steps | " + " | ".join(str(table[c]["steps"]) for c in configs) + " |")
    print(
        "| by repeat: mean, median ms | "
        + " | ".join(
            "; ".join(f"{r['mean_ms']:.0f}, {r['median_ms']:.0f}" for r in table[c]["repeats"]) for c in configs
        )
        + " |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="coder")
    ap.add_argument("--split", default="even")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1, help="requests in flight")
    ap.add_argument("--configs", nargs="+", default=["parse"], help="parse, target, kN (module docstring)")
    ap.add_argument("--repeats", type=int, default=1, help="each configuration's runs, interleaved (ABAB)")
    ap.add_argument("--rows", type=int, default=None, help="the compared steps' rows (default: --batch)")
    ap.add_argument("--kind", default="token-level", help="the compared steps' kind (token-level, window, judge)")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--parse", default="{}", help="more PARSE options, JSON")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="the engine's (default: max(8, --batch))")
    ap.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    ap.add_argument("--spy", action=argparse.BooleanOptionalAction, default=True, help="record with py-spy")
    ap.add_argument("--out", type=Path, default=Path("bench/results/profile"))
    ap.add_argument("--report", action="store_true", help="only the tables, from the runs already in --out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    argv = list(argv if argv is not None else sys.argv[1:])
    results = []
    for repeat in range(args.repeats):
        for config in args.configs:
            run_dir = args.out / f"{config}-r{repeat + 1}"
            run = load_run(run_dir, config) if args.report else profile_one(args, argv, config, run_dir)
            results.append({"repeat": repeat, **run})
    key = f"{args.kind} rows={args.rows if args.rows is not None else args.batch}"
    table = compare(results, key)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": results, "compared": key, "table": table}
    (args.out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    for r in results:
        run = r["run"]
        print(
            f"{r['config']} r{r['repeat'] + 1}: {run['tokens']} tokens in {run['wall_s']:.1f} s "
            f"({run['tokens'] / run['wall_s']:.2f} tok/s), {run['steps']} steps"
        )
        for row in r["sampled_parts"]:
            print(
                f"    {row['part']:15s} {row['share']:6.1%} {1e3 * row['seconds'] / max(1, run['steps']):8.1f} ms/step"
            )
    if table:
        print_table(table, key)
    kinds: dict = defaultdict(Counter)
    for r in results:
        for k, g in r["steps"].items():
            kinds[(r["config"], k.split(" ")[0])]["s"] += sum(g["step_ms"]) / 1e3
            kinds[(r["config"], k.split(" ")[0])]["tokens"] += g.get("tokens", 0)
    print("\nby kind of step (all repeats): seconds, output tokens")
    for (c, k), v in sorted(kinds.items()):
        print(f"    {c:8s} {k:12s} {v['s']:8.1f} s {v['tokens']:7d} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
