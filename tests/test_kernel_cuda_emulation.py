"""Line-by-line Python model of the CUDA kernel's schedule, checked on the CPU.

csrc/cuda/prefix_verify_attention.cu has never run on a GPU here.  This module
ports its host launch logic (split count, chunk, grid size) and its kernels'
index logic (thread 0's scan from blockIdx.x to a group's row tile, the
token-major row mapping, the per-CTA key range, the split-0 suffix pass, the
writer rule for split partial states and the merge kernel's reading rule) to
Python, keeping the names of the .cu, and checks the result against the
reference on cases that force one and many splits, several row tiles per group,
copies without tokens and sliding windows.  It validates the algorithm and the
bookkeeping, not CUDA specifics (warp shuffles, shared-memory indexing, vector
loads): those are covered only by tests/test_kernel_cuda.py on a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernel_cpu import make_case, nested, reference

KT = 32
MIN_SPLIT_KEYS = 256
NEG_INF = float("-inf")


def ceil_div(a, b):
    return (a + b - 1) // b


def group_end(copy_req, c0):
    c = c0 + 1
    while c < len(copy_req) and copy_req[c] == copy_req[c0]:
        c += 1
    return c


def window_lo(P, j, W):
    return max(P + j - W + 1, 0) if W > 0 else 0


def emulate(case, sms=108):
    md = case["md"]
    T = md.num_actual_tokens  # the op gets rows [0, T) (parse_vllm.ops.op_arguments)
    q, k_new, v_new = case["q"][:T].float(), case["k_new"][:T].float(), case["v_new"][:T].float()
    kc, vc = case["key_cache"].float(), case["value_cache"].float()
    bt = md.block_table.tolist()
    copy_req, plen, cu = md.copy_req.tolist(), md.copy_prefix_len.tolist(), md.cu_copy_lens.tolist()
    scale, softcap, W = md.scale, md.softcap, md.sliding_window or 0
    T, Hq, D = q.shape
    Hkv = k_new.shape[1]
    G = Hq // Hkv
    C = len(copy_req)
    bs = kc.shape[1]
    ROWS = 64 if D <= 128 else 24
    # ---- launch()
    est_tiles = ceil_div(T * G, ROWS)
    max_tiles = est_tiles + C
    bound = md.max_prefix_len or len(bt[0]) * bs  # the caller's bound, else the block table's width
    max_splits = max(1, bound // MIN_SPLIT_KEYS)
    S = min(max_splits, ceil_div(2 * sms, max(1, est_tiles * Hkv)))
    S = max(1, min(S, 64))
    chunk = ceil_div(ceil_div(max(bound, 1), S), KT) * KT
    S = max(1, ceil_div(max(bound, 1), chunk))
    out = torch.full((T, Hq, D), float("nan"))
    ws_m = torch.full((S, T, Hq), float("nan"))
    ws_l = torch.full((S, T, Hq), float("nan"))
    ws_acc = torch.full((S, T, Hq, D), float("nan"))

    for bx in range(max_tiles):
        for h in range(Hkv):
            for split in range(S):
                # ---- thread 0's scan
                found, tiles, c = False, 0, 0
                while c < C:
                    ce = group_end(copy_req, c)
                    rows = (cu[ce] - cu[c]) * G
                    nt = ceil_div(rows, ROWS)
                    if bx < tiles + nt:
                        found, c0, c1, row0 = True, c, ce, (bx - tiles) * ROWS
                        break
                    tiles += nt
                    c = ce
                if not found:
                    continue
                tok0 = cu[c0]
                rows_g = (cu[c1] - tok0) * G
                # ---- my rows
                row_t, row_p, row_j, row_c = [-1] * ROWS, [0] * ROWS, [0] * ROWS, [-1] * ROWS
                sh_lo, sh_hi, need = 2**31 - 1, 0, False
                for tid in range(ROWS):
                    rho = row0 + tid
                    if rho < rows_g:
                        t = tok0 + rho // G
                        cc = c0
                        while cu[cc + 1] <= t:
                            cc += 1
                        P, j = plen[cc], t - cu[cc]
                        if P > 0:
                            sh_lo, sh_hi = min(sh_lo, window_lo(P, j, W)), max(sh_hi, P)
                        if split == 0 or split * chunk < P:
                            need = True
                        row_t[tid], row_p[tid], row_j[tid], row_c[tid] = t, P, j, cc
                if not need:
                    continue
                valid = [r for r in range(ROWS) if row_t[r] >= 0]
                cfirst, clast = row_c[0], row_c[valid[-1]]
                Qs = torch.zeros(ROWS, D)
                for r in valid:
                    Qs[r] = q[row_t[r], h * G + (row0 + r) % G] * scale
                m = torch.full((ROWS,), NEG_INF)
                l = torch.zeros(ROWS)
                acc = torch.zeros(ROWS, D)
                ok = torch.tensor([t >= 0 for t in row_t])
                P_t, j_t, c_t = torch.tensor(row_p), torch.tensor(row_j), torch.tensor(row_c)
                lo_t = (P_t + j_t - W + 1).clamp(min=0) if W > 0 else torch.zeros(ROWS, dtype=torch.long)

                # called only within this iteration, so the loop variables it reads are current
                def process_tile(Ks, Vs, n, vis):  # vis: [ROWS, n] bool
                    nonlocal m, l, acc
                    s = Qs @ Ks[:n].T  # noqa: B023
                    if softcap > 0:
                        s = softcap * torch.tanh(s / softcap)
                    x = torch.where(vis & ok[:, None], s, torch.full_like(s, NEG_INF))  # noqa: B023
                    m_new = torch.maximum(m, x.max(1).values)
                    seen = m_new != NEG_INF  # rows that have seen something (else: untouched)
                    m_safe = torch.where(seen, m_new, torch.zeros_like(m_new))
                    alpha = torch.where(m == NEG_INF, torch.zeros_like(m), torch.exp(m - m_safe))
                    w = torch.where(x == NEG_INF, torch.zeros_like(x), torch.exp(x - m_safe[:, None]))
                    l = torch.where(seen, l * alpha + w.sum(1), l)
                    acc = torch.where(seen[:, None], acc * alpha[:, None] + w @ Vs[:n], acc)
                    m = m_new

                req = copy_req[c0]
                split_lo = split * chunk
                kb, ke = max(split_lo, sh_lo), min(sh_hi, split_lo + chunk)
                k0 = kb
                while k0 < ke:
                    n = min(KT, ke - k0)
                    idx = [bt[req][(k0 + i) // bs] for i in range(n)]
                    slot = [(k0 + i) % bs for i in range(n)]
                    Ks = kc[idx, slot, h]
                    Vs = vc[idx, slot, h]
                    keys = k0 + torch.arange(n)
                    process_tile(Ks, Vs, n, (keys[None] < P_t[:, None]) & (keys[None] >= lo_t[:, None]))
                    k0 += KT
                if split == 0:
                    for cc in range(cfirst, clast + 1):
                        t0, L = cu[cc], cu[cc + 1] - cu[cc]
                        for j0 in range(0, L, KT):
                            n = min(KT, L - j0)
                            jk = j0 + torch.arange(n)
                            vis = (c_t[:, None] == cc) & (jk[None] <= j_t[:, None])
                            if W > 0:
                                vis &= (j_t[:, None] - jk[None]) < W
                            process_tile(k_new[t0 + j0 : t0 + j0 + n, h], v_new[t0 + j0 : t0 + j0 + n, h], n, vis)
                # ---- write
                for r in valid:
                    t, hq = row_t[r], h * G + (row0 + r) % G
                    if S == 1:
                        out[t, hq] = acc[r] * (1.0 / l[r] if l[r] > 0 else 0.0)
                    elif split == 0 or split * chunk < row_p[r]:
                        ws_m[split, t, hq], ws_l[split, t, hq], ws_acc[split, t, hq] = m[r], l[r], acc[r]
    if S > 1:  # ---- merge kernel
        for t in range(T):
            lo, hi = 0, C
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if cu[mid] <= t:
                    lo = mid
                else:
                    hi = mid
            ns = min(max(ceil_div(plen[lo], chunk), 1), S)
            for hq in range(Hq):
                mm = ws_m[:ns, t, hq]
                assert not torch.isnan(mm).any(), "merge reads a split partial that was never written"
                M = mm.max()
                w = torch.where(mm == NEG_INF, torch.zeros(()), torch.exp(mm - M))
                lsum = (w * ws_l[:ns, t, hq]).sum()
                out[t, hq] = (w[:, None] * ws_acc[:ns, t, hq]).sum(0) / lsum
    return out, S


@pytest.mark.parametrize(
    "copies,kw,sms,want_split",
    [
        (nested(0, 40, 3, 5, 10) + [(1, 20, 3)], dict(), 1, False),
        (nested(0, 700, 4, 24, 100), dict(Hq=8, Hkv=2, block_size=16), 108, True),
        (
            nested(0, 700, 4, 24, 100) + [(1, 0, 4), (1, 300, 0), (1, 299, 7)],
            dict(Hq=4, Hkv=1, block_size=32, sliding_window=90, softcap=10.0),
            108,
            True,
        ),
        ([(0, 64, 40), (0, 63, 1), (1, 65, 33)], dict(Hq=8, Hkv=1, D=256, block_size=16), 4, None),
        ([(0, 50, 4), (1, 30, 3), (0, 20, 5)], dict(Hq=6, Hkv=3, max_blocks=40), 108, True),
    ],
)
def test_cuda_schedule_model_matches_reference(copies, kw, sms, want_split):
    case = make_case(copies, seed=len(copies), **kw)
    reads = _ReadLog(case)
    got, S = emulate(reads, sms=sms)
    if want_split is not None:
        assert (S > 1) == want_split, S
    ref = reference(case)
    assert not torch.isnan(got).any(), "a row was never written"
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, err
    # the emulation read every argument the kernel takes (none ignored): every
    # tensor of the case and every field of its metadata
    want = {k for k in case if k != "md"} | {f"md.{f.name}" for f in dataclasses.fields(case["md"])}
    assert sorted(want - reads.read) == []


class _ReadLog(dict):
    """A case that records which arguments were read (metadata fields as md.<name>)."""

    def __init__(self, case):
        super().__init__(case)
        self.read: set[str] = set()

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if key == "md":
            return _MetadataReadLog(value, self.read)
        self.read.add(key)
        return value


class _MetadataReadLog:
    """A PrefixVerifyMetadata that records which fields were read."""

    def __init__(self, md, read: set[str]):
        self._md, self._read = md, read

    def __getattr__(self, name):
        self._read.add(f"md.{name}")
        return getattr(self._md, name)
