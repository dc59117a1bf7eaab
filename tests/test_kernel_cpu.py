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
import random

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


def _good():
    return make_case(nested(0, 40, 3, 4, 10) + [(1, 20, 3)], seed=40)


def _call(case, out=None):
    return ops.prefix_verify_attention(**case, out=out)


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


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda c: c.update(q=c["q"].to(torch.bfloat16)), "dtype"),
        (lambda c: c.update(key_cache=c["key_cache"].double(), value_cache=c["value_cache"].double()), "dtype"),
        (
            lambda c: c.update(
                q=c["q"].double(),
                k_new=c["k_new"].double(),
                v_new=c["v_new"].double(),
                key_cache=c["key_cache"].double(),
                value_cache=c["value_cache"].double(),
            ),
            "dtype",
        ),
        (_md(block_table=lambda t: t.long()), "int32"),
        (_md(cu_copy_lens=lambda t: t.long()), "int32"),
        (lambda c: c.update(q=c["q"][:-1]), r"\[T="),
        (lambda c: c.update(q=c["q"][:, :3]), "multiple"),
        (lambda c: c.update(q=c["q"].reshape(-1)), r"\[T, Hq, D\]"),
        (lambda c: c.update(k_new=c["k_new"][:, :, :32]), "k_new"),
        (lambda c: c.update(v_new=c["v_new"][:, :1]), "differ"),
        (lambda c: c.update(key_cache=c["key_cache"][..., :32]), "key_cache"),
        (lambda c: c.update(value_cache=c["value_cache"][:3]), "differ"),
        (_md(block_table=lambda t: t[0]), "block_table"),
        (_md(copy_prefix_len=lambda t: t[:-1]), "copy_prefix_len"),
        (_md(cu_copy_lens=lambda t: t[:-1]), "C\\+1"),
        (_set("cu_copy_lens", -1, 99), "must equal the number of suffix tokens"),
        (_set("cu_copy_lens", 0, 1), r"cu_copy_lens\[0\]"),
        (_set("cu_copy_lens", 2, 1), "non-decreasing"),
        (_set("copy_req", 0, 5), "not a block-table row"),
        (_set("copy_prefix_len", 1, 10_000), "longer than the block table holds"),
        (_set("copy_prefix_len", 1, -1), "negative"),
        (_set("block_table", (0, 0), 10_000), "outside the cache"),
        (_md(scale=lambda _: 0.0), "scale"),
        (_md(softcap=lambda _: -1.0), "softcap"),
        (_md(sliding_window=lambda _: -3), "sliding_window"),
        (lambda c: c.update(key_cache=c["key_cache"].transpose(1, 2)), "key_cache"),
        (lambda c: c.update(q=c["q"].transpose(0, 2).contiguous().transpose(0, 2)), "contiguous head dim"),
    ],
)
def test_bad_inputs_raise_value_error(mutate, match):
    case = _good()
    mutate(case)
    with pytest.raises(ValueError, match=match):
        _call(case)


def test_bad_head_size_and_out():
    case = make_case([(0, 10, 2)], D=48, seed=41)
    with pytest.raises(ValueError, match="head size"):
        _call(case)
    case = _good()
    with pytest.raises(ValueError, match="out must have"):
        _call(case, out=torch.empty(3, 4, 64))
    with pytest.raises(ValueError, match="out has dtype"):
        _call(case, out=torch.empty_like(case["q"], dtype=torch.bfloat16))


def test_compiled_op_checks_values_itself():
    """Called directly (not through the face), the compiled op still refuses
    bad values (its one check reads them: the index tensors are on the CPU)."""
    case = _good()
    case["md"].copy_prefix_len[1] = 10_000
    out = torch.empty_like(case["q"])
    with pytest.raises(RuntimeError, match="longer than the block table holds"):
        torch.ops.parse_vllm.prefix_verify_attention(*ops.op_arguments(**case, out=out))
    case = _good()
    case["md"].cu_copy_lens[-1] = 3
    with pytest.raises(RuntimeError, match="cu_copy_lens"):
        torch.ops.parse_vllm.prefix_verify_attention(*ops.op_arguments(**case, out=out))


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
