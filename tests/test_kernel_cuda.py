"""CUDA kernel of torch.ops.parse_vllm.prefix_verify_attention on a GPU.

Compared with the plain-PyTorch reference (same cases as the CPU twin's tests)
and, where installed, with flash-attn and xformers run once per copy over the
copy's gathered prefix + suffix.  Every test here needs a CUDA GPU and a build
with the CUDA kernel; elsewhere the module is skipped with the reason.

With PARSE_VLLM_KERNEL_ERR_LOG=path, every comparison with the reference appends
one JSON line (test, dtype, relative error, tolerance) to that file; the GPU
check (scripts/gpu_check.sh) reports the largest error per dtype from it.
Importing this module needs neither vLLM nor a GPU.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from test_kernel_cpu import LAYOUTS, TOL, make_case, map_tensors, nested, reference

import parse_vllm.ops as ops
from parse_vllm.ops.reference import gather_prefix

if not torch.cuda.is_available():
    _skip = f"no CUDA GPU (torch {torch.__version__}, torch.version.cuda={torch.version.cuda})"
elif not ops.has_cuda_op():
    _skip = (
        "parse_vllm._C was built without the CUDA kernel: rebuild with "
        "`PARSE_VLLM_BUILD_CUDA=1 pip install --no-build-isolation -e .`"
        + (f" ({ops.compiled_op_error()})" if ops.compiled_op_error() else "")
    )
else:
    _skip = None

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_skip is not None, reason=_skip or "")]


def to_cuda(case):
    return map_tensors(case, lambda t: t.cuda())


def _to_cuda_keeping_view(v):
    if v.untyped_storage().nbytes() > v.numel() * v.element_size():
        base = torch.empty(0, dtype=v.dtype).set_(
            v.untyped_storage(), 0, (v.untyped_storage().nbytes() // v.element_size(),)
        )
        return base.cuda().as_strided(v.shape, v.stride(), v.storage_offset())
    return v.cuda()


def to_cuda_strided(case):
    """Moves to the GPU keeping the views: caches/q that are views stay views."""
    return map_tensors(case, _to_cuda_keeping_view)


def record_error(dtype, err, tol):
    path = os.environ.get("PARSE_VLLM_KERNEL_ERR_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        with open(path, "a") as f:
            rec = {"test": test, "dtype": str(dtype).replace("torch.", ""), "err": err, "tol": tol}
            f.write(json.dumps(rec) + "\n")


def check_cuda(case_cpu, strided=True):
    case = to_cuda_strided(case_cpu) if strided else to_cuda(case_cpu)
    out = torch.full_like(case["q"], float("nan"))
    ops.prefix_verify_attention(**case, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "output not fully written"
    ref = reference(case_cpu).cuda()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    tol = max(TOL[case["q"].dtype], 2e-5)  # fp32 on GPU: different summation order, fast exp
    record_error(case["q"].dtype, err, tol)
    assert err <= tol, f"relative error {err:.3e} > {tol:.0e}"
    return out, case


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gqa_block_sizes_dtypes(Hq, Hkv, block_size, dtype):
    copies = nested(0, 3 * block_size + 5, 4, 6, block_size // 2 + 3) + nested(1, 2 * block_size, 3, 5, block_size)
    check_cuda(make_case(copies, Hq=Hq, Hkv=Hkv, block_size=block_size, dtype=dtype, seed=Hq + block_size))


@pytest.mark.parametrize("D", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_sizes_layouts(D, layout):
    copies = nested(0, 70, 3, 7, 20) + [(1, 33, 4), (1, 0, 2)]
    check_cuda(make_case(copies, D=D, layout=layout, dtype=torch.bfloat16, seed=D))


@pytest.mark.parametrize("P", [0, 1, 15, 16, 17, 4095, 4096, 4097])
def test_prefix_edges_and_splits(P):
    copies = [(0, P, 5), (0, max(P - 1, 0), 24), (0, P + 1, 1)]
    check_cuda(make_case(copies, block_size=16, Hq=8, Hkv=1, D=128, seed=P))


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("window", [None, 1, 17, 512])
def test_softcap_window(softcap, window):
    copies = nested(0, 3000, 8, 24, 200) + [(1, 33, 5)]
    check_cuda(
        make_case(copies, Hq=4, Hkv=1, D=256, dtype=torch.bfloat16, softcap=softcap, sliding_window=window, seed=5)
    )


@pytest.mark.parametrize("seed", range(20))
def test_random(seed):
    rng = random.Random(2000 + seed)
    Hkv = rng.choice([1, 2, 4])
    copies = []
    for r in range(rng.randint(1, 6)):
        P = rng.randint(0, 5000)
        for _ in range(rng.randint(1, 16)):
            copies.append((r, rng.randint(0, P), rng.randint(0, 40)))
    if sum(L for _, _, L in copies) == 0:
        copies.append((0, 5, 2))
    check_cuda(
        make_case(
            copies,
            Hq=Hkv * rng.choice([1, 2, 4, 8]),
            Hkv=Hkv,
            D=rng.choice([64, 80, 96, 128, 256]),
            block_size=rng.choice([16, 32, 64, 128]),
            dtype=rng.choice([torch.float16, torch.bfloat16]),
            layout=rng.choice(LAYOUTS),
            softcap=rng.choice([0.0, 20.0]),
            sliding_window=rng.choice([None, 256]),
            max_blocks=rng.choice([None, 1024]),
            seed=seed,
        )
    )


def _per_copy_inputs(case):
    md = case["md"]
    cu = md.cu_copy_lens.tolist()
    for c, (r, p) in enumerate(zip(md.copy_req.tolist(), md.copy_prefix_len.tolist())):
        t0, t1 = cu[c], cu[c + 1]
        if t1 == t0:
            continue
        k = torch.cat([gather_prefix(case["key_cache"], md.block_table, r, p), case["k_new"][t0:t1]])
        v = torch.cat([gather_prefix(case["value_cache"], md.block_table, r, p), case["v_new"][t0:t1]])
        yield t0, t1, case["q"][t0:t1], k, v


@pytest.mark.parametrize("softcap,window", [(0.0, None), (30.0, 256)])
def test_matches_flash_attn_per_copy(softcap, window):
    flash_attn = pytest.importorskip("flash_attn")
    case_cpu = make_case(
        nested(0, 2000, 8, 24, 100) + nested(1, 700, 4, 24, 50),
        Hq=8,
        Hkv=2,
        D=128,
        dtype=torch.bfloat16,
        softcap=softcap,
        sliding_window=window,
        seed=9,
    )
    out, case = check_cuda(case_cpu)
    for t0, t1, q, k, v in _per_copy_inputs(case):
        # causal with seqlen_q < seqlen_k is bottom-right aligned: query j sees keys <= P + j
        o = flash_attn.flash_attn_func(
            q[None].contiguous(),
            k[None].contiguous(),
            v[None].contiguous(),
            softmax_scale=case["md"].scale,
            causal=True,
            softcap=softcap,
            window_size=((window - 1) if window else -1, 0),
        )[0]
        torch.testing.assert_close(out[t0:t1].float(), o.float(), rtol=2e-2, atol=2e-2)


def test_matches_xformers_per_copy():
    xops = pytest.importorskip("xformers.ops")
    case_cpu = make_case(nested(0, 1500, 6, 24, 100), Hq=8, Hkv=8, D=128, dtype=torch.float16, seed=10)
    out, case = check_cuda(case_cpu)
    for t0, t1, q, k, v in _per_copy_inputs(case):
        o = xops.memory_efficient_attention(
            q[None].contiguous(),
            k[None].contiguous(),
            v[None].contiguous(),
            scale=case["md"].scale,
            attn_bias=xops.fmha.attn_bias.LowerTriangularFromBottomRightMask(),
        )[0]
        torch.testing.assert_close(out[t0:t1].float(), o.float(), rtol=2e-2, atol=2e-2)


def test_cuda_graph_capture():
    case = to_cuda(make_case(nested(0, 500, 4, 8, 50), dtype=torch.float16, seed=11))
    out = torch.empty_like(case["q"])
    args = ops.op_arguments(**case, out=out)
    torch.ops.parse_vllm.prefix_verify_attention(*args)  # warm-up (kernel attributes)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.ops.parse_vllm.prefix_verify_attention(*args)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = reference(map_tensors(case, lambda t: t.cpu())).cuda()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    record_error(torch.float16, err, TOL[torch.float16])
    assert err <= TOL[torch.float16]


# ---------------------------------------------------------------- the tensor-core kernel
#
# bf16 / fp16 calls with 16-byte aligned rows run on the tensor-core kernel
# (csrc/cuda/prefix_verify_attention_tc.cu); PARSE_VLLM_CUDA_KERNEL=cuda-core sends them to
# the CUDA-core kernel.  Its schedule is fuzzed on the CPU (tests/test_kernel_tc_schedule.py,
# prefix_verify_tc_emulate); here the GPU runs the same fuzzed calls.


def _tc_cases(n, seed, **kw):
    import numpy as np
    from test_kernel_tc_schedule import make_case as tc_case

    rng = np.random.default_rng(seed)
    return [tc_case(rng, **kw) for _ in range(n)]


def _run_on_gpu(case):
    c = map_tensors({k: v for k, v in case.items() if k != "num_sms"}, lambda t: t.cuda())
    out = ops.prefix_verify_attention(c["q"], c["k_new"], c["v_new"], c["key_cache"], c["value_cache"], c["md"])
    torch.cuda.synchronize()
    return out.cpu()


@pytest.mark.parametrize("seed", range(4))
def test_tensor_core_kernel_matches_its_emulation_and_float64(seed):
    """40 fuzzed calls per seed: the GPU's result against the CPU emulation of the same schedule
    (same rounding of P; only the order of fp32 sums differs) and a float64 reference."""
    import numpy as np
    from test_kernel_tc_schedule import emulate, reference_f64, visibility

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for case in _tc_cases(40, 3000 + seed):
        case["num_sms"] = sms
        got = _run_on_gpu(case)
        emu, _ = emulate(case)
        vis = visibility(case)
        ref = reference_f64(case, vis)
        tol = 3e-2 if case["q"].dtype == torch.bfloat16 else 4e-3
        err = float(np.abs(got.double().numpy() - ref).max())
        record_error(case["q"].dtype, err, tol)
        assert err < tol, err
        assert float((got.float() - emu.float()).abs().max()) < 2 * tol


def test_tensor_core_and_cuda_core_kernels_agree(monkeypatch):
    """The same bf16 calls through both kernels (PARSE_VLLM_CUDA_KERNEL=cuda-core)."""
    for case in _tc_cases(20, 4000, dtype=torch.bfloat16):
        tc = _run_on_gpu(case)
        monkeypatch.setenv("PARSE_VLLM_CUDA_KERNEL", "cuda-core")
        cc = _run_on_gpu(case)
        monkeypatch.delenv("PARSE_VLLM_CUDA_KERNEL")
        assert float((tc.float() - cc.float()).abs().max()) < 3e-2


def test_tensor_core_kernel_ignores_the_block_tables_width():
    """A block table padded to 32k tokens of columns nobody reads, with max_prefix_len given:
    bit-identical result (the split plan comes from max_prefix_len)."""
    import dataclasses

    for case in _tc_cases(5, 4100, dtype=torch.bfloat16, D=128):
        md = case["md"]
        md = dataclasses.replace(md, max_prefix_len=int(md.copy_prefix_len.max()))
        wide = torch.zeros((md.block_table.shape[0], md.block_table.shape[1] + 2048), dtype=torch.int32)
        wide[:, : md.block_table.shape[1]] = md.block_table
        a = _run_on_gpu(dict(case, md=md))
        b = _run_on_gpu(dict(case, md=dataclasses.replace(md, block_table=wide.contiguous())))
        assert torch.equal(a, b)


def test_unaligned_rows_take_the_cuda_core_kernel():
    """q as a view one element off a 16-byte boundary: the tensor-core kernel declines it and the
    CUDA-core kernel answers, correctly."""
    from test_kernel_tc_schedule import reference_f64, visibility

    (case,) = _tc_cases(1, 4200, dtype=torch.bfloat16, D=64)
    q = case["q"]
    base = torch.empty(q.numel() + 1, dtype=q.dtype)
    base[1:] = q.reshape(-1)
    case = dict(case, q=base[1:].view(q.shape))
    c = map_tensors({k: v for k, v in case.items() if k != "num_sms"}, lambda t: t.cuda())
    c["q"] = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape).copy_(q)
    out = ops.prefix_verify_attention(c["q"], c["k_new"], c["v_new"], c["key_cache"], c["value_cache"], c["md"])
    ref = reference_f64(case, visibility(case))
    assert float((out.cpu().double() - torch.from_numpy(ref)).abs().max()) < 3e-2


def _ring_case(D: int):
    """One request, two copies after 900 and 1000 cached tokens, 8-token suffixes, G = 8: 128
    packed rows, so every warp of a 128-row tile holds rows in both its m16 tiles, and a split
    walks many key tiles (bf16, block size 16, a permuted block table)."""
    import numpy as np

    from parse_vllm.ops import PrefixVerifyMetadata

    g = torch.Generator().manual_seed(D)
    Hkv, G, L, prefixes, bs = 1, 8, 8, (900, 1000), 16
    T, nb = L * len(prefixes), -(-max(prefixes) // bs) + 1
    rnd = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    return dict(
        q=rnd(T, G * Hkv, D), k_new=rnd(T, Hkv, D), v_new=rnd(T, Hkv, D),
        key_cache=rnd(nb + 3, bs, Hkv, D), value_cache=rnd(nb + 3, bs, Hkv, D),
        md=PrefixVerifyMetadata(
            block_table=torch.randperm(nb + 3, generator=g)[:nb].int().view(1, nb).contiguous(),
            copy_req=torch.zeros(2, dtype=torch.int32), copy_prefix_len=torch.tensor(prefixes, dtype=torch.int32),
            cu_copy_lens=torch.from_numpy(np.array([0, L, 2 * L], dtype=np.int32)), num_actual_tokens=T,
            scale=D**-0.5, max_prefix_len=max(prefixes),
        ),
    )  # fmt: skip


def test_one_small_case_of_each_kernel(monkeypatch):
    """The cases scripts/gpu_check.sh runs under compute-sanitizer (memcheck, racecheck), each
    against float64 here and the emulator's pair counts: the tensor-core kernel at each tile
    shape (D = 64 and 80: 128 rows x 64 keys; D = 128: 128 x 32; D = 256, its one-stage
    variant: 64 x 32), all 4 warps holding rows, with several splits (the merge), and with
    max_prefix_len = 1 below both prefixes (issue 49 C1: one split whose CTA walks every key
    tile, so every ring stage is refilled many times: 16 tiles of 64 keys, 32 of 32), a call
    whose cu_copy_lens stops short of T (C2: the rows past it untouched, with and without
    splits), and the CUDA-core kernel."""
    import dataclasses

    from test_kernel_tc_schedule import emulate, reference_f64, visibility

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for D in (64, 80, 128, 256):
        case = _ring_case(D)
        ref = torch.from_numpy(reference_f64(case, visibility(case)))
        md = case["md"]
        T, Hq, _ = case["q"].shape
        for max_prefix_len in (1000, 1):
            plan = torch.ops.parse_vllm.prefix_verify_tc_plan(max_prefix_len, T, 2, Hq, 1, sms, D)
            assert (plan[0] > 1) == (max_prefix_len == 1000), plan  # several splits, then one
            c = dict(case, md=dataclasses.replace(md, max_prefix_len=max_prefix_len))
            assert float((_run_on_gpu(c).double() - ref).abs().max()) < 3e-2, (D, max_prefix_len)
            _, visits = emulate(dict(c, num_sms=sms), check_values=False)
            assert int(visits.max()) == 1 and int(visits.sum()) == int(visibility(c).sum()) * Hq
        # cu_copy_lens[-1] = 8 < T = 16: rows 8.. keep what out held
        short = dataclasses.replace(md, cu_copy_lens=torch.tensor([0, 8, 8], dtype=torch.int32))
        for max_prefix_len in (1000, 1):
            c = map_tensors(
                dict(case, md=dataclasses.replace(short, max_prefix_len=max_prefix_len)), lambda t: t.cuda()
            )
            out = torch.full_like(c["q"], 7.0)
            ops.prefix_verify_attention(
                c["q"], c["k_new"], c["v_new"], c["key_cache"], c["value_cache"], c["md"], out=out
            )
            torch.cuda.synchronize()
            assert bool((out[8:] == 7.0).all()), (D, max_prefix_len)
            assert float((out[:8].cpu().double() - ref[:8]).abs().max()) < 3e-2
    (case,) = _tc_cases(1, 4300, dtype=torch.bfloat16, D=64)
    ref = reference_f64(case, visibility(case))
    monkeypatch.setenv("PARSE_VLLM_CUDA_KERNEL", "cuda-core")
    assert float((_run_on_gpu(case).double() - torch.from_numpy(ref)).abs().max()) < 3e-2
