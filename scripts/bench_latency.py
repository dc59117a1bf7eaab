#!/usr/bin/env python
"""What a PARSE server's other users see: latency under a seeded arrival schedule.

Per pair and batch size B (the server's --max-num-seqs), two servers, one after the
other (time nothing else meanwhile):

  parse    `parse-vllm serve --config <the pair's preset>`: 2B requests arrive at
           seeded exponential gaps; a seeded half have PARSE on (the preset's τ),
           the rest PARSE off (`parse: false`, which drafts nothing);
  target   the same target and engine flags with no speculative config: the same
           requests at the same times, every one plain decoding.

Every request streams and asks for the same number of tokens (ignore_eos), so
work is equal. Per request: time to first token, the gaps between chunks that
carry tokens (inter-token latency, as vLLM's own serving benchmark counts it:
a chunk of several accepted tokens is one gap) and end-to-end time. Then, on
the PARSE server, batch 1: the first PARSE-on requests one at a time (their
end-to-end time). The key figure: p99 ITL of the PARSE-off requests in the
PARSE engine over the same requests' on the target alone.

    python scripts/bench_latency.py --pairs smollm2 coder --batches 8 16 --label before
    python scripts/bench_latency.py --compare before after   # summary.json, itl.png

Writes <out>/<label>/<pair>.json (figures and every request's timings);
--compare writes <out>/summary.json (the issue's keys, per pair) and <out>/itl.png.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import yaml
from bench_cores import QUESTIONS, _paths

from parse_vllm.presets import engine_flag, load_preset
from parse_vllm.tools.server_process import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
# Per pair: its preset, tokens per request, the mean gap between arrivals (s;
# chosen so that about B requests are in flight on this CPU) and batch-1 requests.
PAIRS = {
    "smollm2": dict(
        preset="configs/smollm2-135m-demo.yaml",
        target="smollm2-135m-instruct",
        draft="smollm2-135m-instruct-draft",
        max_tokens=64,
        gap_s=0.4,
        bs1=4,
    ),
    "coder": dict(
        preset="configs/qwen2.5-coder-1.5b-0.5b-cpu.yaml",
        target="qwen2.5-coder-1.5b-instruct",
        draft="qwen2.5-coder-0.5b-instruct",
        max_tokens=48,
        gap_s=2.0,
        bs1=2,
    ),
}


def schedule(n: int, gap_s: float, seed: int) -> list[dict]:
    """n requests: arrival time (s after the start), question, PARSE on or off."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(
            {"idx": i, "at": round(t, 3), "question": QUESTIONS[i % len(QUESTIONS)], "parse": rng.random() < 0.5}
        )
        t += rng.expovariate(1.0 / gap_s)
    return out


async def stream(client, base: str, model: str, job: dict, max_tokens: int, xargs: dict | None) -> dict:
    """One streaming chat request; the times (s, perf_counter) of its chunks that carry tokens."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": job["question"]}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if xargs is not None:
        body["vllm_xargs"] = xargs
    sent = time.perf_counter()
    chunks: list[tuple[float, int]] = []
    usage = None
    async with client.stream("POST", base + "/v1/chat/completions", json=body, timeout=3600) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
            n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices") or ())
            if n:
                chunks.append((time.perf_counter(), n))
    times = [t for t, _ in chunks]
    return {
        "idx": job["idx"],
        "parse": job["parse"],
        "sent": sent,
        "ttft": times[0] - sent,
        "itl": [b - a for a, b in zip(times, times[1:])],
        "e2e": times[-1] - sent,
        "tokens": sum(n for _, n in chunks),
        "usage_tokens": usage,
    }


async def run_schedule(base: str, model: str, jobs: list[dict], max_tokens: int, xargs_of) -> list[dict]:
    import httpx

    start = time.perf_counter()

    async def one(client, job):
        await asyncio.sleep(max(0.0, start + job["at"] - time.perf_counter()))
        return await stream(client, base, model, job, max_tokens, xargs_of(job))

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(jobs))) as client:
        return list(await asyncio.gather(*(one(client, j) for j in jobs)))


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def figures(results: list[dict]) -> dict:
    """Latency figures of a group of requests (s)."""
    itl = [g for r in results for g in r["itl"]]
    return {
        "requests": len(results),
        "tokens": sum(r["tokens"] for r in results),
        "ttft_mean": sum(r["ttft"] for r in results) / len(results) if results else None,
        "e2e_mean": sum(r["e2e"] for r in results) / len(results) if results else None,
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "itl_max": max(itl, default=None),
    }


def summarize(results: list[dict]) -> dict:
    span = max(r["sent"] + r["e2e"] for r in results) - min(r["sent"] for r in results)
    return {
        "all": figures(results),
        "parse_on": figures([r for r in results if r["parse"]]),
        "parse_off": figures([r for r in results if not r["parse"]]),
        "throughput_tok_s": sum(r["tokens"] for r in results) / span,
    }


def server_argv(pair: dict, batch: int, port: int, with_parse: bool) -> tuple[list[str], str]:
    """(the serve command, its model name). PARSE-on requests name no τ: the server's is the
    preset's (a number, or `head`: its judge head's τ_head)."""
    preset = load_preset(ROOT / pair["preset"])
    parse = {**preset.parse, **(pair.get("parse_options") or {})}
    target, draft = pair.get("models") or _paths(pair)
    engine = {**preset.engine, "dtype": "float32", "max_num_seqs": batch}
    flags = [str(target), "--port", str(port), "--host", "127.0.0.1", "--disable-uvicorn-access-log"]
    for key, value in engine.items():
        flags += engine_flag(key, value)
    if with_parse:
        spec = {**preset.speculative_config, "model": str(draft)}
        flags += ["--speculative-config", json.dumps(spec), "--additional-config", json.dumps({"parse": parse})]
    cmd = [sys.executable, "-m", "parse_vllm.cli", "serve", *flags]
    return cmd, str(target)


def request_xargs(engine: str, job: dict) -> dict | None:
    """A request's vllm_xargs: PARSE off where the schedule says so; nothing for PARSE-on
    requests (the server's τ, the preset's) or on the target alone."""
    return {"parse": False} if engine == "parse" and not job["parse"] else None


def measure_pair(
    name: str, batches: list[int], seed: int, models: tuple[Path, Path] | None = None, parse_options: dict | None = None
) -> dict:
    pair = {**PAIRS[name], "models": models, "parse_options": parse_options}
    out: dict = {"pair": name, "preset": pair["preset"], "max_tokens": pair["max_tokens"], "batches": {}}
    if parse_options:
        out["parse_options"] = parse_options
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    for batch in batches:
        jobs = schedule(2 * batch, pair["gap_s"], seed)
        row: dict = {"schedule": jobs}
        for engine in ("parse", "target"):
            port = free_port()
            cmd, model = server_argv(pair, batch, port, engine == "parse")
            log = Path(tempfile.mkstemp(suffix=f"-{name}-{engine}-bs{batch}.log")[1])
            with ServerProcess(cmd, log, f"http://127.0.0.1:{port}", env=env, timeout=900) as server:
                warm = [{"idx": -1, "at": 0.0, "question": QUESTIONS[0], "parse": engine == "parse"}]

                xargs_of = functools.partial(request_xargs, engine)
                asyncio.run(run_schedule(server.base, model, warm, 8, xargs_of))
                results = asyncio.run(run_schedule(server.base, model, jobs, pair["max_tokens"], xargs_of))
                row[engine] = {"figures": summarize(results), "requests": results}
                print(f"[latency] {name} bs={batch} {engine}: {json.dumps(row[engine]['figures'])}", flush=True)
                if engine == "parse" and batch == batches[0]:
                    alone = []
                    for job in [j for j in jobs if j["parse"]][: pair["bs1"]]:
                        alone += asyncio.run(
                            run_schedule(server.base, model, [{**job, "at": 0.0}], pair["max_tokens"], xargs_of)
                        )
                    out["parse_bs1"] = {"figures": figures(alone), "requests": alone}
                    print(f"[latency] {name} bs=1 parse: {json.dumps(out['parse_bs1']['figures'])}", flush=True)
        p, t = row["parse"]["figures"], row["target"]["figures"]
        for group in ("parse_off", "parse_on"):
            a, b = p[group]["itl_p99"], t[group]["itl_p99"]
            row[f"itl_p99_ratio_{group}"] = a / b if a is not None and b else None
        out["batches"][str(batch)] = row
    return out


def compare(out: Path, before: str, after: str | None) -> dict:
    """summary.json: per pair, the within-run ITL ratios of `after` (or `before` alone)
    and, with both labels, today's over the new end-to-end time at batch 1 and the
    new over today's throughput at batch 16."""
    summary: dict = {}
    for path in sorted((out / before).glob("*.json")):
        old = json.loads(path.read_text())
        new = (
            json.loads((out / after / path.name).read_text()) if after and (out / after / path.name).exists() else None
        )
        cur = new or old
        s = {f"itl_p99_ratio_parse_off_bs{b}": r["itl_p99_ratio_parse_off"] for b, r in cur["batches"].items()}
        s["measured"] = after if new else before
        if new:
            s["parse_e2e_ratio_bs1"] = old["parse_bs1"]["figures"]["e2e_mean"] / new["parse_bs1"]["figures"]["e2e_mean"]
            if "16" in old["batches"] and "16" in new["batches"]:
                s["throughput_ratio_bs16"] = (
                    new["batches"]["16"]["parse"]["figures"]["throughput_tok_s"]
                    / old["batches"]["16"]["parse"]["figures"]["throughput_tok_s"]
                )
        summary[old["pair"]] = s
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(out, [(label, out / label) for label in (before, after) if label and (out / label).exists()])
    return summary


def plot(out: Path, runs: list[tuple[str, Path]]) -> None:
    """itl.png: the ITL distribution (CDF) of PARSE-off requests per engine, pair and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = sorted({p.name for _, d in runs for p in d.glob("*.json")})
    fig, axes = plt.subplots(1, len(files), figsize=(6 * len(files), 4), squeeze=False)
    for ax, fname in zip(axes[0], files):
        for label, d in runs:
            if not (d / fname).exists():
                continue
            data = json.loads((d / fname).read_text())
            for b, row in data["batches"].items():
                for engine in ("parse", "target") if label == runs[0][0] else ("parse",):
                    itl = sorted(g for r in row[engine]["requests"] if not r["parse"] for g in r["itl"])
                    if itl:
                        ys = [(i + 1) / len(itl) for i in range(len(itl))]
                        ax.step(itl, ys, where="post", label=f"{engine if engine == 'target' else label} bs{b}")
        ax.set_xscale("log")
        ax.set_xlabel("inter-token latency of PARSE-off requests (s)")
        ax.set_ylabel("fraction of gaps")
        ax.set_title(fname.removesuffix(".json"))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "itl.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", nargs="+", default=["smollm2", "coder"], choices=list(PAIRS))
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 16])
    ap.add_argument("--label", default="before", help="a name for this code's figures (<out>/<label>/)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--parse-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one of the preset's PARSE options (e.g. draft_chunk=4); repeatable",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "latency")
    ap.add_argument(
        "--models", nargs=2, type=Path, metavar=("TARGET", "DRAFT"), help="other models in the pair's settings (tests)"
    )
    ap.add_argument("--compare", nargs="+", metavar="LABEL", help="BEFORE [AFTER]: write summary.json and itl.png")
    args = ap.parse_args(argv)
    if args.compare:
        if len(args.compare) > 2:
            ap.error("--compare takes BEFORE and at most one AFTER")
        print(
            json.dumps(compare(args.out, args.compare[0], args.compare[1] if len(args.compare) > 1 else None), indent=2)
        )
        return 0
    (args.out / args.label).mkdir(parents=True, exist_ok=True)
    for name in args.pairs:
        options = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.parse_option)}
        result = measure_pair(name, sorted(args.batches), args.seed, args.models, options)
        (args.out / args.label / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
