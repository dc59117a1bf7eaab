"""How the verifiers split their copies into forwards: never more suffix tokens in one
forward than the engine's max_num_batched_tokens (vLLM compiles the model for sizes up to
it and asserts beyond), nor more scratch blocks than the forked verifier holds, nor more
rows than the backend's per-request buffers."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from parse_vllm.templates import LabelScoring
from parse_vllm.verify import CopyBatch
from parse_vllm.verify.base import pass_ranges
from parse_vllm.verify.forked import ForkedBlockTableVerifier

SUFFIX = tuple(range(100, 130))  # 30 tokens


def _forked(scratch: int, max_tokens: int | None, max_rows: int | None = None, block_size: int = 16):
    return ForkedBlockTableVerifier(
        SimpleNamespace(device="cpu"),
        scratch_ids=np.arange(10_000, 10_000 + scratch),
        max_rows_per_pass=max_rows,
        suffix_ids=SUFFIX,
        labels=LabelScoring(yes_ids=(1,), no_ids=(2,), extension=()),
        kv_cache_group_id=0,
        layer_names=["l0"],
        layer_caches=[],
        num_blocks=20_000,
        block_size=block_size,
        max_tokens_per_pass=max_tokens,
    )


def _copies(n: int, seed: int = 0) -> CopyBatch:
    rng = np.random.default_rng(seed)
    return CopyBatch(req_row=np.sort(rng.integers(0, 8, n)), prefix_len=rng.integers(40, 900, n))


def _check_cover(passes, n):
    assert passes[0][0] == 0 and passes[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(passes, passes[1:]))
    assert all(e > s for s, e in passes)


@pytest.mark.parametrize("max_tokens", [2048, 512, 30, None])
def test_forked_passes_stay_within_max_num_batched_tokens(max_tokens):
    """200 copies of a 30-token suffix with 1,000 scratch blocks: the scratch pool alone
    would allow ~500 copies a pass (6,000 tokens); each pass keeps to the token limit."""
    v = _forked(scratch=1000, max_tokens=max_tokens)
    copies = _copies(200)
    passes = v._passes(copies)
    _check_cover(passes, 200)
    tokens = [(e - s) * len(SUFFIX) for s, e in passes]
    if max_tokens is None:
        assert passes == [(0, 200)]
    else:
        assert max(tokens) <= max_tokens
        assert len(passes) == -(-200 // (max_tokens // len(SUFFIX)))  # no pass smaller than it must be


def test_forked_passes_keep_every_limit_at_once():
    v = _forked(scratch=12, max_tokens=300, max_rows=7, block_size=16)  # 10 copies by tokens, 7 by rows
    copies = _copies(60, seed=3)
    passes = v._passes(copies)
    _check_cover(passes, 60)
    need = v._need(copies.prefix_len)
    for s, e in passes:
        assert e - s <= 7 and (e - s) * len(SUFFIX) <= 300 and need[s:e].sum() <= 12


def test_a_token_limit_below_one_copy_is_refused():
    with pytest.raises(ValueError, match="cannot hold one copy of the 30-token verification suffix"):
        _forked(scratch=100, max_tokens=29)


def test_pass_ranges_worked_example():
    assert pass_ranges(5, 3, need=np.array([2, 1, 2, 2, 1]), capacity=4) == [(0, 2), (2, 4), (4, 5)]
    assert pass_ranges(0, 3) == []
    assert pass_ranges(4, None) == [(0, 4)]
