#!/usr/bin/env python
"""Where a PARSE window's time goes, batch 1: py-spy over one in-process engine.

Runs PARSE (one engine, in this process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so one
profile sees the scheduler, the runner and the models) over the first N HumanEval tasks
of a split, one request at a time, under `py-spy record` (sampling, native frames off),
then sorts every sample into the part of the step it belongs to, by the innermost
frame that names one (in this order: a drafter's logits are the drafter's):

  drafter        ParseRunnerMixin.propose_draft_token_ids (catch-up and drafting)
  verification   ParseController.judge (the suffix copies' forward and label logits)
  acceptance     the rest of ParseRunnerMixin._sample (rejection sampler, guard, step)
  logits         compute_logits of the target's forward
  target forward the rest of GPUModelRunner.execute_model (the window's forward)
  engine         everything else (scheduling, bookkeeping, detokenizing, Python)

and divides by the windows PARSE drafted (its `drafts` counter). Prints a table and writes
<out>/profile.json (with the raw collapsed stacks beside it).

    python scripts/profile_parse.py --pair coder --tasks 4 --window 128 --threshold 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (part, frame function name, frame file suffix): the innermost match of a sample decides.
PARTS = (
    ("drafter", "propose_draft_token_ids", "parse_vllm/runner.py"),
    ("verification", "judge", "parse_vllm/controller.py"),
    ("acceptance", "_sample", "parse_vllm/runner.py"),
    ("target logits", "compute_logits", ""),
    ("target forward", "execute_model", "gpu_model_runner.py"),
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


def child(args) -> None:
    """The profiled run (in the process py-spy records)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams

    import parse_vllm
    from parse_vllm.tools.benchmarks import common
    from parse_vllm.tools.eval import tasks
    from parse_vllm.tools.prompts import chat_prompt_ids

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_cores import PAIRS, _paths

    target, draft = _paths(PAIRS[args.pair])
    parse = {"threshold": args.threshold, **json.loads(args.parse)}
    llm = LLM(
        **common.parse_engine(target, draft, args.window, parse, max_model_len=4096, max_num_seqs=8, dtype="float32")
    )
    tok = llm.get_tokenizer()
    items = tasks.humaneval_set(args.split).take(args.tasks)
    prompts = [chat_prompt_ids(tok, it["prompt"]) for it in items]
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4))  # warm-up
    parse_vllm.reset_stats(llm)
    # py-spy attaches now (main): only the runs below are sampled
    (Path(args.out) / "ready").touch()
    while not (Path(args.out) / "go").exists():
        time.sleep(0.1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    t = time.perf_counter()
    tokens = 0
    for p in prompts:
        tokens += len(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
    wall = time.perf_counter() - t
    Path(args.out, "run.json").write_text(
        json.dumps({"wall_s": wall, "tokens": tokens, "stats": parse_vllm.get_stats(llm)}, indent=1)
    )
    print(f"{tokens} tokens in {wall:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="coder")
    ap.add_argument("--split", default="even")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--parse", default="{}", help="more PARSE options, JSON")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    ap.add_argument("--out", type=Path, default=Path("bench/results/profile"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args)
        return 0
    for f in ("ready", "go", "run.json"):
        (args.out / f).unlink(missing_ok=True)
    raw = args.out / "stacks.txt"
    proc = subprocess.Popen([sys.executable, __file__, "--child", *(argv if argv is not None else sys.argv[1:])])
    while not (args.out / "ready").exists():
        if proc.poll() is not None:
            raise SystemExit(f"the profiled run failed (exit {proc.returncode})")
        time.sleep(0.2)
    spy = Path(sys.executable).with_name("py-spy")
    recorder = subprocess.Popen(
        # --nonblocking: read the stacks without pausing the process (pausing its OpenMP
        # threads 50 times a second slowed the run it measures); main thread only (idle
        # helper threads are not the step's time)
        [
            str(spy),
            "record",
            "--nonblocking",
            "--format",
            "raw",
            "-r",
            str(args.rate),
            "-o",
            str(raw),
            "--pid",
            str(proc.pid),
        ]
    )
    time.sleep(2)  # attached
    (args.out / "go").touch()
    if proc.wait() != 0:
        raise SystemExit(f"the profiled run failed (exit {proc.returncode})")
    recorder.wait()
    run = json.loads((args.out / "run.json").read_text())
    parts = parse_raw(raw)
    total = sum(parts.values())
    windows = max(1, run["stats"]["drafts"])
    # seconds per part: its share of the samples times the run's wall time
    rows = [
        {"part": part, "samples": n, "share": n / total, "seconds": n / total * run["wall_s"]}
        for part, n in parts.most_common()
    ]
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "run": run, "parts": rows, "windows": windows}
    (args.out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{run['tokens']} tokens in {run['wall_s']:.1f} s ({run['tokens'] / run['wall_s']:.2f} tok/s), "
        f"{windows} windows drafted, {total} samples"
    )
    print("| part | share | s | s per window |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['part']} | {r['share']:.1%} | {r['seconds']:.1f} | {r['seconds'] / windows:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
