#!/usr/bin/env python
"""Benchmark of torch.ops.parse_vllm.prefix_verify_attention: the CPU twin, or
the CUDA kernel with --device cuda.

Side by side, in one process, on the same inputs, for each (context, K):

  op        parse_vllm.ops.prefix_verify_attention (the compiled op, called the
            way KernelVerifier calls it: through the Python face, with a
            PrefixVerifyMetadata; the op's one check reads the index values
            only when they are on the CPU)
  dense     all copies in ONE masked attention call with a dense [T, keys] mask
            (parse_vllm.ops.reference.prefix_verify_attention_dense_ref, SDPA)
  per-copy  K separate attention calls, one per copy: gather the copy's prefix
            from the paged cache, append its suffix, SDPA over [L, P+L]; the
            fastest of the SDPA forms in SDPA_FORMS that agrees with the
            reference (on the CPU only `mask_gqa` unless --all-forms)
  flash     (CUDA, fp16/bf16, when flash-attn is installed) the same K calls
            through flash_attn_func (causal, bottom-right aligned)
  graph     (CUDA) the op and the per-copy SDPA calls captured once in a CUDA
            graph and replayed: no Python or launch overhead

Setting (one request, like one PARSE verification pass): a context of N cached
tokens = prompt (N/2) + draft (N/2); copy k (k = 1..K) sees prompt +
draft[:k * (N/2) / K] (nested prefixes, the longest is the whole context); each
copy has an L-token verification suffix.  Model shape per layer: Hq query
heads, Hkv kv heads, head size D (defaults: 8 / 2 / 128, GQA 4), block size 16.
Per-copy masks / causal biases are built once, outside the timed region.

Time.  CPU: median (or --stat min) over repetitions after a warm-up, the
methods timed round-robin in this process.  CUDA: the same round-robin, each
call timed by CUDA events from an idle GPU with a cold L2 (a buffer of
max(256 MiB, 4 x L2) is zeroed and the device synchronised before each call),
so a time includes the host's launch work and memory traffic is DRAM traffic.

Peak memory.  CPU: measured in a child process per (context, K) -- the rise of
the peak RSS (VmHWM, reset through /proc/self/clear_refs) during one call of
each method, with glibc's mmap threshold pinned at 64 KiB
(MALLOC_MMAP_THRESHOLD_) so that freed buffers leave the RSS; timing runs
without that setting.  CUDA: the rise of torch.cuda.max_memory_allocated
during one call.  Inputs (cache, q, out, ...) are not counted.

Bytes moved (a model, not a measurement): `bytes_min` is what any exact method
must move -- the cached K+V of the longest prefix once, q, k_new, v_new, out,
the index tensors; `bytes_per_copy_min` is what K separate calls must at least
read (the cached K+V of every copy's prefix, sum of P_c instead of max P_c).
The op's achieved bandwidth is bytes_min / its time (the graph replay's when
there is one: the kernel without the wrapper's Python work), and its share of
the GPU's peak memory bandwidth (--peak-bw-gbps, else a spec-sheet table by
device name, else 2 x memory clock x bus width from the device properties).

    python scripts/bench_kernel.py                     # the full CPU table
    python scripts/bench_kernel.py --contexts 2048 --ks 8 --dtype bfloat16
    python scripts/bench_kernel.py --device cuda --dtype bfloat16 float32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import parse_vllm.ops as ops  # noqa: E402
from parse_vllm.ops import PrefixVerifyMetadata  # noqa: E402
from parse_vllm.ops.reference import (  # noqa: E402
    gather_prefix,
    prefix_verify_attention_dense_ref,
    prefix_verify_attention_ref,
)

CPU_CONTEXTS = [512, 2048, 8192]
CUDA_CONTEXTS = [512, 2048, 8192, 32768]
# The op must agree with the fp32 reference to this relative (normwise) error;
# on CUDA these are the GPU check's correctness goals.  Baselines only need to be
# right enough to count (BASELINE_TOL); a form that is not is dropped.
OP_TOL = {
    "cpu": {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2},
    "cuda": {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2},
}
BASELINE_TOL = {torch.float32: 1e-4}
SDPA_FORMS = ("mask_gqa", "lower_right_gqa", "lower_right_expand")

# Peak DRAM bandwidth (GB/s, spec sheets) by device name, most specific first.
PEAK_BW_TABLE = [
    (r"GH200.*(144|HBM3E)", 4900, "GH200 144 GB HBM3e"),
    (r"GH200", 4000, "GH200 96 GB HBM3"),
    (r"H200", 4800, "H200 (SXM / NVL)"),
    (r"H100.*NVL", 3900, "H100 NVL"),
    (r"H100.*PCI", 2000, "H100 PCIe"),
    (r"H100", 3350, "H100 SXM5"),
    (r"H800.*PCI", 2000, "H800 PCIe"),
    (r"H800", 3350, "H800 SXM5"),
    (r"\bH20\b", 4000, "H20"),
    (r"A100.*(80GB.*PCI|PCI.*80GB)", 1935, "A100 80 GB PCIe"),
    (r"A100.*80GB", 2039, "A100 80 GB SXM4"),
    (r"A100", 1555, "A100 40 GB"),
    (r"A800.*PCI", 1935, "A800 PCIe"),
    (r"A800", 2039, "A800 SXM4"),
    (r"B200", 8000, "B200"),
    (r"B100", 8000, "B100"),
    (r"L40", 864, "L40 / L40S"),
    (r"\bL4\b", 300, "L4"),
    (r"\bA10G?\b", 600, "A10 / A10G"),
    (r"\bA30\b", 933, "A30"),
    (r"\bA40\b", 696, "A40"),
    (r"RTX 6000 ADA", 960, "RTX 6000 Ada"),
    (r"RTX A6000", 768, "RTX A6000"),
    (r"RTX 4090", 1008, "GeForce RTX 4090"),
    (r"RTX 3090", 936, "GeForce RTX 3090"),
]


def peak_bandwidth(device_index: int = 0, override_gbps: float | None = None) -> dict:
    """The GPU's peak DRAM bandwidth in GB/s and where the figure comes from."""
    name = torch.cuda.get_device_name(device_index)
    props = torch.cuda.get_device_properties(device_index)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    from_props = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None
    table = next(((gbps, label) for pat, gbps, label in PEAK_BW_TABLE if re.search(pat, name.upper())), None)
    res = {
        "name": name,
        "table_GBps": table[0] if table else None,
        "props_GBps": round(from_props, 1) if from_props else None,
    }
    if override_gbps:
        res.update(GBps=float(override_gbps), source="--peak-bw-gbps / GPU_PEAK_BW_GBPS (given by the user)")
    elif table:
        res.update(GBps=float(table[0]), source=f"spec sheet for {table[1]} (matched by device name {name!r})")
    elif from_props:
        res.update(
            GBps=from_props,
            source=f"2 x memory clock {clock_khz / 1e3:.0f} MHz x {bus_bits}-bit bus "
            "(torch.cuda.get_device_properties)",
        )
    else:
        res.update(GBps=None, source=f"unknown for {name!r}: pass --peak-bw-gbps")
    return res


def copy_bandwidth(device, nbytes=1 << 30, reps=10) -> float:
    """Measured device-to-device copy rate in GB/s (read + write counted)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(ts) / 1e9


# --------------------------------------------------------------------------- inputs


def make_inputs(n_ctx, K, L, Hq, Hkv, D, bs, dtype, seed=0, device="cpu"):
    """Inputs drawn on the CPU (same values on every device), then moved: the
    op's arguments (q, k_new, v_new, key_cache, value_cache, md: see
    `op_inputs`).  The index lists are kept on the host as well (`lists`), so
    that the baselines' loops never read a GPU tensor back."""
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
    x = dict(q=q, k_new=k_new, v_new=v_new, key_cache=key_cache, value_cache=value_cache)
    x = {k: v.to(device) for k, v in x.items()}
    x["md"] = PrefixVerifyMetadata(
        block_table=block_table.to(device),
        copy_req=torch.zeros(K, dtype=torch.int32, device=device),
        copy_prefix_len=torch.tensor(prefix, dtype=torch.int32, device=device),
        cu_copy_lens=torch.arange(0, T + 1, L, dtype=torch.int32, device=device),
        num_actual_tokens=T,
        scale=D**-0.5,
    )
    x["lists"] = ([0] * K, prefix, list(range(0, T + 1, L)))
    return x


def op_inputs(x) -> tuple:
    """The arguments of the op's face and of the references, in their order:
    (q, k_new, v_new, key_cache, value_cache, md)."""
    return x["q"], x["k_new"], x["v_new"], x["key_cache"], x["value_cache"], x["md"]


def bytes_moved(x) -> tuple[int, int]:
    """(bytes_min, bytes_per_copy_min): see the module docstring."""
    q, kc, md = x["q"], x["key_cache"], x["md"]
    e = q.element_size()
    T, Hq, D = q.shape
    Hkv = kc.shape[2]
    _, plens, _ = x["lists"]
    rest = 2 * T * Hq * D * e + 2 * T * Hkv * D * e
    index = 4 * (md.block_table.numel() + md.copy_req.numel() + md.copy_prefix_len.numel() + md.cu_copy_lens.numel())
    return (2 * max(plens) * Hkv * D * e + rest + index, 2 * sum(plens) * Hkv * D * e + rest)


# --------------------------------------------------------------------------- methods


def run_twin(x, out):
    ops.prefix_verify_attention(*op_inputs(x), out=out)
    return out


run_op = run_twin


def run_dense(x, out):
    return prefix_verify_attention_dense_ref(*op_inputs(x), use_sdpa=True)


def _copies(x):
    reqs, plens, cu = x["lists"]
    for c, (r, p) in enumerate(zip(reqs, plens)):
        if cu[c + 1] > cu[c]:
            yield cu[c], cu[c + 1], r, p


def make_per_copy_sdpa(x, form="mask_gqa"):
    """K separate SDPA calls, one per copy over its gathered prefix + suffix.

    Forms: `mask_gqa` -- 4-D inputs, an additive float [L, P+L] mask,
    enable_gqa (SDPA's fastest CPU form on torch 2.13, ~2x faster than 3-D
    inputs or a boolean mask); `lower_right_gqa` -- no dense mask, a
    bottom-right causal bias (torch.nn.attention.bias.causal_lower_right, which
    lets CUDA use its flash / memory-efficient kernels), enable_gqa;
    `lower_right_expand` -- the same with the kv heads repeated to Hq instead of
    enable_gqa.  The masks are built here, once."""
    from torch.nn.attention.bias import causal_lower_right

    q, k_new, v_new = x["q"], x["k_new"], x["v_new"]
    group = q.shape[1] // k_new.shape[1]
    items = []
    for t0, t1, r, p in _copies(x):
        L = t1 - t0
        if form == "mask_gqa":
            bias = torch.zeros(L, p + L, dtype=q.dtype, device=q.device)
            bias[:, p:].masked_fill_(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        elif form in ("lower_right_gqa", "lower_right_expand"):
            bias = causal_lower_right(L, p + L)
        else:
            raise ValueError(f"unknown SDPA form {form!r}")
        items.append((t0, t1, r, p, bias))
    expand = form == "lower_right_expand"
    gqa = group > 1 and not expand

    def run(x, out):
        kc, vc, bt = x["key_cache"], x["value_cache"], x["md"].block_table
        for t0, t1, r, p, bias in items:
            k = torch.cat([gather_prefix(kc, bt, r, p), k_new[t0:t1]])
            v = torch.cat([gather_prefix(vc, bt, r, p), v_new[t0:t1]])
            if expand and group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            kw = {"enable_gqa": True} if gqa else {}
            o = F.scaled_dot_product_attention(
                q[t0:t1].transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=bias,
                scale=x["md"].scale,
                **kw,
            )
            out[t0:t1] = o[0].transpose(0, 1)
        return out

    return run


def make_per_copy_flash(x, flash_attn):
    """K separate flash_attn_func calls over gathered prefix + suffix (causal with
    seqlen_q < seqlen_k is bottom-right aligned in flash-attn >= 2.1)."""
    q, k_new, v_new = x["q"], x["k_new"], x["v_new"]
    items = list(_copies(x))

    def run(x, out):
        kc, vc, bt = x["key_cache"], x["value_cache"], x["md"].block_table
        for t0, t1, r, p in items:
            k = torch.cat([gather_prefix(kc, bt, r, p), k_new[t0:t1]])
            v = torch.cat([gather_prefix(vc, bt, r, p), v_new[t0:t1]])
            out[t0:t1] = flash_attn.flash_attn_func(
                q[t0:t1][None], k[None], v[None], softmax_scale=x["md"].scale, causal=True
            )[0]
        return out

    return run


def graphed(fn, x, out):
    """fn captured once in a CUDA graph; the returned callable replays it (and
    writes into the same `out`)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(x, out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(x, out)

    def replay(x_, out_):
        g.replay()
        return out

    replay.graph = g
    return replay


# --------------------------------------------------------------------------- measuring


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


def cuda_peak_extra_bytes(fn, *a):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*a)
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - base)


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


def time_interleaved_cuda(fns, x, out, flush, stat="median", min_time=0.25, min_reps=5, max_reps=50):
    """CUDA: round-robin like time_interleaved; each call is timed by events from
    an idle GPU after `flush` (a large buffer) has been zeroed, i.e. with a cold L2."""
    for fn in fns:  # warm-up
        fn(x, out)
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    t_start = time.perf_counter()
    rounds = 0
    while rounds < min_reps or (time.perf_counter() - t_start < min_time * len(fns) and rounds < max_reps):
        events = []
        for fn in fns:
            flush.zero_()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(x, out)
            e.record()
            events.append((s, e))
        torch.cuda.synchronize()
        for i, (s, e) in enumerate(events):
            times[i].append(s.elapsed_time(e) / 1e3)
        rounds += 1
    agg = statistics.median if stat == "median" else min
    return [agg(t) for t in times]


def rel_err(got, ref):
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def attention_flops(x):
    """Multiply-adds of QK^T and PV that any exact method must do, x2."""
    Hq, D = x["q"].shape[1], x["q"].shape[2]
    _, plens, cu = x["lists"]
    total = 0
    for c, p in enumerate(plens):
        L = cu[c + 1] - cu[c]
        total += L * Hq * (p + (L + 1) / 2) * D * 4
    return total


def gemm_rate(dtype, m=768, k=128, n=2048, reps=20):
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    t = min(_t(lambda: a @ b) for _ in range(reps))
    return 2 * m * k * n / t / 1e9


def _t(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _child_memory(n_ctx, K, args, dtype_name, forms):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_mem",
        str(n_ctx),
        str(K),
        "--suffix",
        str(args.suffix),
        "--hq",
        str(args.hq),
        "--hkv",
        str(args.hkv),
        "--head-size",
        str(args.head_size),
        "--block-size",
        str(args.block_size),
        "--dtype",
        dtype_name,
        "--_forms",
        *forms,
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        print(f"# memory child failed: {r.stderr[-500:]}", file=sys.stderr)
        return {}


# --------------------------------------------------------------------------- one (context, K)


def bench_one(n_ctx, K, dtype, args, device, flush=None, flash_attn=None, gpu_path=None):
    """Checks, times and measures every method for one (context, K, dtype); returns the JSON row.
    `gpu_path` (default: device is CUDA) selects the CUDA methods and timers; the
    tests run it on the CPU with those timers replaced."""
    is_cuda = device.type == "cuda" if gpu_path is None else gpu_path
    x = make_inputs(n_ctx, K, args.suffix, args.hq, args.hkv, args.head_size, args.block_size, dtype, device=device)
    out = torch.full_like(x["q"], float("nan"))
    row = dict(
        ctx=n_ctx,
        K=K,
        dtype=str(dtype).replace("torch.", ""),
        L=args.suffix,
        Hq=args.hq,
        Hkv=args.hkv,
        D=args.head_size,
        block_size=args.block_size,
        ms={},
        max_rel_err={},
        peak_mem_bytes={},
        notes=[],
        op_ok=True,
    )
    ref = None
    if not args.no_check:
        ref = prefix_verify_attention_ref(*op_inputs(x)).float()

    def check(fn):
        return rel_err(fn(x, torch.full_like(x["q"], float("nan"))), ref)

    methods = {"op": run_op, "dense": run_dense}
    op_tol = OP_TOL["cuda" if is_cuda else "cpu"][dtype]
    base_tol = BASELINE_TOL.get(dtype, 3e-2)
    if ref is not None:
        err = check(run_op)
        row["max_rel_err"]["op"] = err
        if not err <= op_tol:
            row["op_ok"] = False
            row["notes"].append(f"op disagrees with the reference: rel err {err:.2e} > {op_tol:.0e}")
    # per-copy SDPA: the fastest form that agrees with the reference
    forms = list(SDPA_FORMS if (is_cuda or args.all_forms) else ("mask_gqa",))
    if args._forms:
        forms = list(args._forms)
    cands, rejected = {}, {}
    for form in forms:
        try:
            fn = make_per_copy_sdpa(x, form)
            err = check(fn) if ref is not None else None
            if err is not None and not err <= base_tol:
                rejected[form] = f"rel err {err:.2e}"
                continue
            cands[form] = (fn, err)
        except Exception as e:  # a form this torch / device does not support
            rejected[form] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    row["sdpa_forms_rejected"] = rejected
    if not cands:
        row["notes"].append(f"no per-copy SDPA form ran: {rejected}")
    elif len(cands) > 1:
        names = list(cands)
        ts = (
            time_interleaved_cuda([cands[n][0] for n in names], x, out, flush, min_time=0.02, min_reps=3, max_reps=5)
            if is_cuda
            else time_interleaved([cands[n][0] for n in names], x, out, min_time=0.02, min_reps=2, max_reps=3)
        )
        row["sdpa_form_ms"] = {n: t * 1e3 for n, t in zip(names, ts)}
        best = names[ts.index(min(ts))]
        cands = {best: cands[best]}
    if cands:
        form, (fn, err) = next(iter(cands.items()))
        row["sdpa_form"] = form
        methods["sdpa_per_copy"] = fn
        row["max_rel_err"]["sdpa_per_copy"] = err
    if is_cuda:
        if flash_attn is None:
            row["flash"] = "flash-attn not installed"
        elif dtype == torch.float32:
            row["flash"] = "flash-attn has no float32"
        else:
            try:
                fn = make_per_copy_flash(x, flash_attn)
                err = check(fn) if ref is not None else None
                if err is not None and not err <= base_tol:
                    row["flash"] = f"disagrees with the reference (rel err {err:.2e})"
                else:
                    methods["flash_per_copy"] = fn
                    row["max_rel_err"]["flash_per_copy"] = err
                    row["flash"] = f"flash-attn {getattr(flash_attn, '__version__', '?')}"
            except Exception as e:
                row["flash"] = f"{type(e).__name__}: {str(e)[:160]}"
        for name in ("op", "sdpa_per_copy"):
            if name not in methods:
                continue
            try:
                g = graphed(methods[name], x, out)
                if ref is not None:
                    out.fill_(float("nan"))
                    g(x, out)
                    if out.is_cuda:
                        torch.cuda.synchronize()
                    err = rel_err(out, ref)
                    row["max_rel_err"][name + "_graph"] = err
                    tol = op_tol if name == "op" else base_tol
                    if not err <= tol:
                        row["notes"].append(f"{name} replayed from a CUDA graph disagrees: rel err {err:.2e}")
                        if name == "op":
                            row["op_ok"] = False
                        continue
                methods[name + "_graph"] = g
            except Exception as e:
                row["notes"].append(f"{name}: CUDA graph capture failed: {type(e).__name__}: {str(e)[:160]}")
    if ref is not None and "dense" in methods:
        row["max_rel_err"]["dense"] = check(run_dense)

    names = list(methods)
    if is_cuda:
        ts = time_interleaved_cuda(
            [methods[n] for n in names],
            x,
            out,
            flush,
            args.stat,
            **({"min_time": 0.01, "min_reps": 2, "max_reps": 3} if args.quick else {}),
        )
    else:
        ts = time_interleaved(
            [methods[n] for n in names],
            x,
            out,
            args.stat,
            **({"min_time": 0.01, "min_reps": 2, "max_reps": 3} if args.quick else {}),
        )
    row["ms"] = {n: t * 1e3 for n, t in zip(names, ts)}
    t = row["ms"]
    for base in ("sdpa_per_copy", "dense", "flash_per_copy"):
        if base in t:
            row.setdefault("speedup", {})[f"vs_{base}"] = t[base] / t["op"]
    if "sdpa_per_copy_graph" in t and "op_graph" in t:
        row.setdefault("speedup", {})["graph_vs_sdpa_per_copy_graph"] = t["sdpa_per_copy_graph"] / t["op_graph"]
    row["bytes_min"], row["bytes_per_copy_min"] = bytes_moved(x)
    basis = "op_graph" if "op_graph" in t else "op"
    row["bw_time_basis"] = basis
    row["op_GBps"] = row["bytes_min"] / (t[basis] / 1e3) / 1e9
    if "sdpa_per_copy" in t:
        row["sdpa_per_copy_GBps"] = row["bytes_per_copy_min"] / (t["sdpa_per_copy"] / 1e3) / 1e9
    row["flops"] = attention_flops(x)
    row["op_TFLOPs"] = row["flops"] / (t[basis] / 1e3) / 1e12
    if is_cuda and not args.no_mem:
        for n in names:
            if not n.endswith("_graph"):
                row["peak_mem_bytes"][n] = cuda_peak_extra_bytes(methods[n], x, out)
    elif not args.no_mem:
        del x, out, methods, cands
        mem = _child_memory(n_ctx, K, args, row["dtype"], [row["sdpa_form"]] if "sdpa_form" in row else ["mask_gqa"])
        row["peak_mem_bytes"] = {"op": mem.get("twin"), "dense": mem.get("dense"), "sdpa_per_copy": mem.get("per-copy")}
    return row


def _mib(b):
    return f"{b / 2**20:.1f}" if b is not None else "n/a"


def print_cpu_row(row):
    t, m = row["ms"], row["peak_mem_bytes"]
    tt, td, tc = t["op"], t["dense"], t.get("sdpa_per_copy", float("nan"))
    print(
        f"{row['ctx']:>5} {row['K']:>3} | {tt:>8.2f} {td:>9.2f} {tc:>11.2f} | "
        f"{td / tt:>7.2f} {tc / tt:>10.2f} {row['K'] / 2:>4.0f} {row['flops'] / (tt / 1e3) / 1e9:>9.1f} | "
        f"{_mib(m.get('op')):>8} {_mib(m.get('dense')):>9} {_mib(m.get('sdpa_per_copy')):>12}",
        flush=True,
    )


CUDA_COLS = ("op", "op_graph", "dense", "sdpa_per_copy", "sdpa_per_copy_graph", "flash_per_copy")


def cuda_header(peak):
    return (
        f"{'ctx':>5} {'K':>3} | "
        + " ".join(f"{c:>10.10}" for c in ("op", "op graph", "dense", "sdpa/copy", "sdpa graph", "flash/copy"))
        + f" | {'x sdpa':>6} {'x graph':>7} {'x dense':>7} | {'op GB/s':>7} {'% peak':>6} | "
        f"{'op MiB':>6} {'sdpa MiB':>8}"
    )


def print_cuda_row(row):
    t, s, m = row["ms"], row.get("speedup", {}), row["peak_mem_bytes"]

    def ms(c):
        return f"{t[c]:>10.3f}" if c in t else f"{'n/a':>10}"

    def x(k, w):
        return f"{s[k]:>{w}.2f}" if k in s else f"{'n/a':>{w}}"

    share = row.get("op_bw_share")
    print(
        f"{row['ctx']:>5} {row['K']:>3} | "
        + " ".join(ms(c) for c in CUDA_COLS)
        + f" | {x('vs_sdpa_per_copy', 6)} {x('graph_vs_sdpa_per_copy_graph', 7)} {x('vs_dense', 7)} | "
        f"{row['op_GBps']:>7.0f} {(f'{100 * share:.0f}' if share is not None else 'n/a'):>6} | "
        f"{_mib(m.get('op')):>6} {_mib(m.get('sdpa_per_copy')):>8}"
        + ("" if row["op_ok"] else "   <-- OP WRONG: " + "; ".join(row["notes"])),
        flush=True,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=None, help=f"default: {CPU_CONTEXTS} (cpu), {CUDA_CONTEXTS} (cuda)"
    )
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--suffix", type=int, default=24)
    ap.add_argument("--hq", type=int, default=8)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check vs the reference")
    ap.add_argument(
        "--stat",
        default="median",
        choices=["median", "min"],
        help="statistic over the repetitions (min is steadier on a busy machine)",
    )
    ap.add_argument("--no-mem", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--all-forms", action="store_true", help="CPU: try every per-copy SDPA form (CUDA always does)")
    ap.add_argument("--quick", action="store_true", help="2-3 repetitions per method (a smoke run, not a measurement)")
    ap.add_argument(
        "--peak-bw-gbps",
        type=float,
        default=None,
        help="the GPU's peak memory bandwidth in GB/s (default: GPU_PEAK_BW_GBPS, else by device name)",
    )
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--_mem", type=int, nargs=2, help=argparse.SUPPRESS)  # child: ctx K
    ap.add_argument("--_forms", nargs="+", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dtypes = [getattr(torch, d) for d in args.dtype]
    if args._mem:
        if args.threads:
            torch.set_num_threads(args.threads)
        n_ctx, K = args._mem
        x = make_inputs(n_ctx, K, args.suffix, args.hq, args.hkv, args.head_size, args.block_size, dtypes[0])
        out = torch.full_like(x["q"], float("nan"))
        res = {}
        per_copy = make_per_copy_sdpa(x, (args._forms or ["mask_gqa"])[0])
        for name, fn in (("twin", run_twin), ("dense", run_dense), ("per-copy", per_copy)):
            fn(x, out)  # warm-up: one-time allocations (thread pools, oneDNN primitives)
            res[name] = peak_extra_bytes(fn, x, out)
        print(json.dumps(res))
        return 0
    contexts = args.contexts or (CUDA_CONTEXTS if args.device == "cuda" else CPU_CONTEXTS)
    if not ops.has_compiled_op():
        sys.exit(f"compiled op missing: {ops.compiled_op_error()}; run `pip install --no-build-isolation -e .`")
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = {
        "device": args.device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_isa": ops.cpu_isa(),
        "dtypes": args.dtype,
        "contexts": contexts,
        "ks": args.ks,
        "L": args.suffix,
        "Hq": args.hq,
        "Hkv": args.hkv,
        "D": args.head_size,
        "block_size": args.block_size,
        "stat": args.stat,
        "quick": args.quick,
    }
    flush = flash_attn = None
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"--device cuda: no CUDA GPU visible to torch {torch.__version__}")
        if not ops.has_cuda_op():
            sys.exit(
                "--device cuda: parse_vllm._C has no CUDA kernel; rebuild with "
                "`PARSE_VLLM_BUILD_CUDA=1 pip install --no-build-isolation -e .`"
            )
        device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device)
        env_bw = os.environ.get("GPU_PEAK_BW_GBPS")
        peak = peak_bandwidth(device.index, args.peak_bw_gbps or (float(env_bw) if env_bw else None))
        l2 = getattr(props, "L2_cache_size", 0) or 0
        flush = torch.empty(max(256 << 20, 4 * l2), dtype=torch.uint8, device=device)
        try:
            import flash_attn  # noqa: F811
        except Exception as e:  # not installed, or built for another torch
            flash_attn = None
            meta["flash_attn"] = f"not usable: {type(e).__name__}: {str(e)[:120]}"
        else:
            meta["flash_attn"] = getattr(flash_attn, "__version__", "?")
        meta.update(
            device_name=torch.cuda.get_device_name(device),
            capability=list(torch.cuda.get_device_capability(device)),
            sms=props.multi_processor_count,
            total_memory=props.total_memory,
            l2_bytes=l2,
            cuda=torch.version.cuda,
            peak_bw=peak,
            flush_bytes=flush.numel(),
            copy_GBps=None if args.quick else copy_bandwidth(device),
            timing="CUDA events per call from an idle GPU, L2 flushed before each call; "
            f"{args.stat} over round-robin repetitions",
        )
        print(
            f"# {meta['device_name']} (sm_{meta['capability'][0]}{meta['capability'][1]}, {meta['sms']} SMs), "
            f"torch {torch.__version__} CUDA {torch.version.cuda}; flash-attn: {meta['flash_attn']}"
        )
        print(
            f"# peak memory bandwidth {peak['GBps']} GB/s ({peak['source']})"
            + (f"; measured device copy {meta['copy_GBps']:.0f} GB/s" if meta["copy_GBps"] else "")
        )
        print(
            f"# Hq={args.hq} Hkv={args.hkv} D={args.head_size} block={args.block_size} L={args.suffix}, "
            "one request; ms per call (cold L2); x = baseline / op; op GB/s = bytes_min / op time "
            "(graph replay when captured)"
        )
    else:
        device = torch.device("cpu")
        peak = None
        meta["timing"] = f"perf_counter per call, {args.stat} over round-robin repetitions"
        print(
            f"# torch {torch.__version__}, {torch.get_num_threads()} threads, twin ISA {ops.cpu_isa()}, "
            f"dtype {' '.join(args.dtype)}, Hq={args.hq} Hkv={args.hkv} D={args.head_size} "
            f"block={args.block_size} L={args.suffix}, one request"
        )
        for d in dtypes:
            print(
                f"# this machine's GEMM rate now (torch.mm 768x128 @ 128x2048, best of 20): "
                f"{gemm_rate(d, reps=3 if args.quick else 20):.0f} GFLOP/s in {d}; "
                "'twin GF/s' = attention FLOPs / twin time"
            )
        print(
            f"# times: {args.stat} ms per call (methods timed round-robin); mem: peak RSS rise in MiB during one "
            "call; x = baseline / twin (higher = twin better)"
        )
    rows = []
    bad = []
    for dtype in dtypes:
        if args.device == "cuda":
            hdr = cuda_header(peak)
        else:
            hdr = (
                f"{'ctx':>5} {'K':>3} | {'twin ms':>8} {'dense ms':>9} {'per-copy ms':>11} | "
                f"{'dense x':>7} {'per-copy x':>10} {'K/2':>4} {'twin GF/s':>9} | {'twin MiB':>8} "
                f"{'dense MiB':>9} {'per-copy MiB':>12}"
            )
        print(f"\n## {str(dtype).replace('torch.', '')}")
        print(hdr)
        print("-" * len(hdr))
        for n_ctx in contexts:
            for K in args.ks:
                row = bench_one(n_ctx, K, dtype, args, device, flush, flash_attn)
                if peak is not None and peak.get("GBps"):
                    row["op_bw_share"] = row["op_GBps"] / peak["GBps"]
                rows.append(row)
                if not row["op_ok"]:
                    bad.append(f"ctx={n_ctx} K={K} {row['dtype']}: " + "; ".join(row["notes"]))
                (print_cuda_row if args.device == "cuda" else print_cpu_row)(row)
                if args.json:  # after every row: a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump({"meta": meta, "rows": rows, "complete": False}, f, indent=1)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "complete": True}, f, indent=1)
    if bad:
        print("\nthe op disagrees with the reference:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
