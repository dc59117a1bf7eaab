"""CPU twin of torch.ops.parse_vllm.prefix_verify_attention vs the plain-PyTorch reference.

A case is the face's arguments (q, k_new, v_new, key_cache, value_cache and
md, a PrefixVerifyMetadata), so that `ops.prefix_verify_attention(**case)` and
`prefix_verify_attention_ref(**case)` take it as it is; tests that call the
compiled op directly spell its flat arguments with `ops.op_arguments(**case,
out=out)`.  Every case draws fresh random inputs (never zeros), poisons `out`
with NaN before the call and checks that every element was written.  Errors are
normwise: max|out - ref| / max|ref|, with ref computed in fp32 from the same
(rounded) inputs.  Budget: fp32 1e-5, bf16 2e-2, fp16 5e-3.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys

import pytest
import torch

import parse_vllm.ops as ops
from parse_vllm.ops import PrefixVerifyMetadata
from parse_vllm.ops.reference import prefix_verify_attention_dense_ref, prefix_verify_attention_ref

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
LAYOUTS = ("vllm_fa", "contig", "flashinfer_nhd", "hnd")


# --------------------------------------------------------------------------- inputs


def make_case(
    copies,  # list of (request, prefix_len, suffix_len), in packed order
    *,
    num_requests=None,
    Hq=4,
    Hkv=2,
    D=64,
    block_size=16,
    dtype=torch.float32,
    layout="vllm_fa",
    strided_q=False,
    max_blocks=None,
    seed=0,
    softcap=0.0,
    sliding_window=None,
):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        # never zeros: N(0, 1) shifted away from 0 a little
        x = torch.randn(*shape, generator=g)
        return (x + 0.05 * torch.sign(x)).to(dtype)

    R = num_requests or (max(r for r, _, _ in copies) + 1)
    longest = [0] * R
    for r, p, _ in copies:
        longest[r] = max(longest[r], p)
    need = max([-(-p // block_size) for p in longest] + [1])
    max_blocks = max_blocks or need + 1
    num_blocks = R * max_blocks + 3
    if layout == "vllm_fa":  # [2, num_blocks, block_size, Hkv, D]; K = kv[0], V = kv[1]
        kv = rnd(2, num_blocks, block_size, Hkv, D)
        key_cache, value_cache = kv[0], kv[1]
    elif layout == "contig":
        key_cache, value_cache = rnd(num_blocks, block_size, Hkv, D), rnd(num_blocks, block_size, Hkv, D)
    elif layout == "flashinfer_nhd":  # [num_blocks, 2, block_size, Hkv, D]
        kv = rnd(num_blocks, 2, block_size, Hkv, D)
        key_cache, value_cache = kv[:, 0], kv[:, 1]
    elif layout == "hnd":  # [num_blocks, Hkv, block_size, D] -> logical view
        key_cache = rnd(num_blocks, Hkv, block_size, D).transpose(1, 2)
        value_cache = rnd(num_blocks, Hkv, block_size, D).transpose(1, 2)
    else:
        raise AssertionError(layout)
    perm = torch.randperm(num_blocks, generator=g)[: R * max_blocks].int()
    block_table = perm.view(R, max_blocks).contiguous()
    cu = [0]
    for _, _, L in copies:
        cu.append(cu[-1] + L)
    T = cu[-1]
    if strided_q:  # q/k/v as slices of one fused qkv projection, as in vLLM
        qkv = rnd(T, (Hq + 2 * Hkv) * D)
        q = qkv[:, : Hq * D].view(T, Hq, D)
        k_new = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
        v_new = qkv[:, (Hq + Hkv) * D :].view(T, Hkv, D)
    else:
        q, k_new, v_new = rnd(T, Hq, D), rnd(T, Hkv, D), rnd(T, Hkv, D)
    return dict(
        q=q,
        k_new=k_new,
        v_new=v_new,
        key_cache=key_cache,
        value_cache=value_cache,
        md=PrefixVerifyMetadata(
            block_table=block_table,
            copy_req=torch.tensor([r for r, _, _ in copies], dtype=torch.int32),
            copy_prefix_len=torch.tensor([p for _, p, _ in copies], dtype=torch.int32),
            cu_copy_lens=torch.tensor(cu, dtype=torch.int32),
            num_actual_tokens=T,
            scale=D**-0.5 * 1.3,
            softcap=softcap,
            sliding_window=sliding_window,
        ),
    )


def map_tensors(case, fn):
    """The case with `fn` applied to every tensor, the metadata's included
    (a new metadata object; the other fields as they were)."""
    md = case["md"]
    md = dataclasses.replace(
        md,
        **{
            f.name: fn(getattr(md, f.name))
            for f in dataclasses.fields(md)
            if isinstance(getattr(md, f.name), torch.Tensor)
        },
    )
    return {k: (md if k == "md" else fn(v) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def tensors(case):
    """name -> tensor for every tensor of the case, the metadata's as md.<field>."""
    md = case["md"]
    named = {k: v for k, v in case.items() if isinstance(v, torch.Tensor)}
    for f in dataclasses.fields(md):
        if isinstance(getattr(md, f.name), torch.Tensor):
            named[f"md.{f.name}"] = getattr(md, f.name)
    return named


def run_op(case, out=None, strided_out=False):
    q = case["q"]
    if out is None:
        if strided_out:
            big = torch.full((q.shape[0], q.shape[1] + 1, q.shape[2]), float("nan"), dtype=q.dtype)
            out = big[:, 1:]
        else:
            out = torch.full_like(q, float("nan"))
    else:
        out.fill_(float("nan"))
    res = ops.prefix_verify_attention(**case, out=out)
    assert res is out
    return out


def _upcast(case):
    return map_tensors(case, lambda t: t.float() if t.is_floating_point() else t)


def reference(case):
    return prefix_verify_attention_ref(**_upcast(case))


def check(case, strided_out=False):
    out = run_op(case, strided_out=strided_out)
    assert not torch.isnan(out).any(), "output not fully written (NaN poison left)"
    ref = reference(case)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    tol = TOL[case["q"].dtype]
    assert err <= tol, f"relative error {err:.3e} > {tol:.0e}"
    return err


def nested(req, P, K, L, step):
    """K copies of request `req` with nested prefixes P - (K-1)*step, ..., P."""
    return [(req, P - (K - 1 - k) * step, L) for k in range(K)]


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (8, 2), (8, 1)])  # GQA 1, 2, 4, 8
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_gqa_and_block_sizes(Hq, Hkv, block_size):
    copies = nested(0, 3 * block_size + 5, 4, 6, block_size // 2 + 3) + nested(1, 2 * block_size, 3, 5, block_size)
    check(make_case(copies, Hq=Hq, Hkv=Hkv, D=64, block_size=block_size, seed=Hq * 100 + Hkv + block_size))


@pytest.mark.parametrize("D", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_head_sizes_and_dtypes(D, dtype):
    copies = nested(0, 70, 3, 7, 20) + [(1, 33, 4)]
    check(make_case(copies, Hq=4, Hkv=2, D=D, dtype=dtype, seed=D))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_layouts(layout, dtype):
    copies = nested(0, 90, 4, 5, 17) + nested(2, 40, 2, 3, 9) + [(1, 16, 2)]
    check(make_case(copies, num_requests=3, layout=layout, dtype=dtype, block_size=32, seed=7))


def test_strided_q_kv_and_out():
    copies = nested(0, 64, 3, 6, 16)
    check(make_case(copies, strided_q=True, layout="hnd", Hq=6, Hkv=2, seed=3), strided_out=True)


# --------------------------------------------------------------------------- prefix edges


@pytest.mark.parametrize("P", [0, 1, 15, 16, 17, 31, 32, 33, 64])
def test_prefix_block_edges(P):
    # one copy ending exactly on / just off a 16-token block edge, next to copies that do not
    copies = [(0, P, 5), (0, max(P - 1, 0), 5), (0, P + 1, 5)]
    check(make_case(copies, block_size=16, seed=P))


def test_all_prefixes_zero():
    check(make_case([(0, 0, 4), (1, 0, 1), (0, 0, 3)], seed=11))


def test_one_token_suffixes():
    copies = [(0, p, 1) for p in (3, 17, 40, 41, 64)] + [(1, 5, 1)]
    check(make_case(copies, Hq=8, Hkv=2, seed=12))


def test_copy_without_suffix_tokens():
    copies = [(0, 20, 3), (0, 30, 0), (0, 40, 4), (1, 7, 0)]
    check(make_case(copies, seed=13))


def test_single_request_single_copy():
    check(make_case([(0, 100, 24)], Hq=4, Hkv=1, D=128, seed=14))


def test_many_requests_many_copies():
    rng = random.Random(15)
    copies = []
    for r in range(7):
        P = rng.randint(30, 200)
        copies += nested(r, P, rng.randint(1, 6), rng.randint(1, 9), rng.randint(1, 25) if P > 150 else 5)
    check(make_case(copies, Hq=4, Hkv=2, block_size=16, seed=15))


def test_copies_of_a_request_not_consecutive():
    copies = [(0, 50, 4), (1, 30, 3), (0, 20, 5), (1, 60, 2), (0, 70, 3)]
    check(make_case(copies, seed=16))


def test_prefixes_not_sorted():
    copies = [(0, 20, 4), (0, 90, 3), (0, 45, 5), (0, 90, 2), (0, 3, 3)]
    check(make_case(copies, seed=17))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_suffix_longer_than_a_tile(dtype):
    # the CPU twin packs 256 keys per tile, the CUDA kernel 32
    copies = [(0, 40, 300), (0, 10, 65), (0, 300, 257)]
    check(make_case(copies, Hq=2, Hkv=1, seed=18, dtype=dtype, sliding_window=50))
    check(make_case(copies, Hq=2, Hkv=1, seed=19, dtype=dtype))


# --------------------------------------------------------------------------- long prefixes (split-KV path)


@pytest.mark.parametrize("threads", [1, 2])
def test_long_prefix_split(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        copies = nested(0, 2500, 4, 24, 300)
        check(make_case(copies, Hq=4, Hkv=1, D=64, block_size=32, seed=19))
        check(make_case(copies, Hq=4, Hkv=1, D=64, block_size=32, seed=20, sliding_window=700, softcap=20.0))
    finally:
        torch.set_num_threads(old)


# --------------------------------------------------------------------------- softcap / sliding window


@pytest.mark.parametrize("softcap", [0.0, 1.0, 30.0])
@pytest.mark.parametrize("window", [None, 1, 4, 17, 64, 1000])
def test_softcap_and_window(softcap, window):
    copies = nested(0, 80, 4, 6, 21) + [(1, 33, 5), (1, 0, 3)]
    check(make_case(copies, Hq=4, Hkv=1, block_size=16, seed=21, softcap=softcap, sliding_window=window))


def test_softcap_and_window_bf16_gemma_like():
    copies = nested(0, 300, 8, 24, 30)
    check(
        make_case(
            copies, Hq=4, Hkv=1, D=256, block_size=16, dtype=torch.bfloat16, seed=22, softcap=50.0, sliding_window=128
        )
    )


# --------------------------------------------------------------------------- random fuzz


@pytest.mark.parametrize("seed", range(12))
def test_random(seed):
    rng = random.Random(1000 + seed)
    Hkv = rng.choice([1, 2, 4])
    Hq = Hkv * rng.choice([1, 2, 4, 8])
    D = rng.choice([32, 64, 80, 96, 128])
    bs = rng.choice([16, 32, 64, 128])
    copies = []
    for r in range(rng.randint(1, 4)):
        P = rng.randint(0, 300)
        for _ in range(rng.randint(1, 5)):
            copies.append((r, rng.randint(0, P), rng.randint(0, 12)))
    if sum(L for _, _, L in copies) == 0:
        copies.append((0, 5, 2))
    rng.shuffle(copies)
    case = make_case(
        copies,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        block_size=bs,
        seed=seed,
        dtype=rng.choice([torch.float32, torch.bfloat16]),
        layout=rng.choice(LAYOUTS),
        softcap=rng.choice([0.0, 0.0, 10.0]),
        sliding_window=rng.choice([None, None, rng.randint(1, 200)]),
    )
    check(case)


# --------------------------------------------------------------------------- the reference itself


def test_reference_trivial_cases():
    # prefix 0, one suffix token: the only key is the token itself -> out = v_new
    case = make_case([(0, 0, 1), (1, 0, 1)], Hq=4, Hkv=2, seed=30)
    ref = reference(case)
    torch.testing.assert_close(ref, case["v_new"].repeat_interleave(2, dim=1).float())
    # identical keys everywhere -> uniform weights -> mean of the visible values
    case = make_case([(0, 10, 3)], Hq=2, Hkv=1, D=32, seed=31)
    case["key_cache"].fill_(0.5)
    case["k_new"].fill_(0.5)
    ref = reference(case)
    vals = torch.cat([case["value_cache"][case["md"].block_table[0, 0]].float()[:10], case["v_new"].float()])
    for j in range(3):
        torch.testing.assert_close(ref[j, 0], vals[: 10 + j + 1, 0].mean(0))


def test_reference_matches_dense_mask_reference():
    copies = nested(0, 50, 3, 4, 11) + [(1, 20, 5), (0, 7, 2)]
    for kw in (dict(), dict(softcap=5.0), dict(sliding_window=9)):
        case = make_case(copies, seed=32, **kw)
        a = reference(case)
        b = prefix_verify_attention_dense_ref(**_upcast(case), use_sdpa=False)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_suffix_kv_never_written_and_inputs_untouched():
    case = make_case(nested(0, 40, 3, 5, 10), seed=33)
    before = {k: v.clone() for k, v in tensors(case).items()}
    run_op(case)
    after = tensors(case)
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]), f"{k} was modified"


# --------------------------------------------------------------------------- bad inputs
#
# Every malformed call raises, with its whole message, numbers included.  On a build whose
# `_C.so` carried its own static libstdc++ (issue 35) these messages were cut at the first
# number, or the process died (SIGSEGV) formatting it: a pattern such as r"\[T=" passed on
# the cut message.  The calls run in a child process (run_bad_inputs), one for all of
# them: a case that kills it fails as that case, and the cases after it run in a new
# child.  tests/test_build_link.py runs them against a library built with a toolchain that
# links libstdc++ statically.


def _good():
    # T = 15 suffix tokens in C = 4 copies of R = 2 requests, Hq 4, Hkv 2, D 64; a block
    # table of 4 blocks per row over 11 cache blocks of 16 tokens
    return make_case(nested(0, 40, 3, 4, 10) + [(1, 20, 3)], seed=40)


def _md(**change):
    """A mutation of the case's metadata: field -> function of the field's value."""

    def mutate(c):
        md = c["md"]
        for name, fn in change.items():
            setattr(md, name, fn(getattr(md, name)))

    return mutate


def _set(field, index, value):
    """A mutation writing one value of a metadata index tensor."""
    return lambda c: getattr(c["md"], field).__setitem__(index, value)


def _face(mutate=None, out=None, case=_good):
    """A call through the face with `case()` changed by `mutate`; `out`: a function of the case."""

    def call():
        c = case()
        if mutate is not None:
            mutate(c)
        ops.prefix_verify_attention(**c, out=None if out is None else out(c))

    return call


def _op(mutate):
    """A direct call of the compiled op (not through the face): it checks values itself
    (the index tensors are on the CPU)."""

    def call():
        c = _good()
        mutate(c)
        torch.ops.parse_vllm.prefix_verify_attention(*ops.op_arguments(**c, out=torch.empty_like(c["q"])))

    return call


_P = "prefix_verify_attention: "
_HND = (
    " (HND caches: pass cache.transpose(1, 2); FlashInfer's [num_blocks, 2, block_size, Hkv, D]: "
    "pass kv[:, 0] and kv[:, 1])"
)

# name -> (the call, the exception it raises, its whole message: through the face the message
# is the op's first line, raised as ValueError; a direct call of the op raises RuntimeError)
BAD_INPUTS = {
    "q_bfloat16": (
        _face(lambda c: c.update(q=c["q"].to(torch.bfloat16))),
        ValueError,
        _P + "k_new has dtype Float, q has BFloat16 (all must match)",
    ),
    "caches_float64": (
        _face(lambda c: c.update(key_cache=c["key_cache"].double(), value_cache=c["value_cache"].double())),
        ValueError,
        _P + "key_cache has dtype Double, q has Float (all must match)",
    ),
    "all_float64": (
        _face(
            lambda c: c.update(
                q=c["q"].double(),
                k_new=c["k_new"].double(),
                v_new=c["v_new"].double(),
                key_cache=c["key_cache"].double(),
                value_cache=c["value_cache"].double(),
            )
        ),
        ValueError,
        _P + "q has dtype Double; supported: float32, float16, bfloat16",
    ),
    "block_table_int64": (
        _face(_md(block_table=lambda t: t.long())),
        ValueError,
        _P + "block_table must be int32, got Long",
    ),
    "cu_copy_lens_int64": (
        _face(_md(cu_copy_lens=lambda t: t.long())),
        ValueError,
        _P + "cu_copy_lens must be int32, got Long",
    ),
    "q_one_row_short": (
        _face(lambda c: c.update(q=c["q"][:-1])),
        ValueError,
        _P + "k_new must be [T=14, Hkv, D=64], got shape [15, 2, 64]",
    ),
    "q_heads_not_a_multiple": (
        _face(lambda c: c.update(q=c["q"][:, :3])),
        ValueError,
        _P + "Hq=3 query heads is not a multiple of Hkv=2 kv heads",
    ),
    "q_flat": (
        _face(lambda c: c.update(q=c["q"].reshape(-1))),
        ValueError,
        _P + "q must be [T, Hq, D], got shape [15]",  # the face passes rows [0, T) of q
    ),
    "k_new_head_size": (
        _face(lambda c: c.update(k_new=c["k_new"][:, :, :32])),
        ValueError,
        _P + "k_new must be [T=15, Hkv, D=64], got shape [15, 2, 32]",
    ),
    "v_new_heads": (
        _face(lambda c: c.update(v_new=c["v_new"][:, :1])),
        ValueError,
        _P + "k_new [15, 2, 64] and v_new [15, 1, 64] differ",
    ),
    "key_cache_head_size": (
        _face(lambda c: c.update(key_cache=c["key_cache"][..., :32])),
        ValueError,
        _P + "key_cache must be a [num_blocks, block_size, Hkv=2, D=64] view, got shape [11, 16, 2, 32]" + _HND,
    ),
    "key_cache_hnd_not_transposed": (
        _face(lambda c: c.update(key_cache=c["key_cache"].transpose(1, 2))),
        ValueError,
        _P + "key_cache must be a [num_blocks, block_size, Hkv=2, D=64] view, got shape [11, 2, 16, 64]" + _HND,
    ),
    "value_cache_blocks": (
        _face(lambda c: c.update(value_cache=c["value_cache"][:3])),
        ValueError,
        _P + "key_cache [11, 16, 2, 64] and value_cache [3, 16, 2, 64] differ",
    ),
    "block_table_1d": (
        _face(_md(block_table=lambda t: t[0])),
        ValueError,
        _P + "block_table must be [R, max_blocks], got shape [4]",
    ),
    "copy_prefix_len_short": (
        _face(_md(copy_prefix_len=lambda t: t[:-1])),
        ValueError,
        _P + "copy_prefix_len has 3 entries, copy_req has 4",
    ),
    "cu_copy_lens_short": (
        _face(_md(cu_copy_lens=lambda t: t[:-1])),
        ValueError,
        _P + "cu_copy_lens must have C+1=5 entries, got 4",
    ),
    "cu_copy_lens_last_not_T": (
        _face(_set("cu_copy_lens", -1, 99)),
        ValueError,
        _P + "cu_copy_lens[-1]=99 must equal the number of suffix tokens T=15",
    ),
    "cu_copy_lens_first_not_0": (
        _face(_set("cu_copy_lens", 0, 1)),
        ValueError,
        _P + "cu_copy_lens[0] must be 0, got 1",
    ),
    "cu_copy_lens_decreasing": (
        _face(_set("cu_copy_lens", 2, 1)),
        ValueError,
        _P + "cu_copy_lens must be non-decreasing (cu[1]=4, cu[2]=1)",
    ),
    "copy_req_not_a_row": (
        _face(_set("copy_req", 0, 5)),
        ValueError,
        _P + "copy_req[0]=5 is not a block-table row (R=2)",
    ),
    "copy_prefix_len_past_the_table": (
        _face(_set("copy_prefix_len", 1, 10_000)),
        ValueError,
        _P + "copy_prefix_len[1]=10000 is longer than the block table holds (4 blocks x 16 tokens = 64)",
    ),
    "copy_prefix_len_negative": (
        _face(_set("copy_prefix_len", 1, -1)),
        ValueError,
        _P + "copy_prefix_len[1]=-1 is negative",
    ),
    "block_table_outside_the_cache": (
        _face(_set("block_table", (0, 0), 10_000)),
        ValueError,
        _P + "block_table row 0 names blocks outside the cache (0..10): block_table[0, 0]=10000",
    ),
    "scale_0": (
        _face(_md(scale=lambda _: 0.0)),
        ValueError,
        _P + "scale must be a finite float > 0, got 0",
    ),
    "softcap_negative": (
        _face(_md(softcap=lambda _: -1.0)),
        ValueError,
        _P + "softcap must be >= 0 (0 = off), got -1",
    ),
    "sliding_window_negative": (
        _face(_md(sliding_window=lambda _: -3)),
        ValueError,
        _P + "sliding_window must be >= 0 (0 = off), got -3",
    ),
    "max_prefix_len_negative": (
        _face(_md(max_prefix_len=lambda _: -1)),
        ValueError,
        _P + "max_prefix_len must be >= 0 (0 = bounded by the block table), got -1",
    ),
    "copy_prefix_len_past_max_prefix_len": (
        _face(_md(max_prefix_len=lambda _: 30)),
        ValueError,
        _P + "copy_prefix_len[2]=40 exceeds max_prefix_len=30",
    ),
    "q_head_dim_strided": (
        _face(lambda c: c.update(q=c["q"].transpose(0, 2).contiguous().transpose(0, 2))),
        ValueError,
        _P + "q must have a contiguous head dim (last stride 1), got strides [1, 15, 60]",
    ),
    "head_size_48": (
        _face(case=lambda: make_case([(0, 10, 2)], D=48, seed=41)),
        ValueError,
        _P + "head size D=48 not supported (supported: 32, 64, 80, 96, 128, 256)",
    ),
    "out_shape": (
        _face(out=lambda c: torch.empty(3, 4, 64)),
        ValueError,
        _P + "out must have q's shape [15, 4, 64], got [3, 4, 64]",
    ),
    "out_dtype": (
        _face(out=lambda c: torch.empty_like(c["q"], dtype=torch.bfloat16)),
        ValueError,
        _P + "out has dtype BFloat16, q has Float (all must match)",
    ),
    "op_copy_prefix_len_past_the_table": (
        _op(_set("copy_prefix_len", 1, 10_000)),
        RuntimeError,
        _P + "copy_prefix_len[1]=10000 is longer than the block table holds (4 blocks x 16 tokens = 64)",
    ),
    "op_cu_copy_lens_last_not_T": (
        _op(_set("cu_copy_lens", -1, 3)),
        RuntimeError,
        _P + "cu_copy_lens[-1]=3 must equal the number of suffix tokens T=15",
    ),
}

_RESULT = "BAD-INPUT-RESULT "  # the child's lines that the parent reads


def _crash():
    import ctypes

    ctypes.string_at(0)  # SIGSEGV


_RUNNER_SELF_TEST = {"_crash": (_crash, ValueError, "")}  # test_a_crashing_case_fails_alone


def _bad_inputs_child(names):
    """In the child: each case's outcome as one JSON line, a line naming the case before it runs."""
    import parse_vllm._C as C

    print(_RESULT + json.dumps({"library": C.__file__, "loaded": ops.has_compiled_op()}), flush=True)
    for name in names:
        print(_RESULT + json.dumps({"case": name}), flush=True)
        call, _, _ = {**BAD_INPUTS, **_RUNNER_SELF_TEST}[name]
        try:
            call()
            res = {"case": name, "raised": None}
        except Exception as e:  # noqa: BLE001 - the parent compares type and text
            res = {"case": name, "raised": type(e).__name__, "message": str(e)}
        print(_RESULT + json.dumps(res), flush=True)


# The child: `so` (when given) loaded as parse_vllm._C before parse_vllm.ops imports the installed one.
_CHILD = """
import importlib.util, sys
tests, so, names = sys.argv[1], sys.argv[2], sys.argv[3:]
if so:
    import torch  # the library needs torch's (libc10.so, ...)
    spec = importlib.util.spec_from_file_location("parse_vllm._C", so)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["parse_vllm._C"] = mod
    spec.loader.exec_module(mod)
sys.path.insert(0, tests)
import test_kernel_cpu
test_kernel_cpu._bad_inputs_child(names)
"""


def run_bad_inputs(names=None, so=None, timeout=300):
    """Run BAD_INPUTS' calls in child processes: name -> {"raised", "message"} or {"died": why}.

    One child runs every case; when one dies (a crash inside the op), that case is
    reported as such and the cases after it run in a new child.  `so`: a built library
    to load as parse_vllm._C instead of the installed one (its path is checked)."""
    todo = list(BAD_INPUTS if names is None else names)
    results = {}
    env = {**os.environ, "TORCH_SHOW_CPP_STACKTRACES": "0"}
    while todo:
        p = subprocess.run(
            [sys.executable, "-c", _CHILD, os.path.dirname(os.path.abspath(__file__)), so or "", *todo],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        running, library = None, None
        for line in p.stdout.splitlines():
            if not line.startswith(_RESULT):
                continue
            d = json.loads(line[len(_RESULT) :])
            if "library" in d:
                library = d
            elif "raised" in d:
                results[d["case"]] = d
                running = None
            else:
                running = d["case"]
        tail = (p.stderr or "").strip()[-3000:]
        how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit status {p.returncode}"
        if library is None or (so and os.path.realpath(library["library"]) != os.path.realpath(so)):
            why = f"the child did not load the library to test ({how}; {library}): {tail}"
            results.update({n: {"died": why} for n in todo})
            break
        if running is not None:  # it died inside this case
            results[running] = {"died": f"the child process died in this case ({how}): {tail}"}
        elif p.returncode != 0 or any(n not in results for n in todo):
            results.update(
                {n: {"died": f"the child ended before this case ({how}): {tail}"} for n in todo if n not in results}
            )
        todo = [n for n in todo if n not in results]
    return results


def bad_input_failures(results):
    """name -> what is wrong, for every case whose call did not raise its whole message."""
    wrong = {}
    for name, (_, exc, message) in BAD_INPUTS.items():
        r = results.get(name)
        if r is None:
            continue
        if "died" in r:
            wrong[name] = r["died"]
        elif r["raised"] != exc.__name__:
            wrong[name] = f"raised {r['raised']} ({r.get('message')!r}), expected {exc.__name__}"
        elif (r["message"] if exc is ValueError else (r["message"].splitlines() or [""])[0]) != message:
            # the face raises the op's first line; a direct call's error may carry a C++ backtrace after it
            wrong[name] = f"message {r['message']!r}, expected {message!r}"
    return wrong


@pytest.fixture(scope="module")
def bad_input_results():
    return run_bad_inputs()


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_raise_with_their_whole_message(name, bad_input_results):
    assert name in bad_input_results, f"{name}: no result"
    wrong = bad_input_failures({name: bad_input_results[name]})
    if wrong:
        pytest.fail(f"{name}: {wrong[name]}", pytrace=False)


def test_a_crashing_case_fails_alone():
    """The runner's own check: a case that kills its child is reported as that case's
    failure, and the cases after it still run."""
    results = run_bad_inputs(["q_bfloat16", "_crash", "out_dtype"])
    assert set(results) == {"q_bfloat16", "_crash", "out_dtype"}
    assert "died in this case (signal 11" in results["_crash"]["died"], results["_crash"]
    assert results["q_bfloat16"]["raised"] == results["out_dtype"]["raised"] == "ValueError", results


def test_op_metadata():
    assert ops.has_compiled_op(), ops.compiled_op_error()
    assert ops.cpu_isa() in ("avx512", "avx2", "default")
    case = _good()
    out = ops.prefix_verify_attention(**case)
    assert out.shape == case["q"].shape and not torch.isnan(out).any()


def test_rows_past_num_actual_tokens_are_left_alone():
    """q / k_new / v_new / out may have padding rows past md.num_actual_tokens:
    the op reads and writes rows [0, T) only."""
    case = _good()
    T = case["md"].num_actual_tokens
    padded = {k: torch.cat([case[k], torch.full_like(case[k][:5], float("nan"))]) for k in ("q", "k_new", "v_new")}
    out = torch.full((T + 5, *case["q"].shape[1:]), 7.0)
    res = ops.prefix_verify_attention(**{**case, **padded}, out=out)
    assert res is out
    assert torch.equal(out[T:], torch.full_like(out[T:], 7.0))
    ref = reference(case)
    assert ((out[:T] - ref).abs().max() / ref.abs().max()).item() <= TOL[torch.float32]
    assert ops.prefix_verify_attention(**{**case, **padded}).shape == case["q"].shape


# --------------------------------------------------------------------------- both bf16 paths


@pytest.mark.parametrize("brgemm", ["0", "1"])
@pytest.mark.parametrize("D", [64, 80, 128, 256])
def test_bf16_both_product_paths(brgemm, D, monkeypatch):
    """bf16 runs through oneDNN's brgemm (AMX) where torch supports it, else the
    at::vec fp32 micro-kernels; PARSE_VLLM_CPU_BRGEMM=0 forces the latter."""
    monkeypatch.setenv("PARSE_VLLM_CPU_BRGEMM", brgemm)
    if brgemm == "1" and not torch.ops.parse_vllm.cpu_uses_brgemm(torch.bfloat16):
        pytest.skip("torch's brgemm does not support bf16 on this CPU")
    assert torch.ops.parse_vllm.cpu_uses_brgemm(torch.bfloat16) == (brgemm == "1")
    copies = nested(0, 200, 5, 24, 33) + [(1, 65, 1), (1, 64, 7), (2, 0, 3)]
    check(
        make_case(
            copies,
            Hq=8,
            Hkv=2,
            D=D,
            dtype=torch.bfloat16,
            layout="flashinfer_nhd",
            seed=D,
            softcap=20.0 if D == 256 else 0.0,
            sliding_window=100 if D == 80 else None,
        )
    )
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # forces the split path for one (request, head) pair
    try:
        check(make_case(nested(0, 1500, 3, 9, 200), Hq=2, Hkv=1, D=D, dtype=torch.bfloat16, seed=D + 1))
    finally:
        torch.set_num_threads(old)
