"""parse_step on hand-made batches: no engine, no model. Each test builds a
DraftBatch whose logits say what the target prefers at every draft position,
and a judge that answers P(yes) per (row, prefix length)."""

import numpy as np
import pytest
import torch

from parse_vllm.boundaries import BoundaryRule
from parse_vllm.step import DraftBatch, StepSettings, draft_token_checks, parse_step

VOCAB = 32
CACHED = 10  # tokens in the KV cache before each draft
EOS = 31


def settings(every=2, two_stage=False, max_model_len=4096, suffix_len=5, max_boundaries=16):
    rule = BoundaryRule("tokens", every, max_boundaries, np.zeros(VOCAB, dtype=bool))
    return StepSettings(rule, two_stage, VOCAB, suffix_len, max_model_len)


def batch_of(
    drafts,
    *,
    target=None,
    l_tok=None,
    tau=0.5,
    guard=0,
    greedy=True,
    stops=frozenset(),
    max_tokens=0,
    min_tokens=0,
    output_len=0,
    cached_len=CACHED,
    bad_words=False,
    forbidden=None,
    dtype=torch.float32,
):
    """Requests at input-batch rows 0, 2, 4, ... with these drafts. target[k][j]:
    the target's greedy token at draft position j (default: the draft's own
    token, i.e. the target agrees); its logits rank the other tokens by id."""
    R = len(drafts)
    target = target or [list(d) + [0] for d in drafts]
    per = lambda x, kind: np.array(x if isinstance(x, list) else [x] * R, dtype=kind)  # noqa: E731
    rows, starts, chunks = [], [], []
    start = 0
    for k, d in enumerate(drafts):
        lg = -0.01 * torch.arange(VOCAB, dtype=torch.float32).repeat(len(d) + 1, 1)
        for j, t in enumerate(target[k][: len(d) + 1]):
            lg[j, t] = 5.0
        chunks.append(lg)
        rows.append(2 * k)
        starts.append(start)
        start += len(d) + 1
    return DraftBatch(
        row=np.array(rows, dtype=np.int64),
        draft=np.concatenate([np.array(d, dtype=np.int64) for d in drafts]),
        cu_draft=np.concatenate([[0], np.cumsum([len(d) for d in drafts])]).astype(np.int64),
        logits_start=np.array(starts, dtype=np.int64),
        cached_len=per(cached_len, np.int64),
        output_len=per(output_len, np.int64),
        max_tokens=per(max_tokens, np.int64),
        min_tokens=per(min_tokens, np.int64),
        stop_ids=[frozenset(stops)] * R,
        l_tok=per(l_tok if l_tok is not None else 0, np.int64),
        threshold=per(tau, np.float64),
        guard=per(guard, np.int64),
        greedy=per(greedy, bool),
        bad_words=per(bad_words, bool),
        logits=torch.cat(chunks).to(dtype),
        forbidden=forbidden,
    )


class Judge:
    """P(yes) per (input-batch row, boundary b); 1.0 where not given. Answers in log-odds, as
    the verifiers do. Records every call."""

    def __init__(self, p: dict[tuple[int, int], float] | None = None):
        self.p, self.calls = p or {}, []

    def __call__(self, copies):
        self.calls.append([(int(r), int(n) - CACHED) for r, n in zip(copies.req_row, copies.prefix_len)])
        p = np.array([self.p.get(c, 1.0) for c in self.calls[-1]], dtype=np.float64)
        with np.errstate(divide="ignore"):
            return np.log(p) - np.log1p(-p)


def test_maximal_valid_prefix_stops_at_the_first_failed_boundary():
    # request 0: boundaries 2 4 6 8, b=6 fails -> L_sem = 4 (b=8 passing does not matter)
    # request 1: boundary 2 fails -> nothing beyond L_tok = 1
    # request 2: all pass -> the whole draft
    d = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4], [5, 6, 7, 8]]
    judge = Judge({(0, 6): 0.2, (2, 2): 0.1})
    b = batch_of(d, target=[[9] * 9, [1] + [9] * 4, [9] * 5], l_tok=[0, 1, 0])
    r = parse_step(b, judge, settings())
    assert judge.calls == [[(0, 2), (0, 4), (0, 6), (0, 8), (2, 2), (2, 4), (4, 2), (4, 4)]]  # one pass
    assert r.accepted.tolist() == [4, 1, 4]
    assert r.resample.tolist() == [True, False, True]
    assert r.rejected.tolist() == [True, True, False]
    assert r.first_fail.tolist() == [2, 0, -1]
    assert not r.cut.any()


def test_tau_outside_0_1_is_decided_without_judging():
    """τ 0 takes a draft whole and τ 1.5 none of it, without asking a judge that would
    fail every prefix."""
    d = [[1, 2, 3, 4], [1, 2, 3, 4]]
    judge = Judge({(r, b): 0.0 for r in (0, 2) for b in (2, 4)})
    r = parse_step(batch_of(d, target=[[9] * 5] * 2, tau=[0.0, 1.5]), judge, settings())
    assert judge.calls == []
    assert r.accepted.tolist() == [4, 0] and r.rejected.tolist() == [False, True]
    assert r.first_fail.tolist() == [-1, 0]


def test_tau_one_passes_nothing_however_sure_the_judge():
    """τ = 1 is the judged reject-all setting: a judge sure enough that P(yes) rounds to 1.0
    (log-odds 40, or infinite) still fails every prefix, while τ just below 1 takes the draft."""
    d = [[1, 2, 3, 4]]
    for sure in (1.0, float(1 / (1 + np.exp(-40.0)))):
        judge = Judge({(0, 2): sure, (0, 4): sure})
        r = parse_step(batch_of(d, target=[[9] * 5], tau=1.0), judge, settings())
        assert judge.calls == [[(0, 2), (0, 4)]] and r.rejected[0] and r.accepted[0] == 0
        r = parse_step(batch_of(d, target=[[9] * 5], tau=0.999), Judge({(0, 2): sure, (0, 4): sure}), settings())
        assert not r.rejected[0] and r.accepted[0] == 4


def test_a_draft_token_level_took_whole_is_not_judged():
    judge = Judge()
    r = parse_step(batch_of([[1, 2, 3]], l_tok=3), judge, settings())
    assert judge.calls == [] and not r.judged[0] and r.accepted[0] == 3 and not r.resample[0]


def test_boundaries_within_what_token_level_took_are_not_judged():
    """Token-level acceptance took draft[:3] (the target's own tokens): boundaries 2 and
    (in two-stage's second call) anything up to 3 are not judged, so a judge that fails
    an unfinished prefix there cannot reject the draft; the boundaries spread over the rest."""
    d = [[1, 2, 3, 4, 5, 6, 7, 8]]
    judge = Judge({(0, 2): 0.0})  # would fail draft[:2]
    r = parse_step(batch_of(d, target=[[1, 2, 3, 9, 9, 9, 9, 9, 0]], l_tok=3), judge, settings())
    assert judge.calls == [[(0, 4), (0, 6), (0, 8)]]
    assert r.accepted.tolist() == [8] and not r.rejected[0]
    judge = Judge({(0, 8): 0.0, (0, 2): 0.0})
    r = parse_step(batch_of(d, l_tok=3), judge, settings(two_stage=True))
    assert judge.calls == [[(0, 8)], [(0, 4), (0, 6)]]
    assert r.accepted.tolist() == [6] and r.rejected[0]


def test_two_stage_judges_earlier_boundaries_only_where_the_holistic_check_failed():
    d = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]
    judge = Judge({(0, 6): 0.1, (0, 4): 0.3})  # request 0 fails whole and at 4; request 1 passes whole
    r = parse_step(batch_of(d, target=[[9] * 7] * 2), judge, settings(two_stage=True))
    assert judge.calls == [[(0, 6), (2, 6)], [(0, 2), (0, 4)]]
    assert r.accepted.tolist() == [2, 6]
    assert r.first_fail.tolist() == [1, -1]  # index among the merged boundaries 2, 4, 6
    assert r.rejected.tolist() == [True, False]


def test_stop_token_max_tokens_and_min_tokens():
    d = [[1, 2, 3, EOS, 7, 7], [1, 2, 3, EOS], [1, 2, 3, 4, 5, 6]]
    judge = Judge()
    b = batch_of(
        d,
        target=[[9] * 7, [9] * 5, [9] * 7],
        stops={EOS},
        min_tokens=[0, 10, 0],
        max_tokens=[0, 0, 5],
        output_len=[0, 0, 2],
    )
    r = parse_step(b, judge, settings())
    # the text ends before EOS; judged whole, request 0 takes EOS too (+1);
    # request 1 may not stop before 10 tokens; request 2 has 3 tokens left
    assert r.text_len.tolist() == [3, 3, 3]
    assert r.accepted.tolist() == [4, 3, 3]
    assert [c for c in judge.calls[0] if c[0] == 4] == [(4, 2), (4, 3)]
    assert not r.rejected.any()


def test_constraints_cut_semantic_acceptance():
    d = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    b = batch_of(
        d, target=[[9] * 5] * 3, bad_words=[False, False, True], forbidden=torch.zeros(3, VOCAB, dtype=torch.bool)
    )
    b.logits[b.logits_start[0] + 2, 3] = float("-inf")  # the grammar forbids draft token 2 of request 0
    b.forbidden[1, 4] = True  # allowed_token_ids exclude token 4 for request 1
    r = parse_step(b, Judge(), settings())
    assert r.accepted.tolist() == [2, 3, 0]
    assert r.rejected.tolist() == [True, True, True]


def test_guard_greedy_sampled_and_cut_is_not_a_rejection():
    d = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]
    target = [[1, 2, 3, 9, 9, 9, 0]] * 3  # the target agrees on 3 tokens
    b = batch_of(d, target=target, tau=0.0, guard=[1, 1, 40], greedy=[True, False, True], l_tok=[3, 0, 3])
    judge = Judge()
    r = parse_step(b, judge, settings())
    assert judge.calls == []
    # guard 1 greedy: the argmax prefix (3 = L_tok, nothing more); guard 1 on a
    # sampling request: token-level only; guard >= vocab: off
    assert r.accepted.tolist() == [3, 0, 6]
    assert r.cut.tolist() == [True, True, False] and r.guard_cut.tolist() == [True, True, False]
    assert not r.rejected.any()


def test_guard_top_k_lets_the_target_second_choice_through():
    # the target prefers 9 everywhere, then 0, 1, 2, ... (logit -0.01 * id): top-4 = {9, 0, 1, 2}
    d = [[1, 2, 30, 2]]
    b = batch_of(d, target=[[9] * 5], tau=0.0, guard=4)
    r = parse_step(b, Judge(), settings())
    assert r.accepted.tolist() == [2] and r.guard_cut[0] and r.cut[0] and not r.rejected[0]


def test_guard_bounds_the_boundaries_judged():
    d = [[1, 2, 3, 30, 5, 6, 7, 8]]
    judge = Judge()
    r = parse_step(batch_of(d, target=[[9] * 9], guard=5), judge, settings())  # top-5 = {9, 0, 1, 2, 3}
    assert judge.calls == [[(0, 2), (0, 4)]]  # 4 is the first boundary at/after the guard's cut at 3
    assert r.accepted.tolist() == [3] and r.cut[0] and not r.rejected[0]


def test_context_limit_judges_only_copies_that_fit():
    # max_model_len 24, suffix 5, 10 cached: draft[:b] fits while b <= 9
    d = [list(range(1, 13)), list(range(1, 13))]
    judge = Judge()
    b = batch_of(d, target=[[0] * 13] * 2, tau=[0.5, 0.0])
    r = parse_step(b, judge, settings(every=4, max_model_len=24))
    assert judge.calls == [[(0, 4), (0, 8)]]
    assert all(CACHED + bb + 5 <= 24 for _, bb in judge.calls[0])
    # a context cut, not a rejection; τ = 0 judges nothing and needs no room
    assert r.accepted.tolist() == [8, 12] and r.cut.tolist() == [True, False] and not r.rejected.any()
    r = parse_step(batch_of([[1, 2]], cached_len=20, target=[[0] * 3]), judge, settings(max_model_len=24))
    assert r.accepted.tolist() == [0] and r.cut[0] and not r.rejected[0]


def test_draft_token_checks_match_a_per_request_loop():
    from parse_vllm.acceptance import guard_mask, view_draft

    rng = np.random.default_rng(0)
    drafts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 1, 7, 3)]
    target = [rng.integers(0, VOCAB, len(x) + 1).tolist() for x in drafts]
    b = batch_of(drafts, target=target, guard=[2, 0, 1, 5])
    b.logits += torch.from_numpy(rng.normal(size=b.logits.shape)).float()
    views = [view_draft(b.draft_of(k), frozenset(), 0, 0, 0, VOCAB) for k in range(4)]
    g, a = draft_token_checks(b, views)
    for k in range(4):
        n = views[k].text_len
        rows = b.logits[b.logits_start[k] : b.logits_start[k] + n]
        ok = guard_mask(rows, torch.tensor(b.draft_of(k)[:n]), int(b.guard[k])) if b.guard[k] else None
        want = n if ok is None or ok.all() else int(torch.nonzero(~ok)[0, 0])
        assert (g[k] if b.guard[k] else n) == want
        assert a[k] == n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_on_reduced_precision_logits(dtype):
    r = parse_step(batch_of([[1, 2, 3, 4]], guard=2, tau=0.0, dtype=dtype), Judge(), settings())
    assert r.accepted.tolist() == [4]


def test_host_transfers_do_not_grow_with_the_batch(monkeypatch):
    """The step reads device tensors back a fixed number of times per step,
    whatever the number of requests (no per-request transfer): counted by
    wrapping every Tensor -> host conversion."""
    counts = {"n": 0}
    for name in ("cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, **k):
            counts["n"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)

    def run(R):
        counts["n"] = 0
        d = [[1, 2, 3, 4, 5, 6]] * R
        b = batch_of(d, target=[[1, 2, 3, 9, 9, 9, 0]] * R, guard=5, tau=0.5, l_tok=0)
        parse_step(b, Judge(), settings())
        return counts["n"]

    assert run(2) == run(20) > 0


def test_a_windows_part_commits_its_passing_prefix_and_stops_at_a_failing_boundary():
    """Chunked judging: parts of windows (every 3 tokens of the window; request 0's part
    starts 1 token into its window, so its cuts are at 2 and 5, and its end, 7, is none).
    Request 0: 2 and 5 pass -> it commits draft[:5], nothing of the target's, no rejection.
    Request 1: its cut 3 fails -> rejected, the target's token after L_tok = 1. Request 2:
    token-level took its whole part -> committed whole, the target's token after it dropped.
    Request 3: a window's rest, whole (not partial): its end is judged, as in any draft."""
    d = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5], [1, 2, 3, 4], [1, 2, 3, 4]]
    judge = Judge({(2, 3): 0.1})
    b = batch_of(d, target=[[9] * 8, [1] + [9] * 5, [1, 2, 3, 4, 9], [9] * 5], l_tok=[0, 1, 4, 0])
    b.partial = np.array([True, True, True, False])
    b.window_offset = np.array([1, 0, 0, 3])
    r = parse_step(b, judge, settings(every=3))
    assert judge.calls == [[(0, 2), (0, 5), (2, 3), (6, 3), (6, 4)]]
    assert r.accepted.tolist() == [5, 1, 4, 4]
    assert r.commit.tolist() == [True, False, True, False]
    assert r.rejected.tolist() == [False, True, False, False]
    assert r.resample.tolist() == [False, False, False, True]
    # a part the scheduler cut short of its first boundary takes nothing: it ends its window
    b = batch_of([[1, 2]], target=[[9] * 3], l_tok=0)
    b.partial, b.window_offset = np.array([True]), np.array([0])
    r = parse_step(b, Judge(), settings(every=3))
    assert not r.commit[0] and r.cut[0] and not r.rejected[0] and r.accepted[0] == 0
