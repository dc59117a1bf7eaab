"""Load test of PARSE behind `parse-vllm serve`: many concurrent streaming
clients, mixed requests, then checks that nothing went wrong or leaked.

Loopback only and bounded: at most --requests requests, at most
--max-seconds of load, each request at most --request-timeout.

  python scripts/load_test.py --clients 32 --requests 500 --out load.json

Without --base-url it builds tiny random models (the test suite's shapes,
SmolLM2 tokenizer), starts `parse-vllm serve` on 127.0.0.1 itself with
VLLM_SERVER_DEV_MODE=1 (for the worker RPCs below) and stops it afterwards.

What it measures and writes to --out (JSON):

- requests / errors / incomplete: every request streams (chat or completions,
  `return_token_ids`); an error is an HTTP error or an error event in the
  stream; incomplete = no finish_reason or no [DONE], a token count that
  disagrees with `usage`, or not started before --max-seconds ran out.
- mismatches_vs_target: the lossless requests (greedy, and τ > 1 or PARSE
  off) compared token for token with **the target alone**: a second server,
  started after the PARSE one is stopped, with the same target and engine
  flags but no speculative config and no PARSE section, i.e. stock vLLM
  greedy decoding, sent the same lossless requests at the same concurrency.
  (Not PARSE-off requests of the PARSE server itself: those share the PARSE
  runner's code path, so they would not catch a bug in it.)
- leaked_blocks: KV blocks still held once the server is idle again: the
  scheduler's view (/metrics `vllm:kv_cache_usage_perc` times the blocks it
  manages) and the worker's view (blocks in the input batch's block tables,
  RPC `parse_kv_blocks`), whichever is larger. While the load runs, the
  worker itself scans the block tables after every step (parse option
  `audit_kv_blocks`, which this script turns on): `audited_steps`,
  `request_blocks_held_max_during` and `scratch_blocks_in_request_tables_max`
  (a scratch block inside some request's block table; must be 0). Polls of
  the RPC and of /metrics 4 times a second add to these, but a busy machine
  can answer them late, so they are not relied on. `kv_cache_usage_busy`:
  the scheduler's figure read while one long request runs alone after the
  load, showing that the leak check's metric does see held blocks.
  `runner_requests_left` / `parse_request_states_left`: per-request state the
  worker still keeps when idle.
- rss_growth_mb: resident memory of the server process tree (API server,
  engine core, worker) after the load minus after a warm-up of --warmup
  requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from parse_vllm.tools.server_process import ServerProcess, free_port

WORDS = (
    "the river mountain light quickly because sentence answer question model story "
    "dragon history science ocean forest simple explain write describe compare why "
    "how energy city people music number garden winter summer travel engine paper"
).split()

# (weight, extra args for vllm_xargs, lossless?) — lossless: the output must
# be exactly the target's own greedy output.
OPTION_MIX = (
    (35, {"parse_threshold": 1.5}, True),
    (20, {"parse": False}, True),
    (15, None, False),  # the server's default τ
    (15, {"parse_threshold": 0.0}, False),
    (15, {"parse_threshold": 0.5}, False),
)
MAX_TOKENS = ((10, 1), (15, 8), (25, 32), (30, 64), (20, 128))


POLL_ERRORS: list[str] = []  # failed polls of the RPCs and /metrics under load
POLL_INTERVAL_S = 0.25  # often, so even a short load is seen many times
POLL_TIMEOUT_S = 10.0  # one slow answer must not swallow the whole load


@dataclass
class Job:
    idx: int
    endpoint: str  # "chat" | "completions"
    prompt: str
    max_tokens: int
    xargs: dict | None
    lossless: bool
    stop: list[str] | None = None
    ignore_eos: bool = False

    def body(self, model: str) -> dict:
        body: dict = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "ignore_eos": self.ignore_eos,
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.stop:
            body["stop"] = self.stop
        if self.xargs is not None:
            body["vllm_xargs"] = self.xargs
        return body


@dataclass
class Result:
    idx: int
    error: str | None = None
    finish_reason: str | None = None
    done: bool = False
    token_ids: list[int] = field(default_factory=list)
    usage_tokens: int | None = None
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return (
            self.error is None
            and self.done
            and self.finish_reason in ("stop", "length")
            and self.usage_tokens == len(self.token_ids)
        )


def make_jobs(n: int, seed: int) -> list[Job]:
    """Mixed lengths and options, the same for the same (n, seed)."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        kind = rng.random()
        words = rng.randint(1, 8) if kind < 0.4 else rng.randint(20, 80) if kind < 0.85 else rng.randint(150, 350)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        _, xargs, lossless = rng.choices(OPTION_MIX, weights=[w for w, _, _ in OPTION_MIX])[0]
        max_tokens = rng.choices([m for _, m in MAX_TOKENS], weights=[w for w, _ in MAX_TOKENS])[0]
        jobs.append(
            Job(
                idx=i,
                endpoint=rng.choice(("chat", "completions")),
                prompt=prompt,
                max_tokens=max_tokens,
                xargs=dict(xargs) if xargs else None,
                lossless=lossless,
                stop=[". "] if rng.random() < 0.15 else None,
                ignore_eos=rng.random() < 0.2,
            )
        )
    return jobs


def make_warmup_jobs(n: int, seed: int) -> list[Job]:
    """Jobs like the measured ones, every fourth at the largest shapes (350
    words, 128 tokens), so buffers sized by the longest requests exist
    before the memory baseline."""
    jobs = make_jobs(n, seed)
    rng = random.Random(seed)
    for job in jobs[::4]:
        job.prompt = " ".join(rng.choice(WORDS) for _ in range(350))
        job.max_tokens = 128
        job.ignore_eos = True
    return jobs


# -- HTTP ---------------------------------------------------------------------


async def stream_one(client, base: str, model: str, job: Job, timeout: float) -> Result:
    import httpx

    res = Result(job.idx)
    path = "/v1/chat/completions" if job.endpoint == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", base + path, json=job.body(model), timeout=timeout) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    res.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error']}"
                    return res
                if chunk.get("usage"):
                    res.usage_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    res.token_ids.extend(choice.get("token_ids") or ())
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.seconds = time.perf_counter() - t0
    return res


async def run_jobs(
    base: str, model: str, jobs: list[Job], clients: int, deadline: float, request_timeout: float, poll=None
) -> list[Result]:
    """`clients` concurrent streaming clients take jobs in order until none
    are left or the deadline passes; `poll()` (sync) runs every
    POLL_INTERVAL_S meanwhile, in a thread. A failed or slow poll is
    recorded and the next one still runs."""
    import httpx

    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    results: dict[int, Result] = {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client_loop(client):
        while time.time() < deadline:
            try:
                job = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            timeout = max(1.0, min(request_timeout, deadline - time.time()))
            results[job.idx] = await stream_one(client, base, model, job, timeout)

    stop = asyncio.Event()
    poll_errors = POLL_ERRORS

    async def poller():
        while poll is not None and not stop.is_set():
            try:
                await asyncio.to_thread(poll)
            except Exception as e:  # a failed poll is reported, not fatal
                poll_errors.append(f"{type(e).__name__}: {e}")
            try:
                await asyncio.wait_for(stop.wait(), POLL_INTERVAL_S)
            except asyncio.TimeoutError:
                pass

    async with httpx.AsyncClient(limits=limits) as client:
        poll_task = asyncio.create_task(poller())
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        stop.set()
        await poll_task
    return [results.get(j.idx) or Result(j.idx, error=None) for j in jobs]


def get_json(url: str, payload: dict | None = None, timeout: float = 30.0):
    import httpx

    r = httpx.post(url, json=payload, timeout=timeout) if payload is not None else httpx.get(url, timeout=timeout)
    r.raise_for_status()
    return r.json()


def worker_rpc(base: str, method: str, timeout: float = 30.0) -> dict | None:
    """First worker's answer to a PARSE RPC, through vLLM's dev endpoint
    (None when the server was not started with VLLM_SERVER_DEV_MODE=1)."""
    import httpx

    try:
        return get_json(base + "/collective_rpc", {"method": method}, timeout)["results"][0]
    except httpx.HTTPStatusError as e:
        if e.response.status_code == 404:
            return None
        raise


def metric_sum(base: str, name: str, timeout: float = 30.0) -> float | None:
    import httpx

    return metric_in(httpx.get(base + "/metrics", timeout=timeout).text, name)


def metric_in(text: str, name: str) -> float | None:
    """The sum of series `name` over its labels in a /metrics text (None: absent)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if (line.startswith(name + "{") or line.startswith(name + " "))
    ]
    return sum(values) if values else None


# -- processes ----------------------------------------------------------------


class Server(ServerProcess):
    """`parse-vllm serve` on 127.0.0.1 at a free port, stopped on exit."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        exe = shutil.which("parse-vllm", path=os.path.dirname(sys.executable)) or "parse-vllm"
        self.port = free_port()
        env = {**os.environ, **(env or {})}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # parse-vllm serve makes its own
        cmd = [exe, "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        super().__init__(cmd, log_path, f"http://127.0.0.1:{self.port}", env=env)


def rss_by_process_mb(pid: int, extra_pids: tuple[int, ...] = ()) -> dict[str, float]:
    """Resident memory of a process and all its descendants (the API
    server, engine core, worker; with Ray, also the Ray daemons the engine
    started), plus `extra_pids` outside that tree, MiB, by process name."""
    import psutil

    root = psutil.Process(pid)
    procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for extra in extra_pids:
        if extra not in procs and psutil.pid_exists(extra):
            procs[extra] = psutil.Process(extra)
    out: dict[str, float] = {}
    for p in procs.values():
        try:
            name = "api-server" if p.pid == pid else p.name()
            out[name] = out.get(name, 0.0) + p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return {k: round(v, 1) for k, v in sorted(out.items())}


def tree_rss_mb(pid: int, extra_pids: tuple[int, ...] = ()) -> float:
    return sum(rss_by_process_mb(pid, extra_pids).values())


# -- the test -------------------------------------------------------------------


def engine_flags(args) -> list[str]:
    return [
        "--served-model-name",
        args.model_name,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        "32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--kv-cache-memory-bytes",
        str(args.kv_cache_mb << 20),
        "--seed",
        "0",
        "--disable-uvicorn-access-log",
    ]


def parse_flags(args) -> list[str]:
    spec = {"method": "draft_model", "model": str(args.draft), "num_speculative_tokens": args.window}
    parse = {"audit_kv_blocks": True, **json.loads(args.parse)}
    return [
        "--speculative-config",
        json.dumps(spec),
        "--additional-config",
        json.dumps({"parse": parse}),
    ]


def tiny_models(root: Path) -> tuple[Path, Path]:
    """The test suite's tiny random target (4 layers) and draft (2 layers)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fixtures.tiny_models import make_tiny_model

    from parse_vllm.tools.prepare_models import prepare_models

    tok = prepare_models(names=("smollm2-135m-instruct",), progress=False)["smollm2-135m-instruct"]
    shape = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    return (
        make_tiny_model(root / "target", tok, num_layers=4, seed=0, **shape),
        make_tiny_model(root / "draft", tok, num_layers=2, seed=1, **shape),
    )


def wait_idle(base: str, timeout: float = 60.0) -> tuple[float | None, dict | None]:
    """Poll until the scheduler shows no KV in use and the worker holds no
    request; returns the last (kv usage, worker blocks) seen."""
    deadline = time.time() + timeout
    while True:
        usage = metric_sum(base, "vllm:kv_cache_usage_perc")
        blocks = worker_rpc(base, "parse_kv_blocks")
        idle = usage == 0 and (
            blocks is None or (blocks["request_blocks_held"] == 0 and blocks["runner_requests"] == 0)
        )
        if idle or time.time() > deadline:
            return usage, blocks
        time.sleep(0.25)


async def busy_kv_usage(base: str, model: str, max_tokens: int, timeout: float) -> tuple[float, int]:
    """The scheduler's KV usage (/metrics) read while one long request runs
    alone: (highest value seen, reads). Proves the metric behind the
    scheduler-side leak check moves when blocks are held, without relying
    on reads answered under load. The request is dropped (client
    disconnect) once a non-zero value is seen."""
    import httpx

    body = {
        "model": model,
        "prompt": "Count to one thousand: 1, 2, 3,",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    seen, reads = 0.0, 0
    async with httpx.AsyncClient(timeout=timeout) as client:
        async with client.stream("POST", base + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text = (await client.get(base + "/metrics")).text
                reads += 1
                seen = max(seen, metric_in(text, "vllm:kv_cache_usage_perc") or 0.0)
                if seen > 0:
                    break
    return seen, reads


def summarize(results: list[Result]) -> dict:
    lat = sorted(r.seconds for r in results if r.complete)
    return {
        "completion_tokens": sum(len(r.token_ids) for r in results),
        "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
        "latency_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3) if lat else None,
    }


def run_parse_phase(
    args, jobs: list[Job], warmup: list[Job], base: str, server_pid: int | None
) -> tuple[dict, list[Result]]:
    deadline = time.time() + args.max_seconds
    asyncio.run(run_jobs(base, args.model_name, warmup, args.clients, deadline, args.request_timeout))
    _, idle_blocks = wait_idle(base)
    rpc_ok = idle_blocks is not None
    if rpc_ok:
        worker_rpc(base, "parse_reset_kv_audit")  # high-water marks of the measured load only
    # The worker may live outside the server's process tree (a Ray actor).
    worker_pids = (idle_blocks["pid"],) if rpc_ok else ()
    by_process_before = rss_by_process_mb(server_pid, worker_pids) if server_pid else None
    rss_before = by_process_before and sum(by_process_before.values())

    seen = {
        "polls": 0,
        "polls_with_requests": 0,
        "poll_seconds_max": 0.0,
        "scratch_in_tables_max": 0,
        "blocks_held_max": 0,
        "kv_usage_max": 0.0,
        "rss": [],
    }
    POLL_ERRORS.clear()
    t0 = time.time()

    def poll():
        started = time.time()
        try:
            if rpc_ok:
                b = worker_rpc(base, "parse_kv_blocks", POLL_TIMEOUT_S)
                seen["scratch_in_tables_max"] = max(
                    seen["scratch_in_tables_max"], b["scratch_blocks_in_request_tables"]
                )
                seen["blocks_held_max"] = max(seen["blocks_held_max"], b["request_blocks_held"])
                seen["polls_with_requests"] += b["batch_requests"] > 0
            seen["kv_usage_max"] = max(
                seen["kv_usage_max"], metric_sum(base, "vllm:kv_cache_usage_perc", POLL_TIMEOUT_S) or 0.0
            )
            if server_pid:
                seen["rss"].append((round(time.time() - t0, 1), round(tree_rss_mb(server_pid, worker_pids), 1)))
            seen["polls"] += 1
        finally:
            seen["poll_seconds_max"] = max(seen["poll_seconds_max"], time.time() - started)

    deadline = t0 + args.max_seconds
    results = asyncio.run(run_jobs(base, args.model_name, jobs, args.clients, deadline, args.request_timeout, poll))
    wall = time.time() - t0
    audit = worker_rpc(base, "parse_kv_blocks")["audit"] if rpc_ok else None
    kv_busy, kv_busy_reads = asyncio.run(busy_kv_usage(base, args.model_name, 900, args.request_timeout))

    usage, blocks = wait_idle(base)
    time.sleep(2)  # let the allocator settle before measuring
    by_process_after = rss_by_process_mb(server_pid, worker_pids) if server_pid else None
    rss_after = by_process_after and sum(by_process_after.values())
    samples = seen["rss"]
    half = samples[len(samples) // 2][1] if samples else None
    pool = blocks["scheduler_blocks"] if blocks else None
    scheduler_leak = None if usage is None or pool is None else round(usage * (pool - 1))  # -1: vLLM's null block
    worker_leak = blocks["request_blocks_held"] if blocks else None
    leaks = [x for x in (scheduler_leak, worker_leak) if x is not None]
    figures = {
        "wall_s": round(wall, 1),
        "leaked_blocks": max(leaks) if leaks else None,
        "leaked_blocks_scheduler": scheduler_leak,
        "leaked_blocks_worker": worker_leak,
        "kv_cache_usage_after": usage,
        "kv_cache_usage_max_during": seen["kv_usage_max"],
        "kv_blocks": blocks and {k: blocks[k] for k in ("num_blocks", "scratch_blocks", "scheduler_blocks")},
        "kv_cache_usage_busy": kv_busy,
        "kv_cache_usage_busy_reads": kv_busy_reads,
        "audited_steps": audit and audit["steps"],
        "audit_batch_requests_max": audit and audit["batch_requests_max"],
        "request_blocks_held_max_during": None
        if not rpc_ok
        else max(seen["blocks_held_max"], audit["request_blocks_held_max"] if audit else 0),
        "scratch_blocks_in_request_tables_max": None
        if not rpc_ok
        else max(seen["scratch_in_tables_max"], audit["scratch_blocks_in_request_tables_max"] if audit else 0),
        "runner_requests_left": blocks and blocks["runner_requests"],
        "parse_request_states_left": blocks and blocks["parse_request_states"],
        "rpc_polls": seen["polls"],
        "rpc_polls_with_requests": seen["polls_with_requests"] if rpc_ok else None,
        "poll_seconds_max": round(seen["poll_seconds_max"], 2),
        "poll_error_count": len(POLL_ERRORS),
        "poll_errors": POLL_ERRORS[:5],
        "rss_before_mb": rss_before and round(rss_before, 1),
        "rss_after_mb": rss_after and round(rss_after, 1),
        "rss_growth_mb": None if rss_before is None else round(rss_after - rss_before, 1),
        # A leak grows with the requests served; allocator warm-up levels off.
        "rss_growth_second_half_mb": None if half is None else round(rss_after - half, 1),
        "rss_samples_mb": samples[:: max(1, len(samples) // 40)],
        "rss_by_process_before_mb": by_process_before,
        "rss_by_process_after_mb": by_process_after,
        "parse_stats": worker_rpc(base, "parse_stats") if rpc_ok else None,
        "parse_drafts_total_metric": metric_sum(base, "parse:drafts_total"),
    }
    return figures, results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    ap.add_argument("--requests", type=int, default=500, help="requests of the measured run")
    ap.add_argument(
        "--warmup", type=int, default=None, help="warm-up requests before the RSS baseline (default: 2 x --clients)"
    )
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=1800,
        help="time bound of the load (requests not started by then are incomplete)",
    )
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the figures")
    ap.add_argument("--base-url", help="a running PARSE server (else one is started on 127.0.0.1)")
    ap.add_argument("--server-pid", type=int, help="with --base-url: its PID, for the RSS figure")
    ap.add_argument(
        "--no-reference", action="store_true", help="skip the target-alone comparison (mismatches_vs_target: null)"
    )
    ap.add_argument(
        "--reference-url", help="a running target-alone server (else one is started when --target is known)"
    )
    ap.add_argument("--target", type=Path, help="target model (default: a tiny random model)")
    ap.add_argument("--draft", type=Path, help="draft model (default: a tiny random model)")
    ap.add_argument("--model-name", default="tiny", help="served model name")
    ap.add_argument("--window", type=int, default=16, help="draft window W")
    ap.add_argument("--parse", default='{"threshold": 0.5}', help="additional_config['parse'] as JSON")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: --clients")
    ap.add_argument("--kv-cache-mb", type=int, default=128)
    ap.add_argument("--executor", default=None, help="--distributed-executor-backend of the PARSE server (e.g. ray)")
    ap.add_argument("--keep-logs", type=Path, help="directory to keep the server logs in")
    args = ap.parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = args.clients
    if args.warmup is None:
        args.warmup = 2 * args.clients
    for name in ("clients", "requests", "max_num_seqs", "window"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        json.loads(args.parse)
    except json.JSONDecodeError as e:
        ap.error(f"--parse is not JSON: {e}")
    if args.base_url and not args.base_url.startswith(("http://127.", "http://localhost")):
        ap.error("--base-url must be a loopback address (this is a load test)")

    jobs = make_jobs(args.requests, args.seed)
    warmup = make_warmup_jobs(args.warmup, args.seed + 1)
    work = Path(tempfile.mkdtemp(prefix="parse-load-"))
    logs = args.keep_logs or work
    logs.mkdir(parents=True, exist_ok=True)
    if not args.base_url and (args.target is None) != (args.draft is None):
        ap.error("pass both --target and --draft, or neither (tiny models)")
    if not args.base_url and args.target is None:
        args.target, args.draft = tiny_models(work / "models")

    t_start = time.time()
    if args.base_url:
        figures, results = run_parse_phase(args, jobs, warmup, args.base_url.rstrip("/"), args.server_pid)
    else:
        flags = [str(args.target), *engine_flags(args), *parse_flags(args)]
        if args.executor:
            flags += ["--distributed-executor-backend", args.executor]
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        with Server(flags, logs / "parse-server.log", env) as server:
            figures, results = run_parse_phase(args, jobs, warmup, server.base, server.proc.pid)

    lossless = [j for j in jobs if j.lossless]
    ref_results: dict[int, Result] | None = None
    reference = None
    if not args.no_reference and (args.reference_url or args.target is not None):

        def run_ref(base):
            out = asyncio.run(
                run_jobs(
                    base, args.model_name, lossless, args.clients, time.time() + args.max_seconds, args.request_timeout
                )
            )
            return {r.idx: r for r in out}

        if args.reference_url:
            reference = f"target-alone server at {args.reference_url}"
            ref_results = run_ref(args.reference_url.rstrip("/"))
        else:
            reference = (
                "target-alone: stock vLLM server (no speculative config, no PARSE), same target and engine flags"
            )
            with Server([str(args.target), *engine_flags(args)], logs / "reference-server.log") as ref:
                ref_results = run_ref(ref.base)

    by_idx = {r.idx: r for r in results}
    errors = [r for r in results if r.error]
    incomplete = [r for r in results if not r.complete]
    mismatches = None
    mismatch_examples = []
    ref_failures = None
    if ref_results is not None:
        mismatches = 0
        ref_failures = sum(1 for r in ref_results.values() if not r.complete)
        for j in lossless:
            a, b = by_idx[j.idx], ref_results[j.idx]
            if not (a.complete and b.complete):
                continue  # counted as errors/incomplete (or ref_failures)
            if a.token_ids != b.token_ids or a.finish_reason != b.finish_reason:
                mismatches += 1
                if len(mismatch_examples) < 5:
                    first = next(
                        (k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                        min(len(a.token_ids), len(b.token_ids)),
                    )
                    mismatch_examples.append(
                        {
                            "job": asdict(j),
                            "first_difference_at": first,
                            "parse": a.token_ids[: first + 3],
                            "target": b.token_ids[: first + 3],
                        }
                    )
    out = {
        "requests": len(jobs),
        "clients": args.clients,
        "errors": len(errors),
        "incomplete": len(incomplete),
        "mismatches_vs_target": mismatches,
        "lossless_requests_compared": len(lossless) if ref_results is not None else 0,
        "reference": reference,
        "reference_failures": ref_failures,
        **figures,
        **summarize(results),
        "total_s": round(time.time() - t_start, 1),
        "error_examples": [r.error for r in errors[:5]],
        "incomplete_examples": [asdict(r) | {"token_ids": len(r.token_ids)} for r in incomplete[:5]],
        "mismatch_examples": mismatch_examples,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    keys = (
        "requests",
        "errors",
        "incomplete",
        "mismatches_vs_target",
        "leaked_blocks",
        "scratch_blocks_in_request_tables_max",
        "rss_growth_mb",
        "rss_growth_second_half_mb",
        "wall_s",
        "completion_tokens",
    )
    print(json.dumps({k: out[k] for k in keys}))
    if not args.keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
