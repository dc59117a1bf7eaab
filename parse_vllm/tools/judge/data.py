"""The judge's training data for one prompt set, built in resumable stages under one folder.

1. **answers** (``answers.jsonl``) -- the draft alone answers every prompt: greedy, plus
   ``samples`` sampled answers (``temperature``, one seed per task), rendered as ``parse-vllm
   eval`` renders prompts, ``max_tokens`` as the eval.
2. **boundaries** (``checks.jsonl`` -> ``boundaries.jsonl``) -- each distinct answer (stop
   token dropped) is checked by its tests (its whole-answer label) and cut as the runtime cuts
   drafts: consecutive windows of W tokens, ``BoundaryRule.select`` within each, as absolute
   prefix lengths; the whole answer is always one. Of the other boundaries, a few per answer
   are drawn at random (seeded) to be labelled: ``prefixes_failing`` of an answer that fails
   its tests, ``prefixes_passing`` of one that passes (stratified: the prefixes that cost
   correctness are almost all in failing answers, so they get most of the continuations).
   Each drawn prefix weighs (the answer's boundaries but the whole) / (those drawn): weighted,
   the prefixes stand for every runtime boundary of every answer.
3. **labels** (``target.jsonl``, ``continuations.jsonl`` -> ``labels.jsonl``) -- a whole answer
   by its tests; a prefix by whether the target, continuing greedily from prompt + prefix,
   passes them, on the tasks the target alone passes only (elsewhere no prefix can be
   accepted without cost: the label would be the task's, not the prefix's). Greedy decoding
   is deterministic, so a prefix needs no generation of its own when it lies on a text the
   target already wrote greedily from a shorter prefix: the target's own answer (from the
   empty prefix) or an earlier continuation (:class:`TargetPath`). Continuations are asked
   shortest prefix first, so longer prefixes of the same answer can ride on them.
4. **features** (``features.npy`` [N, H] float32, ``zero_shot.npy`` [N], ``index.jsonl``) --
   the target's final hidden state (after the final norm) at the last token of prompt + prefix
   + chat suffix (the runtime's verification suffix without the label extension), through
   vLLM's pooling runner (LAST pooling, no activation, prefix caching), and the zero-shot
   log-odds log P(Correct) - log P(Incorrect) at the same place.

5. **evidence** (optional, ``--evidence``; ``token_evidence.jsonl`` -> ``evidence.npy`` [N, 4])
   -- the target's log-probability of every token of every distinct answer and whether its
   greedy token differs (vLLM ``prompt_logprobs``, one prefill per answer), then per example
   the cheap evidence features of ``parse_vllm.evidence`` over the tokens of the W-token
   window its boundary ends in, as the runtime reads them from the step's logits.

Balance (optional, ``--balance-samples``): in the boundaries stage, once every answer is
checked, the tasks where the draft rarely fails (the share of its failing distinct answers
<= ``below``) and the target alone passes (the target's answers are written first, to
``target.jsonl``, which the labels stage then reuses) get ``samples`` more answers at a
higher ``temperature`` (source "balance"): more failing answers, hence failing prefixes,
where there were few.

A stage writes ``<stage>.done.json`` (its settings, counts and seconds) when complete and is
skipped when rerun; a stage cut short (the time bound, a crash) resumes where its files end.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

STAGES = ("answers", "boundaries", "labels", "features")
EVIDENCE_STAGE = "evidence"  # optional, after the others
BASELINES_STAGE = "baselines"  # optional, last: the judges the head is compared with (baselines.py)
SOURCE_ORDER = {"greedy": 0, "sample": 1, "balance": 2}  # distinct answers are numbered in this order
CALL_BATCHES = 3  # an engine call holds this many engine batches (max_num_seqs) of requests
TASKS_PER_FEATURE_CALL = 8


class DataError(RuntimeError):
    """The data folder cannot be used as asked (built with other settings, files missing)."""


class TimeBound(Exception):
    """The time bound was reached between two batches; everything done so far is on disk."""


@dataclass
class Deadline:
    seconds: float | None  # None: no bound
    start: float = field(default_factory=time.monotonic)

    def check(self) -> None:
        if self.seconds is not None and time.monotonic() - self.start >= self.seconds:
            raise TimeBound


@dataclass(frozen=True)
class DataSettings:
    """What the data depends on; a stage refuses a folder built with other values."""

    set_name: str
    target: str
    draft: str
    window: int  # W: the runtime judges windows of this many draft tokens
    boundaries: dict[str, Any]  # BoundaryRule's mode, every, max_boundaries
    question: str
    labels: tuple[str, str]
    samples: int  # sampled answers per prompt, beside the greedy one
    temperature: float
    seed: int
    max_tokens: int
    prefixes_passing: int  # prefixes labelled per answer that passes its tests
    prefixes_failing: int  # ... per answer that fails them
    tasks: tuple[str, ...]
    # more answers where the draft rarely fails: {"samples", "temperature", "below"}; None: off
    balance: dict[str, Any] | None = None

    # the settings each stage's output depends on (its own and its inputs')
    def of(self, stage: str) -> dict[str, Any]:
        d = asdict(self)
        keys = ["set_name", "draft", "samples", "temperature", "seed", "max_tokens", "tasks"]
        if stage in ("boundaries", "labels", "features", EVIDENCE_STAGE, BASELINES_STAGE):
            keys += ["target", "window", "boundaries", "prefixes_passing", "prefixes_failing"]
            if self.balance is not None:  # (absent when off: folders built before it still match)
                keys += ["balance"]
        if stage == "features":
            keys += ["question", "labels"]
        return {k: d[k] for k in keys}


@dataclass(frozen=True)
class Request:
    """One generation: ``n`` completions of ``prompt_ids``."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None


class VllmWriter:
    """Completions from a vLLM engine (``LLM(**engine)``, built on first use): requests ->
    per request, its n completions' token ids."""

    def __init__(self, engine: dict[str, Any]):
        self.engine = engine
        self.llm = None

    def __call__(self, requests: list[Request]) -> list[list[list[int]]]:
        from parse_vllm._vllm import LLM, SamplingParams

        if self.llm is None:
            self.llm = LLM(**self.engine)
        params = [
            SamplingParams(n=r.n, temperature=r.temperature, seed=r.seed, max_tokens=r.max_tokens) for r in requests
        ]
        outs = self.llm.generate([{"prompt_token_ids": list(r.prompt_ids)} for r in requests], params, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    def close(self) -> None:
        if self.llm is not None:
            from parse_vllm.tools.engine import close

            close(self.llm)
            self.llm = None


class HiddenReader:
    """The target as a vLLM pooling model: the final hidden state (after the final norm, no
    activation, not normalised) at each sequence's last token. Prefix caching keeps the
    prompt and answer KV across the copies that share them."""

    def __init__(self, engine: dict[str, Any]):
        self.engine = dict(
            engine,
            runner="pooling",
            convert="embed",
            pooler_config={"pooling_type": "LAST", "use_activation": False},
            enable_prefix_caching=True,
        )
        self.llm = None

    def __call__(self, sequences: list[list[int]]) -> np.ndarray:
        from parse_vllm._vllm import LLM

        if self.llm is None:
            self.llm = LLM(**self.engine)
        outs = self.llm.encode([{"prompt_token_ids": s} for s in sequences], pooling_task="embed", use_tqdm=False)
        return np.stack([np.asarray(o.outputs.data, dtype=np.float32) for o in outs])

    def close(self) -> None:
        if self.llm is not None:
            from parse_vllm.tools.engine import close

            close(self.llm)
            self.llm = None


def open_writer(engine: dict[str, Any]) -> VllmWriter:
    """The draft's or the target's writer (the tests replace it with scripted models)."""
    return VllmWriter(engine)


def open_reader(engine: dict[str, Any]) -> HiddenReader:
    return HiddenReader(engine)


class LogprobReader:
    """The target's log-probability of every token of each sequence after its first, and
    whether its greedy token differs (vLLM ``prompt_logprobs=1``: the token's own logprob
    and rank, raw logits), as [2, len - 1] float32 per sequence."""

    def __init__(self, engine: dict[str, Any]):
        # Every prompt token's logits are computed (and log-softmaxed) in a step: steps of at
        # most max_model_len tokens (the least a step without chunked prefill may hold) keep
        # that at ~1k x vocab floats instead of the other engines' 4k.
        mlen = engine.get("max_model_len")
        self.engine = dict(engine, enable_prefix_caching=False, **({"max_num_batched_tokens": mlen} if mlen else {}))
        self.llm = None

    def __call__(self, sequences: list[list[int]]) -> list[np.ndarray]:
        from parse_vllm._vllm import LLM, SamplingParams

        if self.llm is None:
            self.llm = LLM(**self.engine)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        outs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        result = []
        for seq, o in zip(sequences, outs):
            rows = o.prompt_logprobs[1:]
            ev = np.zeros((2, len(seq) - 1), dtype=np.float32)
            for j, (tok, d) in enumerate(zip(seq[1:], rows)):
                lp = d[tok]
                ev[0, j] = lp.logprob
                ev[1, j] = float(lp.rank != 1)
            result.append(ev)
        return result

    def close(self) -> None:
        if self.llm is not None:
            from parse_vllm.tools.engine import close

            close(self.llm)
            self.llm = None


def open_logprob_reader(engine: dict[str, Any]) -> LogprobReader:
    return LogprobReader(engine)


# -- files ---------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSONL file (a line cut short by a killed run is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def append_jsonl(path: Path, rows: Iterable[dict]) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    with open(path, "a+") as f:
        f.seek(0, 2)
        if f.tell():
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":  # a line cut short: ours start on a line of their own
                text = "\n" + text
        f.write(text)
        f.flush()


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def chunks(xs: list, n: int) -> Iterator[list]:
    for i in range(0, len(xs), max(1, n)):
        yield xs[i : i + n]


# -- the job -------------------------------------------------------------------------------


@dataclass
class Job:
    """One prompt set's data folder and what builds it."""

    folder: Path
    settings: DataSettings
    items: list[dict]  # the prompt set's items (tasks.py), in order
    prompt_ids: dict[str, list[int]]  # task id -> rendered prompt
    tokenizer: Any  # the target's
    template: Any  # templates.VerificationTemplate of the target
    rule: Any  # boundaries.BoundaryRule
    draft_engine: dict[str, Any]  # LLM(...) arguments of the draft engine
    target_engine: dict[str, Any]  # ... of the target's engines
    batch: int  # requests per engine call
    deadline: Deadline
    code_timeout: float
    log: Callable[[str], None] = print
    timings: dict[str, float] = field(default_factory=dict)
    evidence: bool = False  # build the evidence stage too
    # The tasks that get balance answers, from the distinct greedy and sampled answers, where they
    # are known (rebuilding the answers a score table names, tables.py): no target answers needed.
    balance_tasks: Callable[[list[dict]], list[str]] | None = None
    # more stages after the others, (name, function of the job): the baselines stage
    # (baselines.py, which builds on this module's files and readers)
    extra_stages: list[tuple[str, Callable[[Job], None]]] = field(default_factory=list)

    def path(self, name: str) -> Path:
        return self.folder / name

    def done(self, stage: str) -> dict | None:
        p = self.path(f"{stage}.done.json")
        if not p.is_file():
            return None
        info = json.loads(p.read_text())
        if info.get("settings") != json.loads(json.dumps(self.settings.of(stage))):
            raise DataError(
                f"{self.folder}: its {stage} stage was built with other settings ({p}); use another data "
                "folder, or delete it to rebuild"
            )
        return info

    def check_partial(self, stage: str) -> None:
        """A stage resumed from partial files must have been started with the same settings."""
        p = self.path(f"{stage}.settings.json")
        want = json.loads(json.dumps(self.settings.of(stage)))
        if p.is_file():
            if json.loads(p.read_text()) != want:
                raise DataError(
                    f"{self.folder}: a {stage} stage with other settings was started here ({p}); use another "
                    "data folder, or delete it to rebuild"
                )
        else:
            p.write_text(json.dumps(want, indent=1) + "\n")

    def mark_done(self, stage: str, **counts) -> None:
        info = {"settings": self.settings.of(stage), "seconds": round(self.seconds(stage), 1), **counts}
        self.path(f"{stage}.done.json").write_text(json.dumps(info, indent=1) + "\n")

    def add_seconds(self, stage: str, seconds: float) -> None:
        p = self.path("timings.json")
        t = json.loads(p.read_text()) if p.is_file() else {}
        t[stage] = round(t.get(stage, 0.0) + seconds, 2)
        p.write_text(json.dumps(t, indent=1) + "\n")

    def seconds(self, stage: str) -> float:
        p = self.path("timings.json")
        return json.loads(p.read_text()).get(stage, 0.0) if p.is_file() else 0.0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_texts(self, texts: list[tuple[str, str]]) -> list[bool]:
        """(task id, text) -> passed its tests; code runs in subprocesses, two at a time."""
        from parse_vllm.tools.eval import checks

        spec = {it["id"]: it["check"] for it in self.items}

        def one(tt):
            return bool(checks.check(tt[1], spec[tt[0]], timeout=self.code_timeout))

        with ThreadPoolExecutor(max_workers=2) as pool:
            return list(pool.map(one, texts))


class _Clock:
    """Seconds spent in a stage, added to timings.json batch by batch (so a resumed stage's
    cost is the sum of its runs)."""

    def __init__(self, job: Job, stage: str):
        self.job, self.stage, self.t = job, stage, time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        self.job.add_seconds(self.stage, now - self.t)
        self.t = now


def _eta(done: int, total: int, seconds: float) -> str:
    if done <= 0 or done >= total:
        return ""
    return f", ~{seconds / done * (total - done) / 60:.0f} min left"


def strip_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    """An answer as the runtime's drafts hold it: without its trailing stop token(s)."""
    end = len(tokens)
    while end and tokens[end - 1] in stop_ids:
        end -= 1
    return list(tokens[:end])


def stop_ids(tokenizer) -> set[int]:
    return {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}


# -- stage 1: answers ----------------------------------------------------------------------


def task_seed(seed: int, task: str) -> int:
    """The sampled answers' seed of one task: fixed by (seed, task id) whatever the batch."""
    return zlib.crc32(f"{seed}:{task}".encode()) & 0x7FFFFFFF


def stage_answers(job: Job) -> None:
    if job.done("answers"):
        return
    job.check_partial("answers")
    s = job.settings
    path = job.path("answers.jsonl")
    got: dict[str, set] = {}
    for r in read_jsonl(path):
        got.setdefault(r["task"], set()).add((r["source"], r["index"]))
    want = {("greedy", 0), *(("sample", k) for k in range(s.samples))}
    have = {t for t, g in got.items() if want <= g}  # a run killed mid-write leaves a task incomplete
    todo = [it["id"] for it in job.items if it["id"] not in have]
    per_call = max(1, CALL_BATCHES * job.batch // (1 + s.samples))  # tasks per call
    writer = open_writer(job.draft_engine) if todo else None
    clock = _Clock(job, "answers")
    t0 = time.perf_counter()
    try:
        for n, batch in enumerate(chunks(todo, per_call)):
            reqs, owners = [], []
            for task in batch:
                p = tuple(job.prompt_ids[task])
                reqs.append(Request(p, s.max_tokens))
                owners.append((task, "greedy"))
                if s.samples:
                    reqs.append(Request(p, s.max_tokens, s.samples, s.temperature, task_seed(s.seed, task)))
                    owners.append((task, "sample"))
            outs = writer(reqs)
            rows = []
            for (task, source), completions in zip(owners, outs):
                for k, toks in enumerate(completions):
                    rows.append({"task": task, "source": source, "index": k, "token_ids": toks})
            # one write per batch of tasks: a task's answers are on disk together or not at all
            append_jsonl(path, rows)
            clock.tick()
            done = min(len(todo), (n + 1) * per_call)
            job.log(
                f"answers: {len(have) + done}/{len(job.items)} tasks, {job.seconds('answers') / 60:.1f} min"
                + _eta(done, len(todo), time.perf_counter() - t0)
            )
            job.deadline.check()
    finally:
        if writer is not None:
            writer.close()
    job.mark_done("answers", tasks=len(job.items), answers=len(job.items) * (1 + s.samples))


# -- stage 2: boundaries -------------------------------------------------------------------


def window_boundaries(rule, answer: np.ndarray, window: int) -> list[int]:
    """Absolute prefix lengths the runtime would judge: ``rule.select`` within each
    consecutive window of ``window`` tokens; every window's end (the whole answer last)."""
    out: list[int] = []
    for start in range(0, len(answer), window):
        out += [start + int(b) for b in rule.select(answer[start : start + window])]
    return out


def distinct_answers(job: Job) -> list[dict]:
    """Each task's distinct answers (stop token dropped, empty ones dropped), the greedy one
    first: ``{"task", "answer", "sources", "token_ids"}``."""
    stops = stop_ids(job.tokenizer)
    by_task: dict[str, dict[tuple[str, int], dict]] = {}
    for r in read_jsonl(job.path("answers.jsonl")):  # a task written again (a killed run): its last answers
        by_task.setdefault(r["task"], {})[(r["source"], r["index"])] = r
    out = []
    for it in job.items:
        seen: dict[tuple[int, ...], dict] = {}
        for r in sorted(by_task.get(it["id"], {}).values(), key=lambda r: (SOURCE_ORDER[r["source"]], r["index"])):
            toks = tuple(strip_stop(r["token_ids"], stops))
            source = f"{r['source']}-{r['index']}"
            if toks and toks in seen:
                seen[toks]["sources"].append(source)
            elif toks:
                seen[toks] = {"task": it["id"], "answer": len(seen), "sources": [source], "token_ids": list(toks)}
        out += list(seen.values())
    return out


def stage_boundaries(job: Job) -> None:
    if job.done("boundaries"):
        return
    job.check_partial("boundaries")
    clock = _Clock(job, "boundaries")
    s = job.settings
    answers = distinct_answers(job)
    cpath = job.path("checks.jsonl")
    _check_answers(job, answers, clock)
    if s.balance is not None:
        _balance(job, answers, clock)
        answers = distinct_answers(job)
        _check_answers(job, answers, clock)
    whole = {(r["task"], r["answer"]): r["passed"] for r in read_jsonl(cpath)}
    for a in answers:
        a["passed"] = whole[(a["task"], a["answer"])]
        bounds = window_boundaries(job.rule, np.asarray(a["token_ids"], dtype=np.int64), s.window)
        inner = bounds[:-1]
        n = min(s.prefixes_passing if a["passed"] else s.prefixes_failing, len(inner))
        rng = np.random.default_rng([s.seed, zlib.crc32(a["task"].encode()), a["answer"]])
        a["boundaries"] = bounds
        a["selected"] = sorted(int(b) for b in rng.choice(inner, size=n, replace=False))
        a["prefix_weight"] = len(inner) / n if n else 0.0
    write_jsonl(job.path("boundaries.jsonl"), answers)
    clock.tick()
    job.log(
        f"boundaries: {sum(a['passed'] for a in answers)} of {len(answers)} distinct draft answers pass their tests"
    )
    job.mark_done(
        "boundaries",
        answers=len(answers),
        answers_passing=sum(a["passed"] for a in answers),
        duplicates_dropped=sum(len(a["sources"]) - 1 for a in answers),
        boundaries=sum(len(a["boundaries"]) for a in answers),
        selected_prefixes=sum(len(a["selected"]) for a in answers),
        **({"balanced_tasks": _balanced_tasks(job)} if s.balance is not None else {}),
    )


def _check_answers(job: Job, answers: list[dict], clock: _Clock) -> None:
    """Each distinct answer's tests, once (checks.jsonl)."""
    cpath = job.path("checks.jsonl")
    checked = {(r["task"], r["answer"]) for r in read_jsonl(cpath)}
    for batch in chunks([a for a in answers if (a["task"], a["answer"]) not in checked], 64):
        passed = job.check_texts([(a["task"], job.decode(a["token_ids"])) for a in batch])
        append_jsonl(cpath, [{"task": a["task"], "answer": a["answer"], "passed": p} for a, p in zip(batch, passed)])
        clock.tick()
        job.deadline.check()


def rarely_failing(answers: list[dict], passed: dict[tuple[str, int], bool], below: float) -> list[str]:
    """Tasks whose share of failing distinct answers (greedy and sampled only) is <= below,
    in order of first appearance."""
    by_task: dict[str, list[bool]] = {}
    for a in answers:
        if any(src.split("-")[0] != "balance" for src in a["sources"]):
            by_task.setdefault(a["task"], []).append(passed[(a["task"], a["answer"])])
    return [t for t, p in by_task.items() if p and (len(p) - sum(p)) / len(p) <= below]


def _target_answers(job: Job, clock: _Clock, writer=None) -> tuple[dict[str, dict], Any]:
    """The target's own greedy answers (target.jsonl), written where missing (the labels
    stage reads the same file), and the target's writer if one was opened (the caller's to
    close)."""
    s = job.settings
    stops = stop_ids(job.tokenizer)
    tpath = job.path("target.jsonl")
    have = {r["task"] for r in read_jsonl(tpath)}
    todo = [it["id"] for it in job.items if it["id"] not in have]
    for batch in chunks(todo, CALL_BATCHES * job.batch):
        writer = writer or open_writer(job.target_engine)
        outs = writer([Request(tuple(job.prompt_ids[t]), s.max_tokens) for t in batch])
        toks = [strip_stop(o[0], stops) for o in outs]
        passed = job.check_texts([(t, job.decode(x)) for t, x in zip(batch, toks)])
        append_jsonl(tpath, [{"task": t, "token_ids": x, "passed": p} for t, x, p in zip(batch, toks, passed)])
        clock.tick()
        job.log(f"labels: the target's own answers, {len(read_jsonl(tpath))}/{len(job.items)} tasks")
        job.deadline.check()
    return {r["task"]: r for r in read_jsonl(tpath)}, writer


def _balanced_tasks(job: Job) -> list[str]:
    return sorted({r["task"] for r in read_jsonl(job.path("answers.jsonl")) if r["source"] == "balance"})


def _balance(job: Job, answers: list[dict], clock: _Clock) -> None:
    """More sampled answers (source "balance") on the tasks where the draft rarely fails and
    the target passes (module docstring)."""
    s, bal = job.settings, job.settings.balance
    cpath = job.path("checks.jsonl")
    passed = {(r["task"], r["answer"]): r["passed"] for r in read_jsonl(cpath)}
    if job.balance_tasks is not None:
        tasks = job.balance_tasks(answers)
    else:
        twriter = None
        try:
            target, twriter = _target_answers(job, clock)
        finally:
            if twriter is not None:
                twriter.close()
        tasks = [t for t in rarely_failing(answers, passed, float(bal["below"])) if target[t]["passed"]]
    path = job.path("answers.jsonl")
    done = {r["task"] for r in read_jsonl(path) if r["source"] == "balance"}
    todo = [t for t in tasks if t not in done]
    n = int(bal["samples"])
    job.log(f"balance: {len(tasks)} tasks where the draft rarely fails and the target passes; {n} more answers each")
    if not todo or n < 1:
        return
    writer = open_writer(job.draft_engine)
    try:
        for batch in chunks(todo, max(1, CALL_BATCHES * job.batch // n)):
            reqs = [
                Request(
                    tuple(job.prompt_ids[t]), s.max_tokens, n, float(bal["temperature"]), task_seed(s.seed + 7919, t)
                )
                for t in batch
            ]
            outs = writer(reqs)
            rows = [
                {"task": t, "source": "balance", "index": k, "token_ids": toks}
                for t, completions in zip(batch, outs)
                for k, toks in enumerate(completions)
            ]
            append_jsonl(path, rows)
            clock.tick()
            job.log(f"balance: {len(done) + len(rows) // n}/{len(tasks)} tasks")
            done |= set(batch)
            job.deadline.check()
    finally:
        writer.close()


# -- stage 3: labels -----------------------------------------------------------------------


@dataclass(frozen=True)
class TargetPath:
    """A text the target wrote greedily from prompt + tokens[:start] (stop token dropped):
    greedy decoding from any prefix of it at least ``start`` long writes the same text."""

    start: int
    tokens: tuple[int, ...]
    passed: bool

    def covers(self, prefix: tuple[int, ...]) -> bool:
        return self.start <= len(prefix) <= len(self.tokens) and self.tokens[: len(prefix)] == prefix


def resolve(prefix: tuple[int, ...], paths: list[TargetPath]) -> TargetPath | None:
    return next((p for p in paths if p.covers(prefix)), None)


def stage_labels(job: Job) -> None:
    if job.done("labels"):
        return
    job.check_partial("labels")
    s = job.settings
    stops = stop_ids(job.tokenizer)
    answers = read_jsonl(job.path("boundaries.jsonl"))
    clock = _Clock(job, "labels")

    writer = None
    try:
        # the target's own greedy answers
        target, writer = _target_answers(job, clock, writer)
        job.log(f"labels: the target alone passes {sum(r['passed'] for r in target.values())} of {len(target)} tasks")

        # prefixes on the tasks the target passes: continuations, shortest prefix first
        ppath = job.path("continuations.jsonl")
        paths: dict[str, list[TargetPath]] = {
            t: [TargetPath(0, tuple(r["token_ids"]), r["passed"])] for t, r in target.items()
        }
        for r in read_jsonl(ppath):
            paths[r["task"]].append(TargetPath(r["start"], tuple(r["token_ids"]), r["passed"]))
        wanted = [
            (a["task"], a["answer"], tuple(a["token_ids"][:b]))
            for a in answers
            if target[a["task"]]["passed"]
            for b in a["selected"]
        ]
        asked = len(read_jsonl(ppath))
        while True:
            open_ = [w for w in wanted if resolve(w[2], paths[w[0]]) is None]
            if not open_:
                break
            shortest: dict[tuple[str, int], tuple[int, ...]] = {}
            for task, k, prefix in open_:  # each answer's shortest open prefix this round
                if (task, k) not in shortest or len(prefix) < len(shortest[(task, k)]):
                    shortest[(task, k)] = prefix
            batch = list(dict.fromkeys((task, p) for (task, _), p in shortest.items()))[: CALL_BATCHES * job.batch]
            writer = writer or open_writer(job.target_engine)
            outs = writer([Request(tuple(job.prompt_ids[t]) + p, s.max_tokens - len(p)) for t, p in batch])
            full = [list(p) + strip_stop(o[0], stops) for (_, p), o in zip(batch, outs)]
            passed = job.check_texts([(t, job.decode(x)) for (t, _), x in zip(batch, full)])
            rows = [
                {"task": t, "start": len(p), "token_ids": x, "passed": ok} for (t, p), x, ok in zip(batch, full, passed)
            ]
            append_jsonl(ppath, rows)
            for r in rows:
                paths[r["task"]].append(TargetPath(r["start"], tuple(r["token_ids"]), r["passed"]))
            asked += len(batch)
            clock.tick()
            left = len([w for w in wanted if resolve(w[2], paths[w[0]]) is None])
            job.log(
                f"labels: {asked} continuations written, {len(wanted) - left}/{len(wanted)} prefixes labelled, "
                f"{job.seconds('labels') / 60:.1f} min"
            )
            job.deadline.check()
    finally:
        if writer is not None:
            writer.close()

    rows, how_counts = [], {}
    for a in answers:
        t = a["task"]
        rows.append({"task": t, "answer": a["answer"], "kind": "whole", "length": len(a["token_ids"]),
                     "label": a["passed"], "how": "tests", "weight": 1.0})  # fmt: skip
        for b in a["selected"]:
            label, how = None, "target fails the task"
            if target[t]["passed"]:
                p = resolve(tuple(a["token_ids"][:b]), paths[t])
                label = p.passed
                how = "target answer" if p.start == 0 else "own continuation" if p.start == b else "shared continuation"
            rows.append({"task": t, "answer": a["answer"], "kind": "prefix", "length": b, "label": label, "how": how,
                         "weight": a["prefix_weight"]})  # fmt: skip
            how_counts[how] = how_counts.get(how, 0) + 1
    write_jsonl(job.path("labels.jsonl"), rows)
    clock.tick()
    job.mark_done(
        "labels",
        target_passes=sum(r["passed"] for r in target.values()),
        tasks=len(target),
        continuations=len(read_jsonl(job.path("continuations.jsonl"))),
        prefixes_by_source=how_counts,
    )


# -- stage 4: features ---------------------------------------------------------------------


def lm_head_rows(model: Path, rows: list[int] | None = None) -> np.ndarray:
    """The target's LM-head weight [vocab, H] (or only ``rows``), float32: ``lm_head.weight``,
    or the input embedding where the head is tied to it."""
    import torch
    from safetensors import safe_open

    cfg = json.loads((model / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    names = ["lm_head.weight"]
    if cfg.get("tie_word_embeddings", False):
        names = ["model.embed_tokens.weight", "embed_tokens.weight", "lm_head.weight"]
    index = model / "model.safetensors.index.json"
    files = (
        {n: model / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        if index.is_file()
        else {n: model / "model.safetensors" for n in names}
    )
    for name in names:
        if name not in files or not files[name].is_file():
            continue
        with safe_open(str(files[name]), framework="pt") as f:
            if name not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                continue
            t = f.get_slice(name)
            w = t[:] if rows is None else torch.stack([t[int(r) : int(r) + 1][0] for r in rows])
            return w.to(torch.float32).numpy()
    raise DataError(f"{model}: no LM-head weight ({' or '.join(names)}) in its safetensors files")


def zero_shot_logits(template, model: Path, hidden: np.ndarray, extension_hidden: np.ndarray | None) -> np.ndarray:
    """log P(Correct) - log P(Incorrect) [N] from the hidden states at the chat suffix's last
    token [N, H] (and at the label extension's tokens [N, E, H], for a label of several
    tokens). For one-token labels the log-softmax normaliser cancels: (W_yes - W_no) · h."""
    import torch

    labels = template.labels
    if not labels.extension:
        w = lm_head_rows(model, [labels.yes_ids[0], labels.no_ids[0]])
        return (hidden.astype(np.float64) @ (w[0] - w[1]).astype(np.float64)).astype(np.float32)
    w = torch.from_numpy(lm_head_rows(model))
    out = []
    for i in range(0, len(hidden), 256):
        h = torch.from_numpy(hidden[i : i + 256])[:, None, :]
        rows = torch.cat([h, torch.from_numpy(extension_hidden[i : i + 256])], dim=1)  # [n, rows, H]
        logits = rows.reshape(-1, rows.shape[-1]) @ w.T
        yes, no = labels.log_probs(logits)
        out.append((yes - no).numpy())
    return np.concatenate(out).astype(np.float32)


def feature_rows(job: Job) -> list[dict]:
    """The labelled examples, in order: every whole answer, and the prefixes with a label."""
    return [r for r in read_jsonl(job.path("labels.jsonl")) if r["label"] is not None]


def task_groups(job: Job, rows: list[dict]) -> tuple[dict[str, list[int]], list[list[str]]]:
    """The rows' numbers by task, and the tasks in the set's order in groups of
    TASKS_PER_FEATURE_CALL: the calls of a stage that reads the target's hidden states, one
    resumable part file each."""
    order = {it["id"]: i for i, it in enumerate(job.items)}
    by_task: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_task.setdefault(r["task"], []).append(i)
    return by_task, list(chunks(sorted(by_task, key=order.__getitem__), TASKS_PER_FEATURE_CALL))


def stage_features(job: Job) -> None:
    if job.done("features"):
        return
    job.check_partial("features")
    rows = feature_rows(job)
    answers = {(a["task"], a["answer"]): a["token_ids"] for a in read_jsonl(job.path("boundaries.jsonl"))}
    suffix = list(job.template.chat_suffix_ids)
    ext = list(job.template.labels.extension)
    parts = job.path("features")
    parts.mkdir(exist_ok=True)
    by_task, groups = task_groups(job, rows)
    reader = None
    clock = _Clock(job, "features")
    try:
        for g, group in enumerate(groups):
            part = parts / f"part-{g:05d}.npz"
            if part.is_file():
                continue
            # whole answers first, in a call of their own: their KV blocks are in the prefix
            # cache when the copies of their prefixes come
            ids = [i for t in group for i in by_task[t] if rows[i]["kind"] == "whole"]
            ids += [i for t in group for i in by_task[t] if rows[i]["kind"] == "prefix"]
            n_whole = sum(rows[i]["kind"] == "whole" for i in ids)
            seqs = []
            for i in ids:
                r = rows[i]
                base = job.prompt_ids[r["task"]] + answers[(r["task"], r["answer"])][: r["length"]] + suffix
                seqs += [base + ext[:j] for j in range(len(ext) + 1)]
            reader = reader or open_reader(job.target_engine)
            cut = n_whole * (len(ext) + 1)
            h = np.concatenate([reader(part_seqs) for part_seqs in (seqs[:cut], seqs[cut:]) if part_seqs])
            h = h.reshape(len(ids), len(ext) + 1, -1)
            tmp = part.with_name(part.stem + ".tmp.npz")
            np.savez(tmp, rows=np.asarray(ids, dtype=np.int64), hidden=h[:, 0], extension_hidden=h[:, 1:])
            tmp.replace(part)  # a killed run leaves no half-written part
            clock.tick()
            job.log(
                f"features: {g + 1}/{len(groups)} groups of tasks ({len(ids)} examples), "
                f"{job.seconds('features') / 60:.1f} min"
            )
            job.deadline.check()
    finally:
        if reader is not None:
            reader.close()
    loaded = [np.load(parts / f"part-{g:05d}.npz") for g in range(len(groups))]
    size = loaded[0]["hidden"].shape[1]
    hidden = np.zeros((len(rows), size), dtype=np.float32)
    ext_hidden = np.zeros((len(rows), len(ext), size), dtype=np.float32)
    for z in loaded:
        hidden[z["rows"]] = z["hidden"]
        ext_hidden[z["rows"]] = z["extension_hidden"]
    zs = zero_shot_logits(job.template, Path(job.settings.target), hidden, ext_hidden if ext else None)
    np.save(job.path("features.npy"), hidden)
    np.save(job.path("zero_shot.npy"), zs)
    keys = ("task", "answer", "kind", "length", "label", "how", "weight")
    write_jsonl(job.path("index.jsonl"), ({"row": i, **{k: r[k] for k in keys}} for i, r in enumerate(rows)))
    clock.tick()
    job.mark_done("features", rows=len(rows), hidden_size=size)


# -- stage 5 (optional): evidence ------------------------------------------------------------


def example_evidence(rows: list[dict], tokens: dict[tuple[str, int], np.ndarray], window: int) -> np.ndarray:
    """[N, 4] the evidence features (parse_vllm.evidence) of each example: over the answer's
    tokens from the start of the W-token window its boundary (its length) ends in, to it.
    `tokens[(task, answer)]`: [2, len] per-token log-probability and greedy mismatch."""
    from parse_vllm.evidence import EVIDENCE_FEATURES, prefix_features, window_start

    out = np.zeros((len(rows), len(EVIDENCE_FEATURES)), dtype=np.float64)
    for i, r in enumerate(rows):
        ev = tokens[(r["task"], r["answer"])]
        start = window_start(r["length"], window)
        out[i] = prefix_features(ev[0, start:], ev[1, start:], [r["length"] - start])[0]
    return out


def stage_evidence(job: Job) -> None:
    if job.done(EVIDENCE_STAGE):
        return
    job.check_partial(EVIDENCE_STAGE)
    rows = feature_rows(job)
    answers = {(a["task"], a["answer"]): a["token_ids"] for a in read_jsonl(job.path("boundaries.jsonl"))}
    needed = list(dict.fromkeys((r["task"], r["answer"]) for r in rows))
    path = job.path("token_evidence.jsonl")
    have = {(r["task"], r["answer"]) for r in read_jsonl(path)}
    todo = [key for key in needed if key not in have]
    clock = _Clock(job, EVIDENCE_STAGE)
    reader = open_logprob_reader(job.target_engine) if todo else None
    try:
        for n, batch in enumerate(chunks(todo, CALL_BATCHES * job.batch)):
            seqs = [job.prompt_ids[t] + answers[(t, a)] for t, a in batch]
            outs = reader(seqs)
            rows_out = []
            for (t, a), ev in zip(batch, outs):
                p = len(job.prompt_ids[t])
                ev = np.asarray(ev)[:, p - 1 :]  # the answer's tokens: predicted from position p - 1 on
                rows_out.append(
                    {"task": t, "answer": a, "logprob": [round(float(x), 5) for x in ev[0]],
                     "mismatch": [int(x) for x in ev[1]]}
                )  # fmt: skip
            append_jsonl(path, rows_out)
            clock.tick()
            job.log(
                f"evidence: {len(have) + min(len(todo), (n + 1) * CALL_BATCHES * job.batch)}/{len(needed)} answers, "
                f"{job.seconds(EVIDENCE_STAGE) / 60:.1f} min"
            )
            job.deadline.check()
    finally:
        if reader is not None:
            reader.close()
    tokens = {
        (r["task"], r["answer"]): np.array([r["logprob"], r["mismatch"]], dtype=np.float64) for r in read_jsonl(path)
    }
    np.save(job.path("evidence.npy"), example_evidence(rows, tokens, job.settings.window))
    clock.tick()
    job.mark_done(EVIDENCE_STAGE, rows=len(rows), answers=len(needed))


def build(job: Job) -> None:
    """Every stage, each skipped when done (evidence and the extra stages only when the job asks)."""
    job.folder.mkdir(parents=True, exist_ok=True)
    stages = list(zip(STAGES, (stage_answers, stage_boundaries, stage_labels, stage_features)))
    if job.evidence:
        stages.append((EVIDENCE_STAGE, stage_evidence))
    stages += job.extra_stages
    for stage, fn in stages:
        if job.done(stage):
            job.log(f"{stage}: done before ({job.path(stage + '.done.json')})")
            continue
        fn(job)
        job.log(f"{stage}: done, {job.seconds(stage) / 60:.1f} min of work")
