"""drafting.plan_passes: which rows the drafter runs over, over which tokens."""

from __future__ import annotations

import numpy as np
import pytest

from parse_vllm.drafting import bucket, pass_spans, plan_passes


def _plan(wants, kv_len, known, max_tokens=10, max_rows=16, window=4, spec_tokens=0, room=None):
    return plan_passes(
        np.array(wants),
        np.array(kv_len),
        np.array(known),
        window=window,
        spec_tokens=spec_tokens,
        max_tokens=max_tokens,
        max_rows=max_rows,
        room=None if room is None else np.array(room),
    )


def test_the_worked_example():
    passes, kv = _plan(wants=[4, 4, 0, 2], kv_len=[10, 0, 20, 5], known=[13, 6, 22, 18])
    got = [(p.row.tolist(), p.start.tolist(), p.end.tolist(), p.num_draft) for p in passes]
    assert got == [([3], [5], [14], 0), ([0, 1], [10, 0], [12, 5], 4), ([3], [14], [17], 2)]
    assert kv.tolist() == [12, 5, 20, 17]
    assert [p.num_tokens for p in passes] == [10, 9, 4]


def test_rows_that_do_not_draft_are_in_no_pass():
    passes, kv = _plan(wants=[0, 0, 0], kv_len=[3, 0, 7], known=[9, 4, 8])
    assert passes == [] and kv.tolist() == [3, 0, 7]


@pytest.mark.parametrize("with_room", [False, True])
def test_passes_respect_their_token_and_row_limits(with_room):
    rng = np.random.default_rng(0)
    for _ in range(200):
        b = int(rng.integers(1, 12))
        known = rng.integers(2, 80, size=b)
        kv = np.minimum(rng.integers(0, 80, size=b), known - 1)
        wants = rng.integers(0, 6, size=b)
        room = wants + rng.integers(0, 4, size=b) if with_room else wants
        passes, after = _plan(wants, kv, known, max_tokens=16, max_rows=3, window=5, spec_tokens=2, room=room)
        covered = {r: [] for r in range(b)}
        for p in passes:
            assert p.num_tokens <= 16 and p.row.shape[0] <= 3
            assert p.num_draft in (0, 1, 2, 4, 5)  # buckets of wants 0..5
            for r, s, e in zip(p.row, p.start, p.end):
                covered[int(r)].append((int(s), int(e)))
        for r in range(b):
            if wants[r] == 0:
                assert covered[r] == [] and after[r] == kv[r]
                continue
            # contiguous spans from the row's draft KV to its last known token, one drafting
            spans = covered[r]
            assert spans[0][0] == kv[r] and spans[-1][1] == known[r] - 1 and after[r] == known[r] - 1
            assert all(a[1] == b_[0] for a, b_ in zip(spans, spans[1:]))
            (drafted,) = [p.num_draft for p in passes if p.num_draft and r in p.row]
            # at least its bucket; longer only within its room
            assert drafted >= bucket(int(wants[r]), 5, 2) and drafted <= max(bucket(int(wants[r]), 5, 2), room[r])


@pytest.mark.parametrize(("n", "want"), [(0, 0), (1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (16, 16), (2, 2), (7, 7)])
def test_bucket(n, want):
    # window 16 and spec_tokens 7 are kept exact; others round up to a power of two, at most the window
    assert bucket(n, 16, 7) == want


def test_draft_lengths_bound_each_row_by_its_own_room():
    from parse_vllm.drafting import draft_lengths

    n = draft_lengths(
        wants=np.array([16, 16, 16, 16, 4]),
        known_len=np.array([10, 500, 509, 100, 512]),
        tokens_left=np.array([100, 100, 100, 3, 100]),
        max_len=512,
        prefilling=np.array([False, False, False, False, False]),
    )
    # row 1 is 12 tokens from the limit: only its own draft is cut; row 2 has
    # 3 positions left; max_tokens bounds row 3; row 4 is at the limit
    assert n.tolist() == [16, 12, 3, 3, 0]
    prefill = draft_lengths(np.array([8]), np.array([5]), np.array([9]), 512, np.array([True]))
    assert prefill.tolist() == [0]
    # a row whose tokens of this step end its answer gets no draft; the others keep theirs
    ended = draft_lengths(
        np.array([8, 8]), np.array([5, 5]), np.array([9, 9]), 512, np.array([False, False]), np.array([True, False])
    )
    assert ended.tolist() == [0, 8]


def test_an_answer_ends_at_any_stop_token_of_the_step():
    from parse_vllm.drafting import ends_answer

    stops = frozenset({2, 7})
    assert ends_answer(np.array([5, 7, 9]), stops)  # a draft token accepted this step
    assert ends_answer(np.array([2]), stops)  # the sampled token
    assert not ends_answer(np.array([5, 6]), stops)
    assert not ends_answer(np.array([], dtype=np.int64), stops)


def test_pass_spans_join_committed_and_new_tokens():
    from parse_vllm.drafting import DrafterPass, pass_spans

    tokens = np.arange(100).reshape(2, 50)  # row r, position j: token 50 r + j
    committed = np.array([5, 3])
    new = [np.array([1005, 1006]), np.array([2003])]
    dp = DrafterPass(row=np.array([0, 1]), start=np.array([4, 0]), end=np.array([6, 3]), num_draft=2)
    packed, cu = pass_spans(dp, tokens, committed, new)
    assert cu.tolist() == [0, 3, 7]
    assert packed.tolist() == [4, 1005, 1006, 50, 51, 52, 2003]
    # a catch-up chunk that ends before the step's new tokens
    dp = DrafterPass(row=np.array([0]), start=np.array([1]), end=np.array([3]), num_draft=0)
    assert pass_spans(dp, tokens, committed, new)[0].tolist() == [1, 2, 3]


def test_credit_drafted_kv_keeps_what_the_next_step_accepted():
    from parse_vllm.drafting import credit_drafted_kv

    # the worked example: 16 drafted from the token at 40 (KV written for 41..55), 9 accepted
    got = credit_drafted_kv(np.array([40, 40, 40, 7]), np.array([15, 15, 15, 0]), np.array([9, 15, 16, 3]))
    assert got.tolist() == [49, 55, 55, 7]  # no more than it wrote; a row that did not draft keeps its own


def _view(known: int):
    """The BatchView of one row "a" whose last known token (before this step's) sits at
    position known - 2, as far as step_rows reads it."""
    from types import SimpleNamespace

    return SimpleNamespace(
        req_ids=["a"],
        num_reqs=1,
        num_tokens=np.array([known - 1]),
        max_tokens=np.array([1000]),
        output_len=np.array([10]),
        stops=[frozenset({2})],
        prefilling=np.array([False]),
    )


def _one_row(known: int, wants: int, *, judging=True, chunk=8, windows=None, kv=None):
    """step_rows for one batch row whose last known token sits at position known - 1."""
    from parse_vllm.drafting import RowStates, step_rows

    states = RowStates(
        wants=np.array([wants]),
        judging=np.array([judging]),
        kv_len=np.array([known - 1 if kv is None else kv]),
        ahead=np.array([0]),
    )
    new = [np.array([7])]  # this step's sampled token, the last known one
    return step_rows(_view(known), states, new, windows or {}, max_len=4096, chunk=chunk)


def test_a_window_in_chunks_the_worked_example():
    """W 20, chunk 8, the last known token x at 50: d1..d8, d9..d16, d17..d20, each step
    one pass over the row's span, the window complete in the third step."""
    from parse_vllm.windows import OpenWindow

    drafter = iter(range(100, 200))  # d1 = 100, d2 = 101, ...
    rows = _one_row(known=51, wants=20)
    assert rows.wants.tolist() == [8] and rows.window_len.tolist() == [20] and rows.window_rows.tolist() == [0]
    window = OpenWindow([int(rows.new[0][-1])], int(rows.known_len[0]) - 1, int(rows.window_len[0]), rows.stops[0])
    assert not window.add(np.array([next(drafter) for _ in range(8)]))
    windows, spans = {"a": window}, []
    for _ in range(2):
        rows = _one_row(known=0, wants=0, windows=windows)  # the request is out of the batch: row 0 idles
        assert rows.req_ids == ["a", "a"] and rows.wants[0] == 0 and rows.window_rows.tolist() == [1]
        passes, _ = plan_passes(
            rows.wants, rows.kv_len, rows.known_len, window=8, spec_tokens=0, max_tokens=64, max_rows=4
        )
        (dp,) = passes
        tokens, _ = pass_spans(dp, np.zeros((1, 4), dtype=np.int64), rows.committed, rows.new)
        spans.append((dp.start.tolist(), dp.end.tolist(), tokens.tolist(), dp.num_draft))
        assert rows.stops[1] == frozenset({2})
        done = window.add(np.array([next(drafter) for _ in range(int(rows.wants[1]))]))
    assert spans == [([57], [58], [106, 107], 8), ([65], [66], [114, 115], 4)]
    assert done and window.draft == list(range(100, 120)) and window.start == 50


def test_windows_no_longer_than_a_chunk_and_other_drafts_are_whole():
    assert _one_row(51, 8).window_len.tolist() == [0]  # one chunk: drafted in its step, as before
    assert _one_row(51, 20, chunk=0).window_len.tolist() == [0]  # draft_chunk 0: whole windows
    spec = _one_row(51, 20, judging=False)  # token-level speculation is never cut
    assert spec.wants.tolist() == [20] and spec.window_len.tolist() == [0]


def test_a_stop_token_completes_a_window_early():
    from parse_vllm.windows import OpenWindow

    w = OpenWindow([7], 50, 20, frozenset({2}))
    assert not w.add(np.array([3, 4, 5]))
    assert w.add(np.array([6, 2, 9])) and w.draft == [3, 4, 5, 6, 2]
    assert OpenWindow([7], 50, 4, frozenset()).add(np.array([3, 4, 5, 6]))  # its length reached


def test_draft_rows_docstring_example():
    from parse_vllm.windows import OpenWindow

    window = OpenWindow([9] + list(range(1, 9)), 50, 20, frozenset({2}))
    rows = _one_row(known=31, wants=0, windows={"w": window})
    rows.new[0] = np.array([5, 7])
    rows.committed[0] = 30
    assert rows.known_len.tolist() == [32, 59] and rows.kv_len[1] == 57 and rows.wants[1] == 8


def test_advance_windows_opens_advances_and_completes():
    """A batch row's first chunk opens its window (no draft this step); an open
    window's last chunk completes it and hands it over; a first chunk with a stop
    token is a whole (short) draft at once."""
    from parse_vllm.drafting import window_rows
    from parse_vllm.windows import advance_windows

    rows = _one_row(known=51, wants=20)
    windows: dict = {}
    lens, done = advance_windows(rows, np.arange(100, 108)[None], windows)
    assert lens.tolist() == [0] and done == {} and windows["a"].tokens == [7, *range(100, 108)]
    windows["a"].tokens += list(range(108, 116))  # a second chunk, 16 of 20
    rows = window_rows(windows, 8)
    assert rows.wants.tolist() == [4] and rows.window_rows.tolist() == [0]
    lens, done = advance_windows(rows, np.arange(116, 124)[None], windows)
    assert lens.shape == (0,) and windows == {} and done["a"].draft == list(range(100, 120))
    rows = _one_row(known=51, wants=20)
    lens, done = advance_windows(rows, np.array([[100, 2, 5, 5, 5, 5, 5, 5]]), windows)
    assert lens.tolist() == [8] and windows == {} and done == {}  # the row's draft: cut at the stop later


def test_chunked_judging_releases_a_part_commits_it_and_drafts_on_from_the_window():
    """judge_chunks: a chunk that brings a boundary releases the window's draft so far to the
    target (the window kept, judging, no longer drafted); a commit takes a prefix and the
    window goes on after it; one whose whole draft was taken spans its last two tokens (the
    one before its last known token kept for that)."""
    from parse_vllm.drafting import window_rows, with_open_windows
    from parse_vllm.windows import OpenWindow, advance_windows

    ready = lambda req_id, w: 103 in w.draft  # noqa: E731  (a boundary after token 103)
    rows = _one_row(known=51, wants=20)
    windows: dict = {}
    lens, out = advance_windows(rows, np.arange(100, 108)[None], windows, ready)
    # the batch row's first chunk holds the boundary: it is the row's draft now, the window kept
    assert lens.tolist() == [8] and out["a"] is windows["a"] and windows["a"].judging
    w = windows["a"]
    w.commit(4)  # the judge passed up to 103: the request took 100..103
    assert (w.tokens, w.start, w.length, w.taken, w.prev, w.judging) == ([103, *range(104, 108)], 54, 16, 4, 102, False)
    rows = window_rows(windows, 8)
    assert rows.kv_len.tolist() == [57] and rows.committed.tolist() == [54] and rows.wants.tolist() == [8]
    lens, out = advance_windows(rows, np.arange(108, 116)[None], windows, ready)
    assert out == {} and not windows["a"].judging  # no boundary in 104..115: it drafts on
    w = OpenWindow([7, 100, 101], 50, 20, frozenset())
    w.commit(2)  # all of its draft taken: the drafter re-passes 100 (at 51) before 101 (at 52)
    rows = with_open_windows(_one_row(known=10, wants=0), {"b": w}, 8)
    assert rows.committed[1] == 51 and rows.new[1].tolist() == [100, 101] and rows.kv_len[1] == 51
    with pytest.raises(ValueError, match="cannot commit 0"):
        w.commit(0)


def test_a_shorter_draft_joins_a_longer_pass_where_its_room_holds_it():
    # the worked example's rows, row 3 with room for 4 (module docstring)
    want = dict(wants=[4, 4, 0, 2], kv_len=[10, 0, 20, 5], known=[13, 6, 22, 18])
    passes, kv = plan_passes(
        *map(np.array, want.values()), window=4, spec_tokens=0, max_tokens=24, max_rows=16, room=np.array([4, 4, 0, 4])
    )
    assert [(p.row.tolist(), p.start.tolist(), p.end.tolist(), p.num_draft) for p in passes] == [
        ([0, 1, 3], [10, 0, 5], [12, 5, 17], 4)
    ]
    assert kv.tolist() == [12, 5, 20, 17]
    # without room it drafts its own 2 in a pass of its own
    alone, _ = plan_passes(*map(np.array, want.values()), window=4, spec_tokens=0, max_tokens=24, max_rows=16)
    assert [(p.row.tolist(), p.num_draft) for p in alone] == [([0, 1], 4), ([3], 2)]
    # the pass of 4 full at capacity 10: row 3 drafts its own 2 after its catch-up, as before
    full, _ = _plan(**want)
    capped, _ = plan_passes(
        *map(np.array, want.values()), window=4, spec_tokens=0, max_tokens=10, max_rows=16, room=np.array([4, 4, 0, 4])
    )
    same = [(p.row.tolist(), p.start.tolist(), p.end.tolist(), p.num_draft) for p in capped]
    assert same == [(p.row.tolist(), p.start.tolist(), p.end.tolist(), p.num_draft) for p in full]


@pytest.mark.parametrize(
    ("wants", "room", "want"),
    [
        ([4, 2, 2], [4, 4, 2], [([0, 1], 4), ([2], 2)]),  # only the row with room joins
        ([4, 1], [4, 4], [([0], 4), ([1], 1)]),  # 4 is more than twice 1: a pass of its own
        ([5, 3], [5, 8], [([0, 1], 5)]),  # spec_tokens 5 kept exact; 3 (bucket 4) joins it
        ([16, 8, 4], [16, 16, 16], [([0, 1], 16), ([2], 4)]),  # 8 joins 16; 4 does not join 16
    ],
)
def test_which_shorter_drafts_join(wants, room, want):
    n = len(wants)
    passes, _ = plan_passes(
        np.array(wants),
        np.full(n, 10),
        np.full(n, 12),
        window=16,
        spec_tokens=5,
        max_tokens=64,
        max_rows=8,
        room=np.array(room),
    )
    assert [(p.row.tolist(), p.num_draft) for p in passes] == want


def test_step_rows_give_a_window_room_for_its_tokens_left():
    from parse_vllm.windows import OpenWindow

    window = OpenWindow([9, 1, 2], 50, 20, frozenset({2}))  # 2 of 20 drafted: 18 left
    rows = _one_row(known=31, wants=4, judging=False, windows={"w": window})
    assert rows.wants.tolist() == [4, 8] and rows.room.tolist() == [4, 18]
    opening = _one_row(known=51, wants=20)  # a window opening in chunks: its whole length
    assert opening.wants.tolist() == [8] and opening.room.tolist() == [20]
