#!/usr/bin/env python
"""How many cores the model gets on a CPU, by engine mode.

vLLM's CPU engine, by default, is an engine-core process plus a worker
process; the worker is bound to the cores vLLM does not reserve for the
engine core (one of two here), and the engine core spins on the worker's
shared-memory queue while it computes. Each mode below runs in a fresh
process, one after the other (time nothing else meanwhile):

  mp         vLLM's default (VLLM_ENABLE_V1_MULTIPROCESSING=1, mp executor)
  mp-all     the same with the worker bound to every core
             (VLLM_CPU_OMP_THREADS_BIND=0-<n-1>): it shares one with the spinning engine core
  inproc     VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core and worker in the
             caller's process (uni executor), no queue, torch's threads on every core;
             with --server, the worker in the engine-core process (the API server
             is a process of its own either way)

Per mode and pair: decode tokens/s of the target alone (batch 1), the
prefill time of a long prompt, and PARSE tokens/s at batch 1 and 8 (tau 0.5).
Writes <out>/cores.json and prints a markdown table.

    python scripts/bench_cores.py --pairs smollm2 coder --out bench/cores
    python scripts/bench_cores.py --pairs smollm2 coder --out bench/cores --server
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = {
    "mp": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    "mp-all": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"},
    "inproc": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
}
# Per pair: (target, draft) model names, W, decode tokens, PARSE tokens per request.
PAIRS = {
    "smollm2": dict(
        target="smollm2-135m-instruct",
        draft="smollm2-135m-instruct-draft",
        window=48,
        decode=128,
        parse_tokens=128,
        prefill=1200,
    ),
    "coder": dict(
        target="qwen2.5-coder-1.5b-instruct",
        draft="qwen2.5-coder-0.5b-instruct",
        window=128,
        decode=48,
        parse_tokens=128,
        prefill=1200,
    ),
}
QUESTIONS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts the words in a sentence and returns a dict of counts.",
    "Write a Python function that returns the prime numbers below n (sieve of Eratosthenes).",
    "Write a Python function that flattens a nested list of integers.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that returns the longest common prefix of a list of strings.",
]


def _paths(pair: dict) -> tuple[Path, Path]:
    from parse_vllm.tools.prepare_models import DEMO_DRAFT_NAME, prepare_demo_draft, prepare_models

    target = prepare_models(names=(pair["target"],), progress=False)[pair["target"]]
    if pair["draft"] == DEMO_DRAFT_NAME:
        return target, prepare_demo_draft(progress=False)
    return target, prepare_models(names=(pair["draft"],), progress=False)[pair["draft"]]


def measure(pair_name: str) -> dict:
    """One mode's figures for one pair (run in its own process, the mode set in its environment)."""
    from vllm import LLM, SamplingParams

    from parse_vllm.tools import engine
    from parse_vllm.tools.benchmarks import common

    pair = PAIRS[pair_name]
    target, draft = _paths(pair)
    base = dict(max_model_len=4096, max_num_seqs=8, dtype="float32")
    out: dict = {}
    llm = LLM(**common.engine_kwargs(target, **base))
    tok = llm.get_tokenizer()
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4))  # warm-up
    t = time.perf_counter()
    o = llm.generate(
        [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=pair["decode"], temperature=0, ignore_eos=True)
    )
    out["decode_tok_s"] = len(o[0].outputs[0].token_ids) / (time.perf_counter() - t)
    long = (tok.encode(" ".join(QUESTIONS)) * 40)[: pair["prefill"]]
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": long}], SamplingParams(max_tokens=1))
    out["prefill_s"] = time.perf_counter() - t
    out["prefill_tokens"] = len(long)
    engine.close(llm)

    kw = common.parse_engine(target, draft, pair["window"], {"threshold": 0.5}, **base)
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=pair["parse_tokens"], temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4))  # warm-up
    for batch in (1, 8):
        r = engine.run_batch(llm, prompts[:batch], [params] * batch, batch)
        out[f"parse_tok_s_bs{batch}"] = r["tok_s"]
    engine.close(llm)
    return out


def measure_server(pair_name: str, port: int) -> dict:
    """The same figures through `parse-vllm serve` (one PARSE engine; the target alone is a
    request with PARSE off, which drafts nothing) and its HTTP API."""
    import concurrent.futures
    import tempfile

    import requests
    from transformers import AutoTokenizer

    from parse_vllm.tools.server_process import ServerProcess

    pair = PAIRS[pair_name]
    target, draft = _paths(pair)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": pair["window"]}
    cmd = [
        sys.executable,
        "-m",
        "parse_vllm.cli",
        "serve",
        str(target),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "8",
        "--enforce-eager",
        "--block-size",
        "32",
        "--kv-cache-memory-bytes",
        str(2 << 30),
        "--speculative-config",
        json.dumps(spec),
        "--additional-config",
        json.dumps({"parse": {"threshold": 0.5}}),
    ]
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    with ServerProcess(cmd, log, f"http://127.0.0.1:{port}", timeout=900) as server:
        base = server.base
        tok = AutoTokenizer.from_pretrained(target)
        prompts = [
            tok.encode(
                tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
            for q in QUESTIONS
        ]

        def complete(ids, max_tokens, **xargs):
            body = {
                "model": str(target),
                "prompt": ids,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "vllm_xargs": xargs,
            }
            r = requests.post(base + "/v1/completions", json=body, timeout=3600)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        complete(prompts[0], 4, parse=False)  # warm-up
        out = {}
        t = time.perf_counter()
        n = complete(prompts[0], pair["decode"], parse=False)
        out["decode_tok_s"] = n / (time.perf_counter() - t)
        long = (tok.encode(" ".join(QUESTIONS)) * 40)[: pair["prefill"]]
        t = time.perf_counter()
        complete(long, 1, parse=False)
        out["prefill_s"], out["prefill_tokens"] = time.perf_counter() - t, len(long)
        for batch in (1, 8):
            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                n = sum(pool.map(lambda p: complete(p, pair["parse_tokens"], parse_threshold=0.5), prompts[:batch]))
            out[f"parse_tok_s_bs{batch}"] = n / (time.perf_counter() - t)
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", nargs="+", default=["smollm2", "coder"], choices=list(PAIRS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--out", type=Path, default=Path("bench/cores"))
    ap.add_argument("--server", action="store_true", help="through `parse-vllm serve` and HTTP instead of LLM(...)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--one", nargs=2, metavar=("PAIR", "MODE"), help=argparse.SUPPRESS)  # a child run
    args = ap.parse_args(argv)
    if args.one:
        result = measure_server(args.one[0], args.port) if args.server else measure(args.one[0])
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    rows = []
    for pair in args.pairs:
        for mode in args.modes:
            env = {**os.environ, **MODES[mode], "VLLM_LOGGING_LEVEL": "WARNING"}
            t = time.perf_counter()
            child = [sys.executable, __file__, "--one", pair, mode, "--port", str(args.port)]
            proc = subprocess.run(
                child + (["--server"] if args.server else []), env=env, capture_output=True, text=True
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{pair}/{mode} failed (exit {proc.returncode})")
            rows.append(
                {
                    "pair": pair,
                    "mode": mode,
                    "path": "server" if args.server else "offline",
                    **json.loads(line[7:]),
                    "wall_s": time.perf_counter() - t,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    from parse_vllm.tools.benchmarks import common

    name = "cores-server.json" if args.server else "cores.json"
    (args.out / name).write_text(json.dumps({"machine": common.machine(), "rows": rows}, indent=1) + "\n")
    print("| pair | mode | decode tok/s | prefill s (tokens) | PARSE tok/s bs 1 | PARSE tok/s bs 8 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['pair']} | {r['mode']} | {r['decode_tok_s']:.2f} | {r['prefill_s']:.1f} ({r['prefill_tokens']}) | "
            f"{r['parse_tok_s_bs1']:.2f} | {r['parse_tok_s_bs8']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
