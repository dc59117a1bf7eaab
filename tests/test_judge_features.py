"""The judge head's cheap evidence (parse_vllm/evidence.py, issue 37 item 2): each feature
against a hand computation from logits, the step's device path against the reference, the
head's file and read-out with evidence features, and, in an engine, that reading them adds no
target forward and no host transfer (forwards counted by wrapping the target model)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from parse_vllm.evidence import EVIDENCE_FEATURES, LOGPROB_FLOOR, prefix_features, token_evidence, window_start
from parse_vllm.judge_head import FORMAT, FORMAT_EVIDENCE, HeadIdentity, JudgeHead, ReadOut

VOCAB = 6


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, VOCAB), generator=g) * 2.0


def _by_hand(logits: torch.Tensor, tokens: list[int]) -> tuple[list[float], list[float]]:
    """log p(token) and greedy mismatch per row, by the definition, one row at a time."""
    lps, mms = [], []
    for row, t in zip(logits.tolist(), tokens):
        m = max(row)
        z = sum(math.exp(x - m) for x in row)
        lp = row[t] - m - math.log(z) if row[t] != -math.inf else -math.inf
        lps.append(max(lp, LOGPROB_FLOOR))
        mms.append(0.0 if max(range(VOCAB), key=lambda i: row[i]) == t else 1.0)
    return lps, mms


def test_each_feature_equals_a_hand_computation_from_logits():
    """20 draft tokens over a 6-token vocabulary, one of them forbidden (logit -inf): the
    per-token values and every prefix's four features, by loops over the definitions."""
    logits = _logits(20)
    tokens = [int(x) for x in torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))]
    tokens[3] = int(logits[3].argmax())  # a token the target agrees with
    logits[7, tokens[7]] = -math.inf  # the constraints forbid this one: its log-probability is floored
    ev = token_evidence(logits, torch.tensor(tokens))
    lps, mms = _by_hand(logits, tokens)
    assert ev.dtype == torch.float32 and ev.shape == (2, 20)
    assert np.allclose(ev[0].numpy(), lps, atol=1e-5) and ev[0, 7] == LOGPROB_FLOOR
    assert ev[1].tolist() == mms and ev[1, 3] == 0.0
    feats = prefix_features(ev[0].numpy(), ev[1].numpy(), range(1, 21))
    for b in range(1, 21):
        last = lps[max(0, b - 16) : b]
        want = [sum(lps[:b]) / b, min(lps[:b]), sum(last) / len(last), sum(mms[:b]) / b]
        assert feats[b - 1] == pytest.approx(want, abs=1e-5), b
    assert prefix_features(ev[0].numpy(), ev[1].numpy(), [0]).tolist() == [[0.0] * 4]
    with pytest.raises(ValueError):
        prefix_features(ev[0].numpy(), ev[1].numpy(), [21])


def test_a_hand_worked_case():
    """Two tokens, logits chosen so that every number is exact: p = 1/2 then 1/4."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25, 1e-30, 1e-30, 1e-30], [0.5, 0.25, 0.25, 1e-30, 1e-30, 1e-30]]))
    ev = token_evidence(logits, torch.tensor([0, 1]))  # the greedy token, then another
    assert ev[0].tolist() == pytest.approx([math.log(0.5), math.log(0.25)], abs=1e-6) and ev[1].tolist() == [0.0, 1.0]
    (f,) = prefix_features(ev[0].numpy(), ev[1].numpy(), [2])
    assert f.tolist() == pytest.approx([math.log(0.125) / 2, math.log(0.25), math.log(0.125) / 2, 0.5], abs=1e-6)


def test_window_start_as_the_training_data_cuts_answers():
    assert [window_start(b, 16) for b in (1, 15, 16, 17, 32, 33)] == [0, 0, 0, 16, 16, 32]


def test_the_training_features_read_the_window_of_the_boundary():
    from parse_vllm.tools.judge.data import example_evidence

    lp = np.arange(1, 41, dtype=np.float64) * -0.1  # 40 answer tokens
    mm = (np.arange(40) % 3 == 0).astype(np.float64)
    rows = [{"task": "t", "answer": 0, "length": n} for n in (5, 16, 20, 40)]
    got = example_evidence(rows, {("t", 0): np.stack([lp, mm])}, window=16)
    for r, g in zip(rows, got):
        s = ((r["length"] - 1) // 16) * 16
        assert g.tolist() == pytest.approx(prefix_features(lp[s:], mm[s:], [r["length"] - s])[0].tolist())
    assert got[2][0] == pytest.approx(np.mean(lp[16:20]))  # the window from token 16 on, not the answer's start


# -- the step's device path --------------------------------------------------------------------


def _draft_batch(drafts, logits):
    from parse_vllm.step import DraftBatch

    R = len(drafts)
    starts = np.concatenate([[0], np.cumsum([len(d) + 1 for d in drafts])[:-1]]).astype(np.int64)
    return DraftBatch(
        row=np.arange(R, dtype=np.int64) * 2,
        draft=np.concatenate([np.array(d, dtype=np.int64) for d in drafts]),
        cu_draft=np.concatenate([[0], np.cumsum([len(d) for d in drafts])]).astype(np.int64),
        logits_start=starts,
        cached_len=np.full(R, 10, dtype=np.int64),
        output_len=np.zeros(R, dtype=np.int64),
        max_tokens=np.zeros(R, dtype=np.int64),
        min_tokens=np.zeros(R, dtype=np.int64),
        stop_ids=[frozenset({5})] * R,
        l_tok=np.zeros(R, dtype=np.int64),
        threshold=np.full(R, 0.5),
        guard=np.array([0, 1, 0][:R], dtype=np.int64),
        greedy=np.ones(R, dtype=bool),
        bad_words=np.zeros(R, dtype=bool),
        logits=logits,
    )


def test_the_step_computes_them_from_the_logits_it_holds_in_the_same_copies():
    """token_checks_with_evidence: the checks as token_checks gives them, and per request the
    per-token evidence of its draft's text (and stop token) from the batch's logits rows; one
    host-to-device copy either way (the evidence reuses the checks' indices)."""
    from parse_vllm.step import draft_views, token_checks, token_checks_with_evidence
    from parse_vllm.transfers import to_device

    drafts = [[1, 2, 3, 4], [2, 2, 5, 1, 1], [0, 4]]  # request 1 stops at its third token
    logits = _logits(sum(len(d) + 1 for d in drafts), seed=3)
    batch = _draft_batch(drafts, logits)
    views = draft_views(batch, VOCAB)
    calls = []

    def counted(*arrays):
        calls.append(len(arrays))
        return to_device("cpu", *arrays)

    plain = token_checks(batch, views, counted)
    n_plain = len(calls)
    checks, ev = token_checks_with_evidence(batch, views, counted, evidence=True)
    assert len(calls) - n_plain == n_plain == 1
    assert torch.equal(checks, plain)
    assert ev.shape == (2, 3, 4)  # the longest text (and stop token): 4, 2 + 1, 2
    for k, d in enumerate(drafts):
        n = views[k].text_len + (views[k].stop_index == views[k].text_len)
        rows = logits[batch.logits_start[k] : batch.logits_start[k] + n]
        lps, mms = _by_hand(rows, d[:n])
        assert np.allclose(ev[0, k, :n].numpy(), lps, atol=1e-5) and ev[1, k, :n].tolist() == mms
        assert not ev[:, k, n:].any()
    assert token_checks_with_evidence(batch, views, counted)[1] is None


def test_they_travel_with_the_checks_without_spoiling_them():
    """The step's one read: int64 checks holding NO_LIMIT (no guard) beside the evidence in
    int64 fixed point: both come back exact (float64 would turn NO_LIMIT negative)."""
    from parse_vllm.evidence import FIXED_SCALE, from_fixed, to_fixed
    from parse_vllm.step import NO_LIMIT
    from parse_vllm.transfers import HostCopies

    checks = torch.tensor([[NO_LIMIT, 3], [4, NO_LIMIT]], dtype=torch.int64)
    ev = torch.tensor([[[-0.5, -12.25, -100.0]], [[1.0, 0.0, 1.0]]], dtype=torch.float32)
    host = HostCopies("cpu")
    got_checks, got_ev = host.fetch(checks, to_fixed(ev))
    assert got_checks.tolist() == checks.tolist() and host.in_step == 1
    assert np.array_equal(from_fixed(got_ev), ev.numpy().astype(np.float64))
    x = torch.tensor([-3.14159265], dtype=torch.float32)
    assert abs(from_fixed(to_fixed(x).numpy())[0] - float(x[0])) <= 0.5 / FIXED_SCALE


def test_the_controller_reads_each_copys_prefix_and_adds_the_term_on_the_host():
    """copy_evidence: copy c of request k with prefix_len = cached_len + b reads the features
    of draft[:b]; judge adds ReadOut.evidence_logit to the verifier's log-odds and records
    the features."""
    from parse_vllm.controller import ParseController
    from parse_vllm.verify import CopyBatch

    drafts = [[1, 2, 3, 4], [2, 2, 0, 1, 1]]
    logits = _logits(11, seed=4)
    batch = _draft_batch(drafts, logits)
    batch.evidence = np.zeros((2, 2, 6))
    for k, d in enumerate(drafts):
        rows = logits[batch.logits_start[k] : batch.logits_start[k] + len(d)]
        batch.evidence[:, k, : len(d)] = np.array(_by_hand(rows, d))
    copies = CopyBatch(req_row=np.array([0, 0, 2]), prefix_len=np.array([12, 14, 13]))
    ctl = ParseController.__new__(ParseController)  # only copy_evidence's inputs
    got = ctl.copy_evidence(copies, batch)
    for c, (k, b) in enumerate([(0, 2), (0, 4), (1, 3)]):
        want = prefix_features(batch.evidence[0, k], batch.evidence[1, k], [b])[0]
        assert got[c].tolist() == pytest.approx(want.tolist())


# -- the head ---------------------------------------------------------------------------------

H = 8


def _identity() -> HeadIdentity:
    return HeadIdentity(
        target="tiny", architecture="LlamaForCausalLM", hidden_size=H, num_layers=4, vocab_size=100,
        suffix_ids=(5, 6, 7), question="Q?", labels=("Correct", "Incorrect"), label_ids=((11,), (12, 13)),
        boundaries={"mode": "sentence", "every": 32, "max_boundaries": 8},
    )  # fmt: skip


@pytest.mark.parametrize(
    "features",
    [
        ("hidden",),
        ("hidden", "zero_shot_logit"),
        ("hidden", "draft_logprob_min"),
        ("hidden", "greedy_mismatch", "zero_shot_logit", "draft_logprob_mean"),
        ("hidden", *EVIDENCE_FEATURES),
    ],
)
def test_a_head_saves_loads_and_reads_out_by_hand(features, tmp_path):
    """Heads without evidence keep format /1 (the previous shipped head is one, read by
    --old-head); a head that reads evidence is /2 and adds w_e · e on the host."""
    evidence = any(f in EVIDENCE_FEATURES for f in features)
    rng = np.random.default_rng(0)
    n = H + len(features) - 1
    head = JudgeHead(
        weight=rng.normal(size=n), bias=0.2, mean=rng.normal(size=n), scale=rng.uniform(0.5, 2, size=n),
        features=features, identity=_identity(), training={"tau_head": {"tau": 0.725}},
    )  # fmt: skip
    path = head.save(tmp_path / "h.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata()["format"] == (FORMAT_EVIDENCE if evidence else FORMAT)
    loaded = JudgeHead.load(path)
    assert loaded.features == features and loaded.reads_evidence == evidence and loaded.tau == 0.725
    hidden, zs, ev = rng.normal(size=(5, H)), rng.normal(size=5), rng.normal(size=(5, 4))
    cols = {"zero_shot_logit": zs, **{f: ev[:, i] for i, f in enumerate(EVIDENCE_FEATURES)}}
    x = np.concatenate([hidden] + [cols[f][:, None] for f in features[1:]], axis=1)
    by_hand = ((x - loaded.mean) / loaded.scale) @ loaded.weight + loaded.bias
    assert np.allclose(loaded.logit(hidden, zs, ev), by_hand)
    ro = ReadOut(loaded, "cpu")
    device = ro.logit(torch.tensor(hidden, dtype=torch.float32), torch.tensor(zs, dtype=torch.float32)).numpy()
    assert ro.reads_evidence == evidence and np.allclose(device + ro.evidence_logit(ev), by_hand, atol=1e-4)
    assert evidence or not ro.evidence_weight.any()


def test_the_shipped_head_reads_the_evidence_it_was_chosen_with():
    """The committed head: the hidden state and the mean log-probability of the drafted
    tokens (forward selection's choice), the prompt sets it learnt from with their sha256, and
    its τ_head; the pass's read-out (w' · h + b' on the device, w_e · e on the host) equals the
    standardised linear model computed here by hand."""
    from parse_vllm.judge_head import resolve_head_path

    head = JudgeHead.load(resolve_head_path("qwen2.5-coder-1.5b-instruct"))
    assert head.features == ("hidden", "draft_logprob_mean") and head.reads_evidence
    sets = {(p["name"], p["split"], p["role"]): p for p in head.prompt_sets}
    assert set(sets) == {("humaneval-even", "even", "train"),
                         ("mbpp-train+validation+prompt", "train+validation+prompt", "train")}  # fmt: skip
    assert all(len(p["sha256"]) == 64 for p in head.prompt_sets)
    assert head.tau is not None and 0.5 <= head.tau <= 0.95
    ro = ReadOut(head, "cpu")
    assert ro.zero_shot_weight == 0.0 and ro.reads_evidence
    assert [n for n, w in zip(EVIDENCE_FEATURES, ro.evidence_weight) if w] == ["draft_logprob_mean"]
    rng = np.random.default_rng(0)
    h = rng.normal(size=(3, head.identity.hidden_size))
    ev = rng.normal(size=(3, len(EVIDENCE_FEATURES)))
    x = np.concatenate([h, ev[:, [EVIDENCE_FEATURES.index("draft_logprob_mean")]]], axis=1)
    by_hand = ((x - head.mean) / head.scale) @ head.weight + head.bias
    got = ro.logit(torch.tensor(h, dtype=torch.float32), torch.zeros(3)).numpy() + ro.evidence_logit(ev)
    assert np.allclose(got, by_hand, atol=1e-3) and np.allclose(head.logit(h, evidence=ev), by_hand)
    from safetensors import safe_open

    with safe_open(str(resolve_head_path("qwen2.5-coder-1.5b-instruct") / "judge_head.safetensors"), "numpy") as f:
        assert f.metadata()["format"] == FORMAT_EVIDENCE


# -- in an engine: no forward and no transfer more ----------------------------------------------


def _engine_head(target, path, evidence: bool):
    """A head for the tiny target that passes every judgment (bias 20), reading h, the
    zero-shot log-odds and, with `evidence`, every evidence feature."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from parse_vllm.config import ParseConfig
    from parse_vllm.judge_head import engine_identity, lm_head_fingerprint
    from parse_vllm.templates import build_template

    cfg = json.loads((target / "config.json").read_text())
    config = ParseConfig()
    ident = engine_identity(
        target=str(target), architecture=cfg["architectures"][0], hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"],
        template=build_template(AutoTokenizer.from_pretrained(target), config), config=config,
    )  # fmt: skip
    lm_head = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    ident = HeadIdentity(**{**ident.__dict__, "lm_head_fingerprint": lm_head_fingerprint(lm_head, ident.label_ids)})
    features = ("hidden", "zero_shot_logit", *(EVIDENCE_FEATURES if evidence else ()))
    n = cfg["hidden_size"] + len(features) - 1
    rng = np.random.default_rng(3)
    weight = rng.normal(scale=0.05, size=n)
    if evidence:
        weight[-4:] = [0.3, 0.2, -0.1, 0.5]
    head = JudgeHead(weight=weight, bias=20.0, mean=np.zeros(n), scale=np.ones(n), features=features, identity=ident)
    return head.save(path)


def _count_forwards(worker) -> None:
    runner = worker.model_runner
    model = runner.model
    if getattr(model, "_parse_test_counts", None) is None:
        model._parse_test_counts = {"forward": 0, "compute_logits": 0}
        for name in ("forward", "compute_logits"):
            inner = getattr(model, name)

            def counted(*a, _inner=inner, _name=name, **kw):
                model._parse_test_counts[_name] += 1
                return _inner(*a, **kw)

            setattr(model, name, counted)
    model._parse_test_counts.update(forward=0, compute_logits=0)


def _counts(worker) -> dict:
    return dict(worker.model_runner.model._parse_test_counts)


def _use_head(path):
    def install(worker) -> None:
        from parse_vllm.judge_head import JudgeHead, ReadOut

        p = worker.model_runner.parse
        p.read_out = ReadOut(JudgeHead.load(path), p.device)
        p.verifier.read_out = p.read_out

    return install


@pytest.mark.slow
def test_reading_evidence_adds_no_forward_and_no_transfer_and_matches_an_hf_forward(tiny_models, tmp_path):
    """One engine, the same greedy requests twice: with a head that reads the four evidence
    features and with the same head without them (every judgment passes under both, so the
    steps are the same). Target forwards, logits computations, device-to-host and staged
    host-to-device copies per step: equal. Each recorded judgment's evidence equals the
    features of an HF forward's logits over the draft tokens of its window, and its log-odds
    the head's read-out by hand."""
    from conftest import PROMPTS, close_llm, make_llm, parse_kwargs
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    import parse_vllm

    target = tiny_models["target"]
    with_ev = _engine_head(target, tmp_path / "ev.safetensors", evidence=True)
    without = _engine_head(target, tmp_path / "plain.safetensors", evidence=False)
    llm = make_llm(**parse_kwargs(tiny_models, judge_head=str(with_ev), record_judgments=512))
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, extra_args={"parse_threshold": 0.5})
    try:
        runs = {}
        for name, path in (("evidence", with_ev), ("plain", without)):
            llm.collective_rpc(_use_head(path))
            llm.collective_rpc(_count_forwards)
            llm.collective_rpc("parse_step_audit")
            parse_vllm.reset_stats(llm)
            outs = llm.generate(PROMPTS[:3], sp)
            runs[name] = {
                "tokens": [o.outputs[0].token_ids for o in outs],
                "counts": llm.collective_rpc(_counts)[0],
                "audit": llm.collective_rpc("parse_step_audit")[0],
                "stats": parse_vllm.get_stats(llm),
                "records": parse_vllm.get_judgments(llm)[-parse_vllm.get_stats(llm)["copies"] :],
            }
    finally:
        close_llm(llm)
    ev, plain = runs["evidence"], runs["plain"]
    assert ev["tokens"] == plain["tokens"]
    assert ev["stats"]["copies"] == plain["stats"]["copies"] > 0
    assert ev["counts"] == plain["counts"] and ev["counts"]["forward"] > 0
    for key in ("host_copies_max", "host_to_device_max", "pageable_copies_max"):
        assert ev["audit"][key] == plain["audit"][key], key
    assert all(r["evidence"] is None for r in plain["records"])

    head = JudgeHead.load(with_ev)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for r in ev["records"][:10]:
        ids, b = r["token_ids"], r["boundary"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        start = len(ids) - b  # the window's first draft token
        lps, mms = _by_hand(logits[start - 1 : len(ids) - 1], ids[start:])
        want = prefix_features(np.array(lps), np.array(mms), [b])[0]
        assert np.allclose(r["evidence"], want, atol=1e-3), (r["evidence"], want)
        zs = r["logprob_yes"] - r["logprob_no"]
        by_hand = head.logit(np.asarray(r["hidden"])[None], np.array([zs]), np.array([r["evidence"]]))[0]
        assert abs(r["logit"] - by_hand) <= 1e-3
