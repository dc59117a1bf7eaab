"""The tensor-core CUDA kernel's schedule, run on the CPU.

`torch.ops.parse_vllm.prefix_verify_tc_emulate` runs the schedule of
csrc/cuda/prefix_verify_attention_tc.cu -- row tiles found by the runs' tile
counts, key splits from the caller's max_prefix_len and the GPU's SM count, the
staircase classification of every (warp, key tile) as FULL / PARTIAL / SKIP,
the per-pair masks of PARTIAL tiles, which keys are loaded -- from the same
header (csrc/prefix_verify_tiling.h), with the kernel's numerics in scalar
form (bf16/fp16 inputs, logits in log2 units, P rounded to the input dtype,
fp32 online softmax per key tile, split partial states and their merge).

Over thousands of fuzzed calls: every visible (row, key) pair is accumulated
exactly once and no invisible pair at all (the emulator counts each pair it
keeps), no kept key is one the kernel would have zero-filled (the emulator
raises), and the result matches a float64 reference within the dtype's
tolerance.  The reference's visibility is written here from the op's contract,
independently of the header.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parse_vllm import ops

pytestmark = pytest.mark.skipif(not ops.has_compiled_op(), reason="compiled op not built")


def rows_per_tile(D: int) -> int:
    """pv::TcShape's kRows: 4 warps x 2 m16 tiles up to D = 128, x 1 at D = 256."""
    return 128 if D <= 128 else 64


def keys_per_tile(D: int) -> int:
    return 64 if D <= 80 else 32


def make_case(rng: np.random.Generator, *, D=None, dtype=None, big=False):
    """A random call: requests with nested or random prefixes (equal, zero, on and off
    tile edges), empty copies, GQA groups 1..8, any block size, a permuted block table,
    sometimes a window or a soft-cap, max_prefix_len exact / loose / unknown."""
    D = D or int(rng.choice([32, 64, 80, 96, 128, 256], p=[0.4, 0.2, 0.05, 0.05, 0.2, 0.1]))
    dtype = dtype or (torch.bfloat16 if rng.random() < 0.7 else torch.float16)
    G = int(rng.choice([1, 2, 4, 8]))
    Hkv = int(rng.choice([1, 2]))
    block_size = int(rng.choice([1, 5, 16, 32]))
    R = int(rng.integers(1, 4))
    max_ctx = 1500 if big else 300
    N = keys_per_tile(D)
    copies = []  # (req, prefix, L)
    for r in range(R):
        K = int(rng.integers(1, 9))
        ctx = int(rng.integers(0, max_ctx))
        kind = rng.random()
        if kind < 0.4:  # nested, evenly spaced over the second half (bench_kernel's setting)
            prefixes = [ctx // 2 + (k + 1) * (ctx - ctx // 2) // K for k in range(K)]
        elif kind < 0.6:  # on and around tile edges
            prefixes = sorted(int(max(0, N * rng.integers(0, 6) + rng.integers(-1, 2))) for _ in range(K))
        else:
            prefixes = sorted(int(x) for x in rng.integers(0, ctx + 1, size=K))
        if rng.random() < 0.2 and K > 1:
            prefixes[1] = prefixes[0]  # equal adjacent prefixes
        for p in prefixes:
            L = int(rng.choice([0, 1, 3, 24, int(rng.integers(1, 40))], p=[0.05, 0.15, 0.2, 0.3, 0.3]))
            copies.append((r, p, L))
    if rng.random() < 0.15:  # copies of one request that are not consecutive: separate runs
        rng.shuffle(copies)
    if all(L == 0 for _, _, L in copies):
        copies[0] = (copies[0][0], copies[0][1], 2)
    cu = np.concatenate([[0], np.cumsum([L for _, _, L in copies])]).astype(np.int32)
    T = int(cu[-1])
    Hq = G * Hkv
    max_p = max(p for _, p, _ in copies)
    max_blocks = -(-max_p // block_size) + int(rng.integers(1, 4))
    num_blocks = R * max_blocks + 2
    g = torch.Generator().manual_seed(int(rng.integers(1 << 31)))

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    key_cache, value_cache = rnd(num_blocks, block_size, Hkv, D), rnd(num_blocks, block_size, Hkv, D)
    block_table = torch.randperm(num_blocks, generator=g)[: R * max_blocks].int().view(R, max_blocks).contiguous()
    window = int(rng.choice([0, 0, 0, 7, 100])) if rng.random() < 0.3 else 0
    softcap = 5.0 if rng.random() < 0.15 else 0.0
    mp = rng.random()
    max_prefix_len = max_p if mp < 0.6 else (max_p + int(rng.integers(1, 500)) if mp < 0.8 else 0)
    md = ops.PrefixVerifyMetadata(
        block_table=block_table,
        copy_req=torch.tensor([r for r, _, _ in copies], dtype=torch.int32),
        copy_prefix_len=torch.tensor([p for _, p, _ in copies], dtype=torch.int32),
        cu_copy_lens=torch.from_numpy(cu),
        num_actual_tokens=T,
        scale=D**-0.5 * 1.3,
        softcap=softcap,
        sliding_window=window or None,
        max_prefix_len=max_prefix_len or None,
    )
    return dict(
        q=rnd(T, Hq, D),
        k_new=rnd(T, Hkv, D),
        v_new=rnd(T, Hkv, D),
        key_cache=key_cache,
        value_cache=value_cache,
        md=md,
        num_sms=int(rng.choice([1, 3, 16, 132])),
    )


def visibility(case) -> np.ndarray:
    """[T, Kcols + T] bool from the op's contract: suffix token t of copy c (prefix P,
    first token cu[c]) sees cached keys [max(0, P + j - W + 1), P) and its own copy's
    tokens (t - W, t], j = t - cu[c]; cached key k is column k, suffix token tk column
    Kcols + tk.  The same for every head."""
    md = case["md"]
    cu = md.cu_copy_lens.numpy()
    P = md.copy_prefix_len.numpy()
    W = md.sliding_window or 0
    T = int(cu[-1])
    Kcols = int(P.max()) if len(P) else 0
    vis = np.zeros((T, Kcols + T), dtype=bool)
    for c in range(len(P)):
        for t in range(cu[c], cu[c + 1]):
            j = t - cu[c]
            pos = P[c] + j  # absolute position of the query
            lo = max(0, pos - W + 1) if W else 0
            vis[t, lo : P[c]] = True
            tlo = max(cu[c], t - W + 1) if W else cu[c]
            vis[t, Kcols + tlo : Kcols + t + 1] = True
    return vis


def emulate(case, *, out=None, check_values=True):
    """The emulated kernel's output and pair counts; check_values=False runs the call as a GPU
    takes it (index values unchecked), for the contract breaches the kernel must survive."""
    md = case["md"]
    T, Hq, _ = case["q"].shape
    Kcols = int(md.copy_prefix_len.max()) if md.copy_prefix_len.numel() else 0
    out = torch.zeros_like(case["q"]) if out is None else out
    visits = torch.zeros((T, Hq, Kcols + T), dtype=torch.int32)
    args = ops.op_arguments(case["q"], case["k_new"], case["v_new"], case["key_cache"], case["value_cache"], md, out)
    torch.ops.parse_vllm.prefix_verify_tc_emulate(*args, case["num_sms"], visits, check_values)
    return out, visits


def reference_f64(case, vis: np.ndarray) -> np.ndarray:
    """[T, Hq, D] float64 attention over the keys `vis` marks, from the case's (rounded) inputs."""
    md = case["md"]
    q = case["q"].double().numpy()
    kn, vn = case["k_new"].double().numpy(), case["v_new"].double().numpy()
    kc, vc = case["key_cache"].double(), case["value_cache"].double()
    T, Hq, D = q.shape
    Hkv = kn.shape[1]
    G = Hq // Hkv
    P = md.copy_prefix_len.numpy()
    req = md.copy_req.numpy()
    cu = md.cu_copy_lens.numpy()
    Kcols = vis.shape[1] - T
    bs = kc.shape[1]
    out = np.zeros((T, Hq, D))
    for c in range(len(P)):
        if cu[c + 1] == cu[c]:
            continue
        idx = torch.arange(Kcols)
        blocks = md.block_table[req[c]].long()
        n_own = min(Kcols, blocks.numel() * bs)
        pos = idx[:n_own]
        phys = blocks[pos // bs]
        kcached = np.zeros((Kcols, Hkv, D))
        vcached = np.zeros((Kcols, Hkv, D))
        kcached[:n_own] = kc[phys, pos % bs].numpy()
        vcached[:n_own] = vc[phys, pos % bs].numpy()
        keys = np.concatenate([kcached, kn])  # [Kcols + T, Hkv, D]
        vals = np.concatenate([vcached, vn])
        for t in range(cu[c], cu[c + 1]):
            cols = np.nonzero(vis[t])[0]
            for hq in range(Hq):
                s = keys[cols, hq // G] @ q[t, hq] * md.scale
                if md.softcap:
                    s = md.softcap * np.tanh(s / md.softcap)
                w = np.exp(s - s.max())
                out[t, hq] = (w / w.sum()) @ vals[cols, hq // G]
    return out


def test_schedule_worked_example():
    """The header's worked example: one request with copies after 1000, 1100, 1200 cached
    tokens, one after 300; G = 4, D = 64: every visible pair once, none else."""
    G, Hkv, D, bs = 4, 1, 64, 16
    copies = [(0, 1000, 24), (0, 1100, 24), (0, 1200, 24), (1, 300, 24)]
    rng = np.random.default_rng(0)
    case = make_case(rng, D=D, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    cu = np.concatenate([[0], np.cumsum([L for _, _, L in copies])]).astype(np.int32)
    T = int(cu[-1])
    nb = 1200 // bs + 1
    case.update(
        q=torch.randn(T, G * Hkv, D, generator=g).bfloat16(),
        k_new=torch.randn(T, Hkv, D, generator=g).bfloat16(),
        v_new=torch.randn(T, Hkv, D, generator=g).bfloat16(),
        key_cache=torch.randn(2 * nb, bs, Hkv, D, generator=g).bfloat16(),
        value_cache=torch.randn(2 * nb, bs, Hkv, D, generator=g).bfloat16(),
        num_sms=132,
        md=ops.PrefixVerifyMetadata(
            block_table=torch.arange(2 * nb, dtype=torch.int32).view(2, nb),
            copy_req=torch.tensor([r for r, _, _ in copies], dtype=torch.int32),
            copy_prefix_len=torch.tensor([p for _, p, _ in copies], dtype=torch.int32),
            cu_copy_lens=torch.from_numpy(cu),
            num_actual_tokens=T,
            scale=D**-0.5,
            max_prefix_len=1200,
        ),
    )
    out, visits = emulate(case)
    vis = visibility(case)
    assert np.array_equal(visits.numpy(), np.repeat(vis[:, None, :], G * Hkv, axis=1).astype(np.int32))
    ref = reference_f64(case, vis)
    assert np.abs(out.double().numpy() - ref).max() < 2e-2


def _check(case):
    out, visits = emulate(case)
    vis = visibility(case)
    Hq = case["q"].shape[1]
    expected = np.repeat(vis[:, None, :], Hq, axis=1).astype(np.int32)
    v = visits.numpy()
    if not np.array_equal(v, expected):
        bad = np.argwhere(v != expected)[:5]
        raise AssertionError(
            "pairs accumulated != visible (first: [t, head, col] -> got, want): "
            + ", ".join(f"{tuple(b)} -> {v[tuple(b)]}, {expected[tuple(b)]}" for b in bad)
        )
    return out, vis


@pytest.mark.parametrize("seed", range(4))
def test_every_visible_pair_once_and_no_other(seed):
    """~2,000 fuzzed calls (head size 32 and 64 mostly: the schedule, not the arithmetic)."""
    rng = np.random.default_rng(1000 + seed)
    for i in range(500):
        case = make_case(rng, D=int(rng.choice([32, 64, 256], p=[0.6, 0.3, 0.1])))
        try:
            _check(case)
        except AssertionError as e:
            md = case["md"]
            raise AssertionError(
                f"case {i}: copy_req {md.copy_req.tolist()}, prefixes {md.copy_prefix_len.tolist()}, "
                f"cu {md.cu_copy_lens.tolist()}, window {md.sliding_window}, G {case['q'].shape[1] // case['k_new'].shape[1]}, "
                f"D {case['q'].shape[2]}, num_sms {case['num_sms']}, max_prefix_len {md.max_prefix_len}: {e}"
            ) from None


@pytest.mark.parametrize("seed", range(3))
def test_long_contexts_split_over_many_ctas(seed):
    """Longer prefixes and few rows: the split-KV path (many splits, LSE merge) on every call."""
    rng = np.random.default_rng(2000 + seed)
    for _ in range(60):
        case = make_case(rng, D=32, big=True)
        case["num_sms"] = 132
        _check(case)


@pytest.mark.parametrize("D", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_numerics_match_float64(D, dtype):
    """The emulated kernel against float64 attention over the same (rounded) inputs: within
    the tolerance of P rounded to the input dtype (bf16: 8 bits of mantissa)."""
    rng = np.random.default_rng(D * 7 + (dtype == torch.float16))
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    for _ in range(6):
        case = make_case(rng, D=D, dtype=dtype)
        out, vis = _check(case)
        ref = reference_f64(case, vis)
        err = np.abs(out.double().numpy() - ref).max()
        assert err < tol, f"max |out - ref| = {err:.4g} (tolerance {tol})"


def test_the_split_plan_follows_the_real_bound_not_the_table_width():
    """A 2k context in an engine whose block table is 32k wide: with max_prefix_len the
    schedule is the one a 2k-wide table gets (same result, same pairs)."""
    rng = np.random.default_rng(5)
    case = make_case(rng, D=32, dtype=torch.bfloat16)
    md = case["md"]
    wide = torch.zeros(
        (md.block_table.shape[0], 32768 // md.block_table.shape[1] + md.block_table.shape[1]), dtype=torch.int32
    )
    wide[:, : md.block_table.shape[1]] = md.block_table
    exact = dict(case, md=ops.PrefixVerifyMetadata(**{**md.__dict__, "max_prefix_len": int(md.copy_prefix_len.max())}))
    padded = dict(exact, md=ops.PrefixVerifyMetadata(**{**exact["md"].__dict__, "block_table": wide.contiguous()}))
    out_a, vis_a = emulate(exact)
    out_b, vis_b = emulate(padded)
    assert torch.equal(out_a, out_b) and torch.equal(vis_a, vis_b)


def test_a_prefix_beyond_max_prefix_len_is_refused():
    rng = np.random.default_rng(6)
    case = make_case(rng, D=32)
    md = case["md"]
    bad = ops.PrefixVerifyMetadata(**{**md.__dict__, "max_prefix_len": max(1, int(md.copy_prefix_len.max()) - 1)})
    if int(md.copy_prefix_len.max()) <= 1:
        pytest.skip("degenerate case")
    with pytest.raises(ValueError, match=r"copy_prefix_len\[\d+\]=\d+ exceeds max_prefix_len=\d+"):
        ops.prefix_verify_attention(
            case["q"], case["k_new"], case["v_new"], case["key_cache"], case["value_cache"], bad
        )


def _with(case, **md_changes):
    return dict(case, md=ops.PrefixVerifyMetadata(**{**case["md"].__dict__, **md_changes}))


@pytest.mark.parametrize("seed", range(2))
def test_a_prefix_past_max_prefix_len_loses_no_key_on_a_gpu(seed):
    """Issue 49 C1. With its indices on a GPU the op cannot read the prefixes (that would
    synchronise), so a max_prefix_len below a prefix (a caller's mistake, or a CUDA graph
    captured with shorter prefixes and replayed with longer ones) reaches the kernel. The
    splits are planned for max_prefix_len; the last one runs on to the rows' largest prefix,
    so every visible pair is still accumulated once, with one split and with many."""
    rng = np.random.default_rng(3000 + seed)
    n_split = 0
    for i in range(40):
        case = make_case(rng, D=int(rng.choice([32, 64, 256])), big=True)
        top = int(case["md"].copy_prefix_len.max())
        if top < 2:
            continue
        case["num_sms"] = int(rng.choice([1, 16, 132]))
        short = _with(case, max_prefix_len=int(rng.integers(1, top)))
        T, Hq, D = case["q"].shape
        G = Hq // case["k_new"].shape[1]
        splits = torch.ops.parse_vllm.prefix_verify_tc_plan(
            short["md"].max_prefix_len, T, len(case["md"].copy_req), G, case["k_new"].shape[1], case["num_sms"], D
        )[0]
        n_split += splits > 1
        out, vis = _check_with(short, check_values=False)
        ref = reference_f64(short, vis)
        tol = 3e-2 if case["q"].dtype == torch.bfloat16 else 4e-3
        assert np.abs(out.double().numpy() - ref).max() < tol, f"case {i}"
    assert n_split >= 5, n_split  # the many-split path was taken


def test_rows_past_cu_copy_lens_are_left_alone(monkeypatch):
    """Issue 49 C2. cu_copy_lens[-1] < T breaks the contract (checked only where the indices
    are on the host): the kernel writes the rows of the copies and leaves out[cu[-1]:T] as it
    was, with one split and with several (the merge used to write uninitialised workspace
    there). cu_copy_lens[-1] > T: nothing is read or written past T."""
    rng = np.random.default_rng(7)
    seen = set()
    for i in range(30):
        case = make_case(rng, D=32, big=bool(i % 2))
        case["num_sms"] = int(rng.choice([1, 132]))
        T, Hq, D = case["q"].shape
        Hkv = case["k_new"].shape[1]
        extra = 5
        long = dict(
            case,
            q=torch.cat([case["q"], torch.randn(extra, Hq, D).to(case["q"].dtype)]),
            k_new=torch.cat([case["k_new"], torch.randn(extra, Hkv, D).to(case["q"].dtype)]),
            v_new=torch.cat([case["v_new"], torch.randn(extra, Hkv, D).to(case["q"].dtype)]),
        )
        long["md"] = ops.PrefixVerifyMetadata(**{**case["md"].__dict__, "num_actual_tokens": T + extra})
        splits = torch.ops.parse_vllm.prefix_verify_tc_plan(
            long["md"].max_prefix_len or 0, T + extra, len(case["md"].copy_req), Hq // Hkv, Hkv, case["num_sms"], D
        )[0]
        seen.add(splits > 1)
        sentinel = torch.full_like(long["q"], 7.0)
        out, visits = emulate(long, out=sentinel, check_values=False)
        assert torch.equal(out[T:], torch.full_like(out[T:], 7.0)), f"case {i}: rows past cu[-1] written"
        assert int(visits[T:].sum()) == 0
        ref_out, ref_visits = emulate(case)
        assert torch.equal(out[:T], ref_out) and torch.equal(
            visits[:T, :, : ref_visits.shape[2] - T], ref_visits[:, :, : ref_visits.shape[2] - T]
        )
        # cu[-1] > T: the kernel sees T - 3 rows
        if T > 3:
            short = dict(case, q=case["q"][: T - 3], k_new=case["k_new"][: T - 3], v_new=case["v_new"][: T - 3])
            out_s, visits_s = emulate(short, check_values=False)
            Kc = ref_visits.shape[2] - T
            assert torch.equal(visits_s[:, :, :Kc], ref_visits[: T - 3, :, :Kc])
            assert torch.equal(visits_s[:, :, Kc:], ref_visits[: T - 3, :, Kc : Kc + T - 3])
    assert seen == {True, False}


def _check_with(case, **kw):
    out, visits = emulate(case, **kw)
    vis = visibility(case)
    expected = np.repeat(vis[:, None, :], case["q"].shape[1], axis=1).astype(np.int32)
    assert np.array_equal(visits.numpy(), expected), "pairs accumulated != visible"
    return out, vis


# The goal shapes on an H100 (132 SMs, 2 CTAs each: 264 slots), head size 128, 24-token
# suffixes.
@pytest.mark.parametrize("ctx, K, Hq, Hkv", ops.GOAL_SHAPES)
def test_the_split_count_is_the_cost_models_best(ctx, K, Hq, Hkv):
    """Issue 49 P2 / P4: the split count is the cost model's best over every count (checked by
    brute force from the costs csrc/prefix_verify_tiling.h documents: waves x (key tiles per
    split + 2), a last wave of at most 15 % of the slots free, 5 more with a merge; ties to
    fewer splits); the real row tiles' CTAs fill whole waves but for such a sliver, or fill
    their last wave at least half."""
    T, G = K * 24, Hq // Hkv
    splits, chunk, bound, ctas, rows, keys = torch.ops.parse_vllm.prefix_verify_tc_plan(ctx, T, K, G, Hkv, 132, 128)
    assert (rows, keys) == (rows_per_tile(128), keys_per_tile(128))
    tiles = -(-T * G // rows)
    assert chunk % keys == 0 and (splits - 1) * chunk < ctx <= splits * chunk
    assert bound == tiles + K and ctas == bound * Hkv * splits

    def cdiv(a, b):
        return -(-a // b)

    key_tiles = cdiv(ctx, keys)

    def cost(s):
        charged = tiles * Hkv * s - 264 * 15 // 100
        waves = cdiv(charged, 264) if charged > 264 else 1
        return waves * (cdiv(key_tiles, s) + 2) + (5 if s > 1 else 0)

    # split counts of distinct chunks, each at least 128 keys, at most 64
    min_tiles = cdiv(128, keys)
    counts = [s for s in range(1, min(64, cdiv(key_tiles, min_tiles)) + 1) if cdiv(key_tiles, cdiv(key_tiles, s)) == s]
    best = min(cost(s) for s in counts)
    assert cost(splits) == best and splits == min(s for s in counts if cost(s) == best)
    excess = tiles * Hkv * splits % 264
    assert excess == 0 or excess <= 264 * 15 // 100 or excess >= 132, (splits, excess)


def test_one_wave_of_unsplit_ctas_means_no_split():
    """Enough rows to fill the GPU's waves without splitting: one split, no workspace, no merge."""
    # D 128 (128-row tiles): 44 copies x 24 tokens x G 4 = 4224 rows = 33 tiles x 8 kv heads =
    # 264 CTAs: one full wave
    assert torch.ops.parse_vllm.prefix_verify_tc_plan(8192, 44 * 24, 44, 4, 8, 132, 128)[0] == 1
    # 88 copies: 528 CTAs, two full waves
    assert torch.ops.parse_vllm.prefix_verify_tc_plan(32768, 88 * 24, 88, 4, 8, 132, 128)[0] == 1
    # D 256 (64-row tiles): 22 copies fill a wave as well
    assert torch.ops.parse_vllm.prefix_verify_tc_plan(8192, 22 * 24, 22, 4, 8, 132, 256)[0] == 1
    # a 2k context and one small request (12 row tiles x 2 kv heads): split, into one wave and
    # at most a sliver of 15 % of the next
    s = torch.ops.parse_vllm.prefix_verify_tc_plan(2048, 16 * 24, 16, 4, 2, 132, 128)[0]
    assert s > 1 and 12 * 2 * s <= 264 + 264 * 15 // 100
