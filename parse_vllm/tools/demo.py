"""`parse-vllm demo --tasks N`: PARSE at work on the first N even HumanEval tasks, one at a
time (batch 1), beside the target alone: per task the windows the judge saw and what it
made of each boundary, the tokens taken semantically against token-level and against the
target's own, the tests' verdict and the time; then the totals.

The tasks are the first N even ids (HumanEval/0, /2, /4, ...), the split everything of
this pair was tuned on (the judge head included), not picked by how PARSE does on them.

A window's judgments are read back from the engine (`record_judgments`): one record per
judged copy, keyed by the request's context length when it was judged (the prompt and
the tokens before the window), so the records of one window are those with the same
context. Worked example at τ 0.7, two-stage judging (the whole window first, its
boundaries only when it fails), answer positions counted after a 100-token prompt:

  answer token 20:  boundary 128 P 0.91       → taken whole: 128 tokens
  answer token 149: boundary 128 P 0.40, then
               boundaries 31 P 0.88, 64 P 0.52, 97 P 0.81, 128 P 0.40
                                              → the longest prefix whose boundaries all
                                                pass: 31 tokens (64 fails; 97 passing
                                                after it does not count)
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from parse_vllm.judge_head import judgment_passes

# Peak resident memory of a demo run, by pair (`make demo` on the 2-core CPU machine of
# README: 16.2 GB for the coder pair). Pairs not listed are not checked.
PEAK_RSS = {"coder": 16.2e9}


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of the memory new work can take without swapping (MemAvailable,
    in bytes); None where /proc/meminfo is missing or lacks it."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:
        pass
    return None


def memory_shortfall(need: float, available: int | None) -> str | None:
    """A plain sentence when `available` bytes are fewer than `need`; None when they suffice
    or the amount is unknown."""
    if available is None or available >= need:
        return None
    return (
        f"This machine has {available / 1e9:.1f} GB of memory available and the demo peaks at "
        f"{need / 1e9:.1f} GB: it may be killed for lack of memory part-way. Close other programs, "
        "or run the small pair (`parse-vllm demo --pair smollm2`)."
    )


def route_vllm_output(log_path: Path) -> None:
    """Send what vLLM and the libraries under it write -- its loggers, Python warnings,
    progress bars, native libraries' messages -- to `log_path`, in this process and the
    engine processes it starts, so the terminal shows the demo's own lines (stdout). vLLM's
    errors and an uncaught exception's traceback reach the terminal as well.

    Everything goes by standard error: file descriptor 2 (where C libraries and Python's
    sys.stderr write) becomes the log, and engine processes inherit it with the environment,
    where VLLM_LOGGING_CONFIG_PATH sets their vLLM loggers up the same way."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(2), "w", buffering=1, errors="backslashreplace")
    os.dup2(log_fd, 2)
    os.close(log_fd)
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"}},
        "handlers": {"log": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "plain"}},
        "loggers": {
            "vllm": {"handlers": ["log"], "level": "INFO", "propagate": False},
            "py.warnings": {"handlers": ["log"], "propagate": False},
        },
    }
    config_path = log_path.with_name(log_path.name + ".logging.json")
    config_path.write_text(json.dumps(config))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)
    os.environ["TQDM_DISABLE"] = "1"  # tqdm reads its defaults from TQDM_* when first imported
    logging.config.dictConfig(config)  # vLLM's logger may be set up already in this process
    errors = logging.StreamHandler(terminal)
    errors.setLevel(logging.ERROR)
    logging.getLogger("vllm").addHandler(errors)
    logging.captureWarnings(True)
    default_hook = sys.excepthook

    def excepthook(kind, value, tb):
        default_hook(kind, value, tb)  # into the log, beside what led to it
        sys.stderr = terminal
        default_hook(kind, value, tb)

    sys.excepthook = excepthook


def begin(pair: str, log_path: Path | None = None) -> Path:
    """The demo's first lines: where vLLM's log goes (routed there), and whether the memory
    the pair needs is available. Returns the log's path."""
    if log_path is None:
        log_path = Path(tempfile.gettempdir()) / f"parse-vllm-demo-{time.strftime('%Y%m%d-%H%M%S')}.log"
    route_vllm_output(log_path)
    print(f"vLLM's own log: {log_path}")
    if pair in PEAK_RSS:
        short = memory_shortfall(PEAK_RSS[pair], mem_available())
        print(short or f"memory: {PEAK_RSS[pair] / 1e9:.1f} GB needed at peak, and available")
    return Path(log_path)


@dataclass
class WindowJudged:
    """One window's judgments, in the order they were made."""

    start: int  # answer tokens before the window
    boundaries: list[int] = field(default_factory=list)  # [judged copies]
    p_yes: list[float] = field(default_factory=list)  # [judged copies]
    passed: list[bool] = field(default_factory=list)  # [judged copies]

    @property
    def taken(self) -> int:
        """The judge's prefix: the largest boundary with every boundary up to it passing
        (a boundary judged twice, as two-stage judging does at the window's end, counts by
        its last judgment)."""
        last: dict[int, bool] = {}
        for b, ok in zip(self.boundaries, self.passed):
            last[b] = ok
        taken = 0
        for b in sorted(last):
            if not last[b]:
                break
            taken = b
        return taken

    @property
    def length(self) -> int:
        return max(self.boundaries, default=0)

    def verdict(self) -> str:
        if self.taken == self.length:
            return f"taken whole: {self.taken} tokens"
        if self.taken == 0:
            return "rejected at its first boundary: 0 tokens"
        return f"cut: {self.taken} of {self.length} tokens"

    def line(self) -> str:
        judged = " ".join(
            f"{b}:{p:.2f}{'✓' if ok else '✗'}" for b, p, ok in zip(self.boundaries, self.p_yes, self.passed)
        )
        return f"window at answer token {self.start}: P(correct) at boundary {judged} → {self.verdict()}"


def windows_of(judgments: list[dict], tau: float, prompt_len: int) -> list[WindowJudged]:
    """The windows of one request's judgment records (controller.judgments: token_ids =
    context + draft[:boundary], logit = the judge's log-odds), by context, in order."""
    windows: dict[int, WindowJudged] = {}
    for j in judgments:
        start = len(j["token_ids"]) - int(j["boundary"]) - prompt_len
        w = windows.setdefault(start, WindowJudged(start))
        w.boundaries.append(int(j["boundary"]))
        w.p_yes.append(float(j["p_yes"]))
        w.passed.append(bool(judgment_passes(np.array([j["logit"]]), tau)[0]))
    return [windows[c] for c in sorted(windows)]


@dataclass
class TaskRun:
    """One task's answer by one engine."""

    tokens: int
    seconds: float
    passed: bool | None
    semantic: int = 0  # tokens taken by the judge
    token_level: int = 0  # draft tokens taken token by token
    windows: list[WindowJudged] = field(default_factory=list)


def share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "—"


def task_lines(name: str, parse: TaskRun, target: TaskRun | None) -> list[str]:
    """A task's block: its windows, where its tokens came from, tests and time."""

    def tests(ok: bool | None) -> str:
        return "—" if ok is None else ("pass" if ok else "FAIL")

    by_target = parse.tokens - parse.semantic - parse.token_level
    lines = [f"{name}: {len(parse.windows)} window(s) judged"]
    lines += [f"  {w.line()}" for w in parse.windows]
    lines.append(
        f"  PARSE's {parse.tokens} tokens: {parse.semantic} taken semantically ({share(parse.semantic, parse.tokens)}), "
        f"{parse.token_level} token-level ({share(parse.token_level, parse.tokens)}), {by_target} written by the target"
    )
    lines.append(
        f"  tests: PARSE {tests(parse.passed)}" + ("" if target is None else f", target alone {tests(target.passed)}")
    )
    if target is not None:
        lines.append(
            f"  time: PARSE {parse.seconds:.1f} s ({parse.tokens} tokens), target alone {target.seconds:.1f} s "
            f"({target.tokens} tokens): {target.seconds / parse.seconds:.2f}x"
        )
    return lines


def total_lines(parse: list[TaskRun], target: list[TaskRun] | None) -> list[str]:
    tokens = sum(r.tokens for r in parse)
    semantic = sum(r.semantic for r in parse)
    token_level = sum(r.token_level for r in parse)
    windows = [w for r in parse for w in r.windows]
    whole = sum(w.taken == w.length for w in windows)
    rejected = sum(w.taken == 0 for w in windows)
    lines = [
        f"totals over {len(parse)} tasks: {len(windows)} windows judged ({whole} taken whole, "
        f"{len(windows) - whole - rejected} cut, {rejected} rejected at their first boundary)",
        f"  PARSE's {tokens} tokens: {share(semantic, tokens)} taken semantically, {share(token_level, tokens)} "
        f"token-level, {share(tokens - semantic - token_level, tokens)} written by the target",
    ]
    checked = [r.passed for r in parse if r.passed is not None]
    if target is not None:
        t_checked = [r.passed for r in target if r.passed is not None]
        secs, t_secs = sum(r.seconds for r in parse), sum(r.seconds for r in target)
        lines.append(
            f"  tests passed: PARSE {sum(checked)}/{len(checked)}, target alone {sum(t_checked)}/{len(t_checked)}"
        )
        lines.append(
            f"  time: PARSE {secs:.1f} s, target alone {t_secs:.1f} s: {t_secs / secs:.2f}x on the same tasks "
            "(one run each, batch 1, this machine, the target first: a process runs its later engine slower, so "
            "this leans against PARSE; `parse-vllm eval` measures with repeats and intervals)"
        )
    elif checked:
        lines.append(f"  tests passed: PARSE {sum(checked)}/{len(checked)}")
    return lines


def run_tasks(llm, tasks: list[dict], params, tau: float, *, parse: bool) -> list[TaskRun]:
    """Each task alone through `llm` (a warmed engine), timed; with PARSE, its counters and
    judgments read after each."""
    import parse_vllm
    from parse_vllm.tools.eval import checks

    runs = []
    for task in tasks:
        if parse:
            parse_vllm.reset_stats(llm)
            seen = len(parse_vllm.get_judgments(llm))
        t0 = time.perf_counter()
        result = llm.chat([{"role": "user", "content": task["prompt"]}], params, use_tqdm=False)[0]
        secs = time.perf_counter() - t0
        out = result.outputs[0]
        run = TaskRun(len(out.token_ids), secs, checks.check(out.text, task.get("check")))
        if parse:
            counts = parse_vllm.get_request_stats(llm)[result.request_id]
            run.semantic, run.token_level = counts["semantic"], counts["token_level"]
            run.windows = windows_of(parse_vllm.get_judgments(llm)[seen:], tau, len(result.prompt_token_ids))
        runs.append(run)
    return runs
