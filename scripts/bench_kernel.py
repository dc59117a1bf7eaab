#!/usr/bin/env python
"""Benchmark of the CPU twin of torch.ops.parse_vllm.prefix_verify_attention.

Side by side, in one process, on the same inputs, for each (context, K):

  twin      parse_vllm.ops.prefix_verify_attention (the compiled CPU op)
  dense     all copies in ONE masked attention call with a dense [T, keys] mask
            (parse_vllm.ops.reference.prefix_verify_attention_dense_ref, SDPA)
  per-copy  K separate attention calls, one per copy: gather the copy's prefix
            from the paged cache, append its suffix, SDPA with a [L, P+L] mask

Setting (one request, like one PARSE verification pass): a context of N cached
tokens = prompt (N/2) + draft (N/2); copy k (k = 1..K) sees prompt +
draft[:k * (N/2) / K] (nested prefixes, the longest is the whole context); each
copy has an L-token verification suffix.  Model shape per layer: Hq query
heads, Hkv kv heads, head size D (defaults: 8 / 2 / 128, GQA 4), block size 16.

Time: median (or --stat min) over repetitions after a warm-up, the three
methods timed round-robin in this process on the same inputs.  Peak memory: measured in a child process per
(context, K) -- the rise of the peak RSS (VmHWM, reset through
/proc/self/clear_refs) during one call of each method, with glibc's mmap
threshold pinned at 64 KiB (MALLOC_MMAP_THRESHOLD_) so that freed buffers leave
the RSS; timing runs without that setting, which would slow the baselines'
large allocations down.  Inputs (cache, q, ...) are not counted.

    python scripts/bench_kernel.py                     # the full table
    python scripts/bench_kernel.py --contexts 2048 --ks 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import parse_vllm.ops as ops  # noqa: E402
from parse_vllm.ops.reference import (  # noqa: E402
    gather_prefix,
    prefix_verify_attention_dense_ref,
    prefix_verify_attention_ref,
)


def make_inputs(n_ctx, K, L, Hq, Hkv, D, bs, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_blocks = -(-n_ctx // bs)
    num_blocks = n_blocks + 8
    key_cache = torch.randn(num_blocks, bs, Hkv, D, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, bs, Hkv, D, generator=g).to(dtype)
    block_table = torch.randperm(num_blocks, generator=g)[:n_blocks].int()[None, :]
    prompt = n_ctx // 2
    draft = n_ctx - prompt
    prefix = [prompt + (k * draft) // K for k in range(1, K + 1)]
    T = K * L
    q = torch.randn(T, Hq, D, generator=g).to(dtype)
    k_new = torch.randn(T, Hkv, D, generator=g).to(dtype)
    v_new = torch.randn(T, Hkv, D, generator=g).to(dtype)
    return dict(
        q=q, k_new=k_new, v_new=v_new, key_cache=key_cache, value_cache=value_cache,
        block_table=block_table,
        copy_req=torch.zeros(K, dtype=torch.int32),
        copy_prefix_len=torch.tensor(prefix, dtype=torch.int32),
        cu_copy_lens=torch.arange(0, T + 1, L, dtype=torch.int32),
        scale=D ** -0.5,
    )


def run_twin(x, out):
    ops.prefix_verify_attention(out, x["q"], x["k_new"], x["v_new"], x["key_cache"], x["value_cache"],
                                x["block_table"], x["copy_req"], x["copy_prefix_len"], x["cu_copy_lens"],
                                x["scale"], check_values=False)
    return out


def run_dense(x, out):
    return prefix_verify_attention_dense_ref(
        x["q"], x["k_new"], x["v_new"], x["key_cache"], x["value_cache"], x["block_table"],
        x["copy_req"], x["copy_prefix_len"], x["cu_copy_lens"], x["scale"], use_sdpa=True)


def run_per_copy(x, out):
    """K separate SDPA calls, in SDPA's fastest CPU form we found (4-D inputs,
    additive float mask, enable_gqa): roughly 2x faster than 3-D inputs or a
    boolean mask on torch 2.13."""
    q, k_new, v_new = x["q"], x["k_new"], x["v_new"]
    cu = x["cu_copy_lens"].tolist()
    group = q.shape[1] // k_new.shape[1]
    for c, (r, p) in enumerate(zip(x["copy_req"].tolist(), x["copy_prefix_len"].tolist())):
        t0, t1 = cu[c], cu[c + 1]
        L = t1 - t0
        k = torch.cat([gather_prefix(x["key_cache"], x["block_table"], r, p), k_new[t0:t1]])
        v = torch.cat([gather_prefix(x["value_cache"], x["block_table"], r, p), v_new[t0:t1]])
        bias = torch.zeros(L, p + L, dtype=q.dtype)
        bias[:, p:].masked_fill_(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        o = F.scaled_dot_product_attention(q[t0:t1].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=bias, scale=x["scale"],
                                           enable_gqa=group > 1)
        out[t0:t1] = o[0].transpose(0, 1)
    return out


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_extra_bytes(fn, *a):
    """Rise of peak RSS during one call (Linux), else None."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    base = _status("VmRSS")
    fn(*a)
    return max(0, _status("VmHWM") - base)


def time_interleaved(fns, x, out, stat="median", min_time=0.5, min_reps=3, max_reps=30):
    """Times the methods round-robin (one call of each per round), so that a
    change of machine load hits all of them alike."""
    for fn in fns:  # warm-up
        fn(x, out)
    times = [[] for _ in fns]
    t_start = time.perf_counter()
    rounds = 0
    while rounds < min_reps or (time.perf_counter() - t_start < min_time * len(fns) and rounds < max_reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn(x, out)
            times[i].append(time.perf_counter() - t0)
        rounds += 1
    agg = statistics.median if stat == "median" else min
    return [agg(t) for t in times]


def attention_flops(x):
    """Multiply-adds of QK^T and PV that any exact method must do, x2."""
    Hq, D = x["q"].shape[1], x["q"].shape[2]
    cu = x["cu_copy_lens"].tolist()
    total = 0
    for c, p in enumerate(x["copy_prefix_len"].tolist()):
        L = cu[c + 1] - cu[c]
        total += L * Hq * (p + (L + 1) / 2) * D * 4
    return total


def gemm_rate(dtype, m=768, k=128, n=2048):
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    t = min(_t(lambda: a @ b) for _ in range(20))
    return 2 * m * k * n / t / 1e9


def _t(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _child_memory(n_ctx, K, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--_mem", str(n_ctx), str(K), "--suffix", str(args.suffix),
           "--hq", str(args.hq), "--hkv", str(args.hkv), "--head-size", str(args.head_size),
           "--block-size", str(args.block_size), "--dtype", args.dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        print(f"# memory child failed: {r.stderr[-500:]}", file=sys.stderr)
        return {}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--suffix", type=int, default=24)
    ap.add_argument("--hq", type=int, default=8)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check vs the reference")
    ap.add_argument("--stat", default="median", choices=["median", "min"],
                    help="statistic over the repetitions (min is steadier on a busy machine)")
    ap.add_argument("--no-mem", action="store_true", help="skip the peak-memory child processes")
    ap.add_argument("--_mem", type=int, nargs=2, help=argparse.SUPPRESS)  # child: ctx K
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args._mem:
        if args.threads:
            torch.set_num_threads(args.threads)
        n_ctx, K = args._mem
        x = make_inputs(n_ctx, K, args.suffix, args.hq, args.hkv, args.head_size, args.block_size, dtype)
        out = torch.full_like(x["q"], float("nan"))
        res = {}
        for name, fn in (("twin", run_twin), ("dense", run_dense), ("per-copy", run_per_copy)):
            fn(x, out)  # warm-up: one-time allocations (thread pools, oneDNN primitives)
            res[name] = peak_extra_bytes(fn, x, out)
        print(json.dumps(res))
        return
    if not ops.has_compiled_op():
        sys.exit(f"compiled op missing: {ops.compiled_op_error()}; run `pip install --no-build-isolation -e .`")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, twin ISA {ops.cpu_isa()}, "
          f"dtype {args.dtype}, Hq={args.hq} Hkv={args.hkv} D={args.head_size} "
          f"block={args.block_size} L={args.suffix}, one request")
    print(f"# this machine's GEMM rate now (torch.mm 768x128 @ 128x2048, best of 20): "
          f"{gemm_rate(dtype):.0f} GFLOP/s in {args.dtype}; 'twin GF/s' = attention FLOPs / twin time")
    print(f"# times: {args.stat} ms per call (methods timed round-robin); mem: peak RSS rise in MiB during one call; "
          "x = baseline / twin (higher = twin better)")
    hdr = (f"{'ctx':>5} {'K':>3} | {'twin ms':>8} {'dense ms':>9} {'per-copy ms':>11} | "
           f"{'dense x':>7} {'per-copy x':>10} {'K/2':>4} {'twin GF/s':>9} | {'twin MiB':>8} {'dense MiB':>9} {'per-copy MiB':>12}")
    print(hdr)
    print("-" * len(hdr))
    for n_ctx in args.contexts:
        for K in args.ks:
            x = make_inputs(n_ctx, K, args.suffix, args.hq, args.hkv, args.head_size, args.block_size, dtype)
            out = torch.full_like(x["q"], float("nan"))
            if not args.no_check:
                ref = prefix_verify_attention_ref(
                    x["q"], x["k_new"], x["v_new"], x["key_cache"], x["value_cache"], x["block_table"],
                    x["copy_req"], x["copy_prefix_len"], x["cu_copy_lens"], x["scale"]).float()
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                for name, fn in (("twin", run_twin), ("per-copy", run_per_copy)):
                    got = fn(x, torch.full_like(x["q"], float("nan"))).float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    if not err <= tol:
                        sys.exit(f"{name} disagrees with the reference at ctx={n_ctx} K={K}: rel err {err:.2e}")
            flops = attention_flops(x)
            t_twin, t_dense, t_copy = time_interleaved([run_twin, run_dense, run_per_copy], x, out, args.stat)
            m_twin = m_dense = m_copy = None
            if not args.no_mem:
                del x, out
                mem = _child_memory(n_ctx, K, args)
                m_twin, m_dense, m_copy = mem.get("twin"), mem.get("dense"), mem.get("per-copy")

            def mib(b):
                return f"{b / 2**20:.1f}" if b is not None else "n/a"

            print(f"{n_ctx:>5} {K:>3} | {t_twin * 1e3:>8.2f} {t_dense * 1e3:>9.2f} {t_copy * 1e3:>11.2f} | "
                  f"{t_dense / t_twin:>7.2f} {t_copy / t_twin:>10.2f} {K / 2:>4.0f} {flops / t_twin / 1e9:>9.1f} | "
                  f"{mib(m_twin):>8} {mib(m_dense):>9} {mib(m_copy):>12}", flush=True)


if __name__ == "__main__":
    main()
