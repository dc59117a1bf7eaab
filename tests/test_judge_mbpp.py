"""`parse-vllm train-judge` on a tiny synthetic MBPP file (issue 37): two prompt sets in one
run, balancing, the evidence stage, forward feature selection, τ_head and the report, then
`--evaluate` on MBPP test with an older head beside. The writers are scripted (as in
test_train_judge.py) and the target's readers are HF forwards of the tiny target, so no
engine starts; the code checks run for real."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")
pytestmark = pytest.mark.slow  # ~4 min on 2 cores: nested CV of every feature set and the ablation

from parse_vllm import cli  # noqa: E402
from parse_vllm.tools.judge import baselines  # noqa: E402
from parse_vllm.tools.judge import data as jdata  # noqa: E402

TRAIN_IDS = (1, 2, 511, 512, *range(601, 611))
TEST_IDS = tuple(range(11, 17))
NEVER_FAILS = {601, 604, 607, 11, 14}  # the draft's greedy and sampled answers all pass here


def _answer(op: str) -> str:
    return f"```python\ndef f(x):\n    y = x {op}\n    return y\n```"


def _mbpp(path: Path) -> Path:
    rows = [
        {"text": f"Write a function f(x) that returns x plus {i}.", "code": f"def f(x):\n    return x + {i}",
         "task_id": i, "test_setup_code": "", "test_list": [f"assert f(1) == {i + 1}", f"assert f(2) == {i + 2}"],
         "challenge_test_list": []}
        for i in (*TRAIN_IDS, *TEST_IDS)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Script:
    def __init__(self, tok):
        self.tok, self.eos = tok, tok.eos_token_id
        self.prompts: dict[tuple[int, ...], int] = {}
        self.balance_requests = 0

    def ids(self, text):
        return self.tok.encode(text, add_special_tokens=False)

    def answers(self, i: int, kind: str, n: int) -> list[str]:
        right, wrong = _answer(f"+ {i}"), _answer(f"- {i}")
        if kind == "greedy":
            return [right if i in NEVER_FAILS or i % 2 == 0 else wrong]
        if kind == "sample":
            return [right, _answer(f"+ {i} * 1") if i in NEVER_FAILS else wrong][:n]
        return [_answer(f"* {k + 2}") for k in range(n)]  # balance: hot and wrong

    def writer(self, role: str):
        script = self

        class _W:
            def __call__(self, requests):
                return [script.write(r, role) for r in requests]

            def close(self):
                pass

        return _W()

    def split(self, ids):
        for p, i in self.prompts.items():
            if ids[: len(p)] == p:
                return i, ids[len(p) :]
        raise AssertionError("unknown prompt")

    def write(self, r: jdata.Request, role: str) -> list[list[int]]:
        """The draft: greedy (wrong on odd ids but NEVER_FAILS), two samples, balancing answers
        (hot: always wrong); the target: the right answer, or a prefix continued with the rest
        of the first scripted answer that starts with it."""
        i, prefix = self.split(r.prompt_ids)
        if r.temperature > 1.0:
            self.balance_requests += 1
            return [self.ids(t) + [self.eos] for t in self.answers(i, "balance", r.n)]
        if r.temperature > 0:
            return [self.ids(t) + [self.eos] for t in self.answers(i, "sample", r.n)]
        if not prefix:
            text = self.answers(i, "greedy", 1)[0] if role == "draft" else _answer(f"+ {i}")
            return [self.ids(text) + [self.eos]]
        rest = None
        for t in (_answer(f"+ {i}"), *self.answers(i, "sample", 2), *self.answers(i, "balance", 2), _answer(f"- {i}")):
            a = self.ids(t)
            if tuple(a[: len(prefix)]) == tuple(prefix):
                rest = a[len(prefix) :]
                break
        assert rest is not None
        return [rest + [self.eos]]


@pytest.fixture(scope="module")
def tok(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["target"])


@pytest.fixture(scope="module")
def hf(tiny_models):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32).eval()


def _readers(hf):
    import torch

    class Hidden:
        def __call__(self, seqs):
            out = []
            for s in seqs:
                with torch.no_grad():
                    h = hf(torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0, -1]
                out.append(h.numpy().astype(np.float32))
            return np.stack(out)

        def close(self):
            pass

    class Logprobs:
        calls = 0

        def __call__(self, seqs):
            Logprobs.calls += 1
            out = []
            for s in seqs:
                with torch.no_grad():
                    lp = torch.log_softmax(hf(torch.tensor([s])).logits[0, :-1], -1)
                nxt = torch.tensor(s[1:])
                ev = np.stack([lp.gather(1, nxt[:, None])[:, 0].numpy(), (lp.argmax(-1) != nxt).float().numpy()])
                out.append(ev.astype(np.float32))
            return out

        def close(self):
            pass

    return Hidden(), Logprobs()


def _topk_reader(models):
    """baselines.open_topk_reader for the tiny pair: an HF forward's top TOP_K log-probabilities
    at every position after the first, and the sequence's own token where it is not among them
    (as vLLM's prompt_logprobs reports)."""
    import torch
    from transformers import AutoModelForCausalLM

    hfs = {
        str(models[k]): AutoModelForCausalLM.from_pretrained(models[k], dtype=torch.float32).eval()
        for k in ("target", "draft")
    }

    class Topk:
        def __init__(self, model):
            self.model = model

        def __call__(self, seqs):
            out = []
            for s in seqs:
                with torch.no_grad():
                    lp = torch.log_softmax(self.model(torch.tensor([s])).logits[0, :-1].double(), -1)
                vals, idx = lp.topk(baselines.TOP_K, dim=-1)
                rows = []
                for j, t in enumerate(s[1:]):
                    ids, v = idx[j].numpy(), vals[j].numpy()
                    if t not in ids:
                        ids, v = np.append(ids, t), np.append(v, lp[j, t].item())
                    rows.append((ids, v))
                out.append(rows)
            return out

        def close(self):
            pass

    return lambda engine: Topk(hfs[engine["model"]])


def _negated(head: Path, out: Path) -> Path:
    """A head whose log-odds are the given head's negated (weight and bias times -1): an
    "older head" that ranks every pair the other way, so its AUC is 1 - the head's."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(head), "np") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["weight"], tensors["bias"] = -tensors["weight"], -tensors["bias"]
    save_file(tensors, str(out), metadata=meta)
    return out


@pytest.fixture(scope="module")
def run(tiny_models, tok, hf, tmp_path_factory):
    from parse_vllm.tools.eval.run import _render
    from parse_vllm.tools.judge import probe, prompts

    root = tmp_path_factory.mktemp("mbpp")
    path = _mbpp(root / "mbpp.jsonl")
    script = Script(tok)
    for it in prompts.load_mbpp(path, "all").items:
        script.prompts[tuple(_render(tok, it))] = int(it["id"].split("/")[1])
    models = tiny_models

    def writer_for(engine):
        return script.writer("draft" if engine["model"] == str(models["draft"]) else "target")

    hidden, logprobs = _readers(hf)
    mp = pytest.MonkeyPatch()
    mp.setattr(jdata, "open_writer", writer_for)
    mp.setattr(jdata, "open_reader", lambda engine: hidden)
    mp.setattr(jdata, "open_logprob_reader", lambda engine: logprobs)
    mp.setattr(baselines, "open_topk_reader", _topk_reader(models))
    # the data-size curve (no test reads it) at two shares of the tasks, not probe.CURVE_FRACTIONS' five: the
    # same kind of fits, a third as many (about a quarter of the training's fits otherwise); C from three
    # values, not probe.C_GRID's nine (no test reads which C was chosen)
    mp.setattr(probe, "CURVE_FRACTIONS", (0.5, 1.0))
    mp.setattr(probe, "C_GRID", (1e-4, 1e-2, 1.0))
    out = root / "out"
    base = [
        "train-judge", "--target", str(models["target"]), "--draft", str(models["draft"]), "--window", "16",
        "--samples", "2", "--prefixes-passing", "1", "--prefixes-failing", "2", "--max-tokens", "40",
        "--engine", json.dumps({"kv_cache_memory_bytes": 64 << 20, "max_model_len": 512}), "--out", str(out),
    ]  # fmt: skip
    try:
        rc_train = cli.main(
            [*base, "--prompts", str(path), "--features", "select", "--balance-samples", "2", "--balance-below", "0",
             "--baselines"]
        )  # fmt: skip
        head = out / "judge_head.safetensors"
        old_head = _negated(head, root / "old_head.safetensors")
        rc_eval = cli.main(
            [*base, "--prompts", f"{path}:test", "--evaluate", str(head), "--old-head", str(old_head),
             "--balance-samples", "2", "--balance-below", "0", "--baselines"]
        )  # fmt: skip
    finally:
        mp.undo()
    return {"root": root, "path": path, "out": out, "rc": (rc_train, rc_eval), "script": script, "lp": logprobs,
            "models": models}  # fmt: skip


def test_training_on_mbpp_records_the_set_selects_features_and_chooses_tau(run):
    import hashlib

    from parse_vllm.judge_head import JudgeHead
    from parse_vllm.tools.judge import probe

    assert run["rc"] == (0, 0)
    out = run["out"]
    head = JudgeHead.load(out / "judge_head.safetensors")
    digest = hashlib.sha256(run["path"].read_bytes()).hexdigest()
    (ps,) = head.prompt_sets
    assert ps["name"] == "mbpp-train+validation+prompt" and ps["split"] == "train+validation+prompt"
    assert ps["sha256"] == digest and ps["tasks"] == len(TRAIN_IDS) and ps["role"] == "train"
    assert head.tau in probe.TAU_GRID and head.training["tau_head"]["rule"].startswith("the smallest τ")
    s = json.loads((out / "summary.json").read_text())
    assert s["tau_head"] == head.tau and s["features_kept"] == list(head.features)
    assert head.features[0] == "hidden"
    fitted = {r["features"] for r in s["feature_ablation"] if r["fitted"]}
    assert "hidden" in fitted and "hidden,greedy_mismatch" in fitted
    assert s["feature_comparison"]["hidden"]["score"] is not None
    md = (out / "summary.md").read_text()
    assert "Feature ablation" in md and "τ_head" in md and "mbpp_test" in md


def test_balance_samples_more_where_the_draft_never_fails(run):
    d = run["out"] / "data" / "mbpp-train+validation+prompt"
    answers = [json.loads(x) for x in (d / "answers.jsonl").read_text().splitlines()]
    balanced = {a["task"] for a in answers if a["source"] == "balance"}
    assert balanced == {f"MBPP/{i}" for i in NEVER_FAILS & set(TRAIN_IDS)}
    assert all(sum(1 for a in answers if a["task"] == t and a["source"] == "balance") == 2 for t in balanced)
    done = json.loads((d / "boundaries.done.json").read_text())
    assert done["settings"]["balance"] == {"samples": 2, "temperature": 1.1, "below": 0.0}
    assert sorted(done["balanced_tasks"]) == sorted(balanced)


def test_the_evidence_stage_aggregates_the_per_token_values_over_each_window(run):
    from parse_vllm.tools.judge.data import example_evidence, read_jsonl

    d = run["out"] / "data" / "mbpp-train+validation+prompt"
    index = read_jsonl(d / "index.jsonl")
    ev = np.load(d / "evidence.npy")
    assert ev.shape == (len(index), 4)
    tokens = {
        (r["task"], r["answer"]): np.array([r["logprob"], r["mismatch"]])
        for r in read_jsonl(d / "token_evidence.jsonl")
    }
    answers = {(a["task"], a["answer"]): a["token_ids"] for a in read_jsonl(d / "boundaries.jsonl")}
    assert all(t.shape[1] == len(answers[k]) for k, t in tokens.items())
    assert np.allclose(ev, example_evidence(index, tokens, 16))


def test_evaluate_on_mbpp_test_scores_the_head_and_the_old_head_and_writes_csv(run):
    out = run["out"]
    s = json.loads((out / "summary.json").read_text())
    for key in ("auc_head_whole_mbpp_test", "auc_zero_shot_whole_mbpp_test", "auc_old_head_whole_mbpp_test"):
        assert key in s, key
    for kind in ("whole", "prefix"):  # the older head is the head negated: every pair ranked the other way
        a = s[f"auc_head_{kind}_mbpp_test"]
        assert s[f"auc_old_head_{kind}_mbpp_test"] == pytest.approx(1 - a, abs=1e-9)
        assert s[f"auc_head_minus_old_head_{kind}_mbpp_test"] == pytest.approx(2 * a - 1, abs=1e-9)
        lo, hi = s[f"auc_head_minus_old_head_{kind}_mbpp_test_ci"]
        assert lo <= 2 * a - 1 <= hi
    # built with balancing: its figures without the balancing answers (numbered past --samples 2)
    rows = [r.split(",") for r in (out / "scores" / "mbpp_test.csv").read_text().splitlines()[1:]]
    assert s["mbpp_test_like_training_n"] == sum(int(r[2]) <= 2 for r in rows) < len(rows)
    assert s["prompt_sets"]["mbpp_test"]["split"] == "test" and s["prompt_sets"]["mbpp_test"]["tasks"] == len(TEST_IDS)
    assert "mbpp_test" in s["pass_rates_at_tau_head"]
    rows = (out / "scores" / "mbpp_test.csv").read_text().splitlines()
    assert rows[0].startswith("set,task,answer,kind,length,label,weight,zero_shot,head,old_head")
    assert len(rows) - 1 == s["mbpp_test_n"]
    assert (out / "scores" / "mbpp_train_validation_prompt.csv").is_file()
    md = (out / "summary.md").read_text()
    assert "Held out, side by side" in md and "old head" in md


def test_the_baselines_stage_reads_both_models_at_each_answer_token_and_the_prefix_itself(run, hf, tok):
    """`--baselines` on the held-out build: each answer's per-token KL is the top-k KL of the
    two models' distributions predicting that token (recomputed here from full HF forwards),
    each example's KL features are taken over its boundary's window, and the suffix-free
    hidden state is the target's at prompt + prefix's last token, not the suffix's."""
    import torch
    from transformers import AutoModelForCausalLM

    from parse_vllm.evidence import window_start

    d = run["out"] / "data" / "mbpp-test"
    done = json.loads((d / "baselines.done.json").read_text())
    rows = [json.loads(x) for x in (d / "index.jsonl").read_text().splitlines()]
    assert done["rows"] == len(rows) > 0
    answers = {(a["task"], a["answer"]): a["token_ids"] for a in map(json.loads, (d / "boundaries.jsonl").open())}
    prompts = {f"MBPP/{i}": list(p) for p, i in run["script"].prompts.items()}
    draft = AutoModelForCausalLM.from_pretrained(run["models"]["draft"], dtype=torch.float32).eval()
    token_kl = {(r["task"], r["answer"]): r for r in map(json.loads, (d / "token_kl.jsonl").open())}
    assert set(token_kl) == {(r["task"], r["answer"]) for r in rows}
    for (task, a), rec in list(token_kl.items())[:4]:
        seq, p = prompts[task] + answers[(task, a)], len(prompts[task])
        with torch.no_grad():
            lt, ld = (torch.log_softmax(m(torch.tensor([seq])).logits[0].double(), -1) for m in (hf, draft))
        for j, token in enumerate(answers[(task, a)]):  # answer token j is predicted at position p - 1 + j
            tops = []
            for lx in (lt, ld):  # each model's top TOP_K and the answer's own token, as vLLM reports them
                v, i = lx[p - 1 + j].topk(baselines.TOP_K)
                ids, lps = i.tolist(), v.tolist()
                if token not in ids:
                    ids, lps = ids + [token], lps + [lx[p - 1 + j, token].item()]
                tops += [np.array(ids), np.array(lps)]
            want = baselines.topk_kl(*tops, len(tok))
            assert rec["kl_td"][j] == pytest.approx(want, abs=2e-6), (task, a, j)
    check = json.loads((d / "kl_check.json").read_text())  # the first answers against full distributions
    keys = list(dict.fromkeys((r["task"], r["answer"]) for r in rows))[: baselines.KL_CHECK_ANSWERS]
    got, full = [], []
    for task, a in keys:
        seq, p = prompts[task] + answers[(task, a)], len(prompts[task])
        with torch.no_grad():
            lt, ld = (m(torch.tensor([seq])).logits[0, p - 1 : -1].double().numpy() for m in (hf, draft))
        got.append(token_kl[(task, a)]["kl_td"])
        full.append(baselines.exact_kl(lt, ld))
    assert check["answers"] == len(keys) and check["tokens"] == sum(len(answers[k]) for k in keys)
    want = baselines.kl_errors(np.concatenate(got), np.concatenate(full))
    assert check["td"]["median_abs"] == pytest.approx(want["median_abs"], rel=1e-4, abs=1e-6)
    assert check["td"]["mean_exact"] == pytest.approx(want["mean_exact"], rel=1e-4)
    kl = np.load(d / "kl.npy")
    for i, r in enumerate(rows):
        rec = token_kl[(r["task"], r["answer"])]
        seg = np.array(rec["kl_td"][window_start(r["length"], 16) : r["length"]])
        assert kl[i, :3] == pytest.approx([seg.mean(), seg.max(), np.percentile(seg, 90)])
    at_prefix, with_suffix = np.load(d / "hidden_at_prefix.npy"), np.load(d / "features.npy")
    for i in (0, len(rows) - 1):
        r = rows[i]
        seq = prompts[r["task"]] + answers[(r["task"], r["answer"])][: r["length"]]
        with torch.no_grad():
            h = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0, -1].numpy()
        assert np.allclose(at_prefix[i], h, atol=1e-4) and not np.allclose(with_suffix[i], h, atol=1e-2)


def _read_beside_hf(reader_class, tiny_models, hf):
    """A reader of data.py or baselines.py through a real vLLM engine of the tiny target, over
    two sequences (its engine closed after), each beside the HF target's next-token
    log-probabilities at every position but the last [len - 1, V]."""
    import torch
    from conftest import engine_kwargs

    reader = reader_class(engine_kwargs(tiny_models["target"], kv_cache_memory_bytes=64 << 20))
    seqs = [[1, 502, 3312, 77, 9, 4410, 18, 2200], [5, 6, 7, 8, 9, 10]]
    try:
        got = reader(seqs)
    finally:
        reader.close()
    with torch.no_grad():
        lps = [torch.log_softmax(hf(torch.tensor([s])).logits[0, :-1].double(), -1) for s in seqs]
    return list(zip(seqs, got, lps))


def test_the_vllm_logprob_reader_equals_an_hf_forward(tiny_models, hf):
    """data.LogprobReader (vLLM prompt_logprobs, the evidence stage's reader) against the
    tiny target's HF logits: each token's log-probability and whether the argmax differs."""
    import torch

    for s, ev, lp in _read_beside_hf(jdata.LogprobReader, tiny_models, hf):
        nxt = torch.tensor(s[1:])
        assert ev.shape == (2, len(s) - 1)
        assert np.allclose(ev[0], lp.gather(1, nxt[:, None])[:, 0].numpy(), atol=1e-3)
        assert ev[1].tolist() == (lp.argmax(-1) != nxt).float().tolist()


def test_the_compared_judges_are_fitted_on_training_and_score_the_held_out_set(run):
    """Both runs built the baselines stage, so training fits the compared judges (saved beside
    the head) and `--evaluate` scores MBPP test with them: each score column is the saved fit
    applied to the held-out examples (recomputed here), each AUC and paired difference comes
    from its column, and the judge mode shipped is the suffix."""
    from parse_vllm.tools.judge import compare, probe, scores

    out = run["out"]
    s = json.loads((out / "summary.json").read_text())
    stat, fits = compare.load(out / compare.FITS_FILE)
    assert stat == s["judges_compared"]["kl_statistic"] in baselines.KL_FEATURES
    assert set(fits) == {"suffix_free", "suffix_free_kl", "head_kl"}
    assert fits["head_kl"].features == (*s["features_kept"], *baselines.KL_FEATURES)
    ex = probe.Examples.load(out / "data" / "mbpp-test")
    table = scores.read(out / "scores" / "mbpp_test.csv")
    assert set(table.judges) == set(compare.JUDGES)
    assert np.allclose(table.judges["kl"], -ex.kl[:, baselines.KL_FEATURES.index(stat)])
    f = fits["suffix_free"]
    by_hand = ((ex.hidden_at_prefix.astype(np.float64) - f.mean) / f.scale) @ f.weight + f.bias
    assert np.allclose(table.judges["suffix_free"], by_hand)
    for name in compare.JUDGES:
        for kind, mask in (("whole", ex.whole), ("prefix", ~ex.whole)):
            want = probe.auc(table.judges[name][mask], ex.label[mask], ex.weight[mask])
            assert s[f"auc_{name}_{kind}_mbpp_test"] == pytest.approx(want, abs=1e-12)
            head = probe.auc(table.head[mask], ex.label[mask], ex.weight[mask])
            if want is not None and head is not None:
                assert s[f"auc_{name}_minus_head_{kind}_mbpp_test"] == pytest.approx(want - head, abs=1e-12)
    train = scores.read(out / "scores" / "mbpp_train_validation_prompt.csv")
    assert set(train.judges) == set(compare.JUDGES)  # out of fold on the training split
    assert s["judge_mode"] == "suffix" and isinstance(s["suffix_free_within_margin"], bool)
    assert len(s["cv_selection_nested"]["folds"]) == 5 and s["cv_selection_nested"]["auc_whole"] is not None
    md = (out / "summary.md").read_text()
    assert "KL judge (untrained)" in md and "Suffix-free head minus the head, paired" in md


def test_the_vllm_topk_reader_equals_an_hf_forward(tiny_models, hf):
    """baselines.TopkReader through a real vLLM engine (the tests above replace it with HF
    forwards): at each position after the first, the target's top TOP_K tokens and the
    sequence's own next token, with their log-probabilities, as an HF forward gives them."""
    import torch

    for s, positions, lp in _read_beside_hf(baselines.TopkReader, tiny_models, hf):
        assert len(positions) == len(s) - 1
        for j, (ids, lps) in enumerate(positions):
            top = set(lp[j].topk(baselines.TOP_K - 5).indices.tolist())  # clear of ties at the k-th
            assert top <= set(ids.tolist()) and s[j + 1] in ids.tolist() and len(ids) <= baselines.TOP_K + 1
            assert np.allclose(lps, lp[j, torch.as_tensor(ids)].numpy(), atol=1e-3)


def test_judges_on_tables_rebuild_the_answers_and_give_the_full_builds_scores(run, hf, tmp_path, capsys):
    """`--judges-on-tables` on a copy of the report (its data folders removed): the draft's
    answers rebuilt and checked against the tables, the baselines stage over the tables' rows
    alone, and every compared judge's column, on training (out of fold) and held out, equal to
    the full build's; the head's columns untouched. A table row that names another length
    stops the run, naming the row."""
    import shutil

    from parse_vllm.tools.judge import scores

    out = tmp_path / "out"
    shutil.copytree(run["out"], out, ignore=shutil.ignore_patterns("data"))
    models = run["models"]
    full = {sp: scores.read(out / "scores" / f"{sp}.csv") for sp in ("mbpp_train_validation_prompt", "mbpp_test")}
    hidden, logprobs = _readers(hf)
    base = [
        "train-judge", "--target", str(models["target"]), "--draft", str(models["draft"]), "--window", "16",
        "--samples", "2", "--prefixes-passing", "1", "--prefixes-failing", "2", "--max-tokens", "40",
        "--engine", json.dumps({"kv_cache_memory_bytes": 64 << 20, "max_model_len": 512}), "--out", str(out),
        "--judges-on-tables",
    ]  # fmt: skip
    path = run["path"]
    mp = pytest.MonkeyPatch()
    script = run["script"]
    mp.setattr(
        jdata, "open_writer", lambda e: script.writer("draft" if e["model"] == str(models["draft"]) else "target")
    )
    mp.setattr(jdata, "open_reader", lambda engine: hidden)
    mp.setattr(jdata, "open_logprob_reader", lambda engine: pytest.fail("no evidence stage"))
    mp.setattr(baselines, "open_topk_reader", _topk_reader(models))
    try:
        assert cli.main([*base, "--prompts", str(path), "--balance-samples", "2", "--balance-below", "0"]) == 0
        held = [*base, "--prompts", f"{path}:test", "--balance-samples", "2", "--balance-below", "0"]
        assert cli.main(held) == 0
        for sp, want in full.items():
            got = scores.read(out / "scores" / f"{sp}.csv")
            assert np.array_equal(got.head, want.head) and np.array_equal(got.ex.label, want.ex.label)
            for name in ("kl", "suffix_free", "suffix_free_kl"):
                assert np.allclose(got.judges[name], want.judges[name], atol=1e-6), (sp, name)
            assert np.array_equal(got.judges["head_kl"], want.judges["head_kl"])  # kept from the full build
        assert not (out / "data-tables" / "mbpp-test" / "labels.done.json").exists()
        s = json.loads((out / "summary.json").read_text())
        assert s["data_for_judges"]["mbpp_test"]["rows"] == len(full["mbpp_test"].ex)
        table = out / "scores" / "mbpp_test.csv"
        lines = table.read_text().splitlines()
        k = next(i for i, line in enumerate(lines) if line.split(",")[3] == "whole")
        cells = lines[k].split(",")
        cells[4] = str(int(cells[4]) + 1)  # a whole answer one token longer than the draft wrote it
        lines[k] = ",".join(cells)
        table.write_text("\n".join(lines) + "\n")
        shutil.rmtree(out / "data-tables" / "mbpp-test")
        capsys.readouterr()
        assert cli.main(held) == 2
        err = capsys.readouterr().err
        assert "1 of" in err and f"length {int(cells[4])}: the answer has {int(cells[4]) - 1} tokens" in err, err
    finally:
        mp.undo()


def test_judges_fitted_on_some_training_sets_score_only_their_rows(tmp_path):
    """A training table of two sets, the judges' scores given for one (the other NaN): the
    report's judge figures are that set's alone, and none pooled over the table."""
    from parse_vllm.tools.judge import probe, scores

    rng = np.random.default_rng(0)
    n = 40
    src = np.array(["a"] * 20 + ["b"] * 20)
    label = np.array([(i // 2) % 2 == 0 for i in range(n)])
    ex = scores._table(
        {"set": list(src), "task": [f"t{i // 2}" for i in range(n)], "answer": ["0"] * n, "kind": ["whole", "prefix"] * 20,
         "length": ["5"] * n, "label": ["1" if x else "0" for x in label], "weight": ["1.0"] * n,
         "zero_shot": [repr(float(x)) for x in rng.normal(size=n)], "head": [repr(float(x)) for x in rng.normal(size=n)]}, n,
    )  # fmt: skip
    judge = np.where(src == "a", label + rng.normal(0, 0.1, n), np.nan)
    table = scores.ScoreTable(ex=ex.ex, head=ex.head, judges={"kl": judge})
    up = scores.figures(table, "train", {"train_split": "train"})
    a = src == "a"
    w = a & ex.ex.whole
    assert up["auc_kl_whole_a"] == pytest.approx(probe.auc(judge[w], label[w], np.ones(int(w.sum()))))
    assert up["auc_kl_whole_a"] == 1.0 and not any(k.startswith("auc_kl_") and k.endswith(("_b", "_train")) for k in up)
    path = scores.write(scores.path_of(tmp_path, "train"), ex.ex, ex.head, judges={"kl": judge})
    back = scores.read(path)
    assert np.array_equal(np.isnan(back.judges["kl"]), ~a) and np.array_equal(back.judges["kl"][a], judge[a])
    earlier = {"auc_kl_whole_train": 0.5, "auc_kl_whole_train_ci": [0.4, 0.6], "auc_kl_prefix_b": 0.7}  # another fit's
    summary = {"train_split": "train", "score_files": {"train": "scores/train.csv"}, **earlier}
    got = scores.rescore(tmp_path, summary)
    assert not set(earlier) & set(got) and got["auc_kl_whole_a"] == 1.0
