"""The judges compared with the head (parse_vllm/tools/judge/compare.py) on made-up examples
whose labels are known functions of the features: the KL statistic chosen, the fitted judges
saved and applied, the feature choice inside each outer fold, the score tables' judge
columns and the report's figures from them, and the judge mode's rule."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")

from parse_vllm.evidence import EVIDENCE_FEATURES  # noqa: E402
from parse_vllm.tools.judge import compare, probe, report, scores  # noqa: E402
from parse_vllm.tools.judge.baselines import KL_FEATURES  # noqa: E402

H = 6
ROOT = Path(__file__).resolve().parents[1]


def _examples(seed: int = 0, tasks: int = 30) -> probe.Examples:
    """Labels from the hidden state at the prefix (its first column) and kl_td_max; the
    hidden state after the suffix and the other KL statistics are noise."""
    rng = np.random.default_rng(seed)
    per_task = 6  # two whole answers and four prefixes of them
    n = tasks * per_task
    at_prefix = rng.normal(size=(n, H)).astype(np.float32)
    kl = rng.gamma(2.0, 1.0, size=(n, len(KL_FEATURES)))
    signal = 2.0 * at_prefix[:, 0] - 1.5 * (kl[:, 1] - 2.0) + rng.normal(scale=0.5, size=n)
    whole = np.tile([True, True, False, False, False, False], tasks)
    return probe.Examples(
        hidden=rng.normal(size=(n, H)).astype(np.float32),
        zero_shot=rng.normal(size=n),
        label=signal > 0,
        whole=whole,
        task=np.repeat([f"T/{i}" for i in range(tasks)], per_task),
        answer=np.tile([0, 1, 0, 0, 1, 1], tasks),  # two whole answers, each with prefixes
        length=np.tile([40, 40, 10, 20, 30, 35], tasks),
        how=[""] * n,
        weight=np.ones(n),
        evidence=rng.normal(size=(n, 4)),
        kl=kl,
        hidden_at_prefix=at_prefix,
    )


def test_the_kl_judge_reads_the_statistic_that_ranks_best_on_training():
    ex = _examples()
    stat, aucs = compare.kl_statistic(ex)
    assert stat == "kl_td_max"
    assert set(aucs) == set(KL_FEATURES)
    w, p = probe.kind_aucs(-ex.kl[:, 1], ex)
    assert aucs["kl_td_max"] == {"auc_whole": w, "auc_prefix": p} and w > 0.7
    assert all(abs(v["auc_whole"] - 0.5) < 0.2 for f, v in aucs.items() if f != "kl_td_max")


def test_fitted_judges_are_saved_and_score_a_held_out_set_as_their_pipelines_do(tmp_path):
    ex, held = _examples(0), _examples(1)
    got = compare.train(ex, ("hidden",), log=lambda *_: None)
    assert set(got["oof"]) == set(compare.JUDGES) and set(got["fits"]) == {"suffix_free", "suffix_free_kl", "head_kl"}
    # the suffix-free judges see the signal, the head's features (noise here) barely do
    sf_w, sf_p = probe.kind_aucs(got["oof"]["suffix_free_kl"], ex)
    head_w, _ = probe.kind_aucs(got["oof"]["head_kl"], ex)
    assert sf_w > 0.9 and sf_p > 0.9 and head_w < sf_w
    path = compare.save(tmp_path / compare.FITS_FILE, got["kl_statistic"], got["fits"])
    stat, fits = compare.load(path)
    assert stat == "kl_td_max" and fits["head_kl"].features == ("hidden", *KL_FEATURES)
    out = compare.score(held, stat, fits)
    assert np.array_equal(out["kl"], -held.kl[:, 1])
    for name, names in compare.fitted_sets(("hidden",)).items():
        X = ex.features(names)
        with probe.boosting(names, H):
            pipe = probe.fit(got["C"][name]["C"], X, ex.label, ex.weight)
        assert np.allclose(out[name], pipe.decision_function(held.features(names)), atol=1e-9), name


def test_the_boost_starts_after_every_h_column_feature():
    assert probe.boosting(("hidden_at_prefix",), H).start is None
    assert probe.boosting(("hidden_at_prefix", *KL_FEATURES), H).start == H
    assert probe.boosting(("hidden", "zero_shot_logit", *KL_FEATURES), H).start == H
    assert probe.boosting(tuple(KL_FEATURES), H).start == 0
    ex = _examples()
    X = ex.features(("kl_dt_mean", "hidden_at_prefix"))  # the H columns first whatever the order
    assert np.array_equal(X[:, :H], ex.hidden_at_prefix.astype(np.float64)) and np.array_equal(X[:, H], ex.kl[:, 3])


def test_each_outer_fold_chooses_its_features_on_its_own_training_part():
    """Evidence column 2 is the label on the tasks of the first outer fold and 0 elsewhere
    (the other scalars are 0 everywhere, h carries a signal): a choice made on every fold
    keeps it; the first fold, which holds those tasks out, sees a constant there and keeps h
    alone; and each fold's choice and scores are those of its own training part."""
    from sklearn.model_selection import GroupKFold

    ex = _examples()
    ex.hidden = np.concatenate([ex.hidden_at_prefix[:, :1], ex.hidden[:, 1:]], axis=1)
    ex.zero_shot[:] = 0.0
    ex.evidence[:] = 0.0
    folds = list(GroupKFold(n_splits=probe.OUTER_FOLDS).split(np.zeros(len(ex)), ex.label, ex.task))
    leak_rows = folds[0][1]
    ex.evidence[leak_rows, 2] = np.where(ex.label[leak_rows], 3.0, -3.0)
    z, chosen = compare.selection_nested_oof(ex, "select", log=lambda *_: None)
    assert len(chosen) == probe.OUTER_FOLDS
    leaky = EVIDENCE_FEATURES[2]
    assert compare.choose_features(ex, "select") == ("hidden", leaky)  # chosen on every fold
    assert chosen[0]["features"] == ["hidden"]  # the leak's rows were held out of fold 1's choice
    for k, (tr, te) in enumerate(folds):
        inner = ex.subset(np.isin(np.arange(len(ex)), tr))
        keep = compare.choose_features(inner, "select")
        assert list(keep) == chosen[k]["features"]
        X = ex.features(keep)
        with probe.boosting(keep, H):
            want = probe.fit_score(chosen[k]["C"], X[tr], ex.label[tr], ex.weight[tr], X[te])
        assert np.allclose(z[te], want)


def test_score_tables_carry_the_judges_and_the_report_is_recomputed_from_them(tmp_path):
    ex = _examples()
    head = ex.hidden_at_prefix[:, 0].astype(np.float64) + 0.3 * ex.zero_shot  # a head a bit worse than the judge
    judges = {"suffix_free": ex.hidden_at_prefix[:, 0].astype(np.float64), "kl": -ex.kl[:, 1]}
    path = scores.write(tmp_path / "scores" / "odd.csv", ex, head, judges=judges)
    header = path.read_text().splitlines()[0].split(",")
    assert header[-2:] == ["kl", "suffix_free"]  # compare.JUDGES' order
    table = scores.read(path)
    assert set(table.judges) == {"kl", "suffix_free"} and np.array_equal(table.judges["kl"], judges["kl"])
    summary = {"train_split": "train", "splits": ["train", "odd"], "score_files": {"odd": "scores/odd.csv"}}
    s = scores.rescore(tmp_path, summary)
    for kind, mask in (("whole", ex.whole), ("prefix", ~ex.whole)):
        a = probe.auc(judges["suffix_free"][mask], ex.label[mask])
        b = probe.auc(head[mask], ex.label[mask])
        assert s[f"auc_suffix_free_{kind}_odd"] == pytest.approx(a, abs=1e-12)
        assert s[f"auc_suffix_free_minus_head_{kind}_odd"] == pytest.approx(a - b, abs=1e-12)
        lo, hi = s[f"auc_suffix_free_minus_head_{kind}_odd_ci"]
        assert lo <= a - b <= hi
    assert "auc_suffix_free_kl_whole_odd" not in s
    assert s["judge_mode"] == "suffix" and s["suffix_free_within_margin"] is True  # better than the head
    # evaluated again without the judges: their figures go
    scores.write(path, ex, head)
    again = scores.rescore(tmp_path, json.loads(json.dumps(s)))
    assert not any(k.startswith(("auc_kl_", "auc_suffix_free_", "brier_kl_")) for k in again)
    assert again["suffix_free_within_margin"] is None and again["judge_mode"] == "suffix"


@pytest.mark.parametrize(
    ("diffs", "within", "worst", "said"),
    [
        ((-0.01, 0.02, -0.02, 0.0), True, -0.02, "yes (worst -0.020)"),
        ((-0.01, 0.02, -0.03, 0.0), False, -0.03, "no (worst -0.030)"),
        ((0.05, 0.04, None, None), None, None, "undecided (not scored on mbpp_test)"),
        ((None, None, None, None), None, None, "undecided (not scored on odd, mbpp_test)"),
    ],
)
def test_a_suffix_free_judge_ships_only_within_the_margin_on_every_held_out_split(diffs, within, worst, said):
    summary = {"train_split": "train", "train_sets": ["even"], "splits": ["train", "even", "odd", "mbpp_test"]}
    keys = [(k, sp) for sp in ("odd", "mbpp_test") for k in ("whole", "prefix")]
    for (k, sp), d in zip(keys, diffs):
        if d is not None:
            summary[f"auc_suffix_free_kl_{k}_{sp}"] = 0.7
            summary[f"auc_suffix_free_kl_minus_head_{k}_{sp}"] = d
    # the sets trained on or cross-validated do not decide, however far they fall
    summary["auc_suffix_free_kl_whole_even"], summary["auc_suffix_free_kl_minus_head_whole_even"] = 0.5, -0.5
    summary["auc_suffix_free_kl_minus_head_whole_train"] = -0.5
    got = compare.verdict(summary)
    assert got["suffix_free_kl_within_margin"] is within and got["judge_mode"] == "suffix"
    assert got["suffix_free_kl_worst_minus_head"] == worst
    assert got["suffix_free_within_margin"] is None  # not scored anywhere
    # the report says it, on the committed summary
    committed = json.loads((ROOT / "bench" / "judge-coder" / "summary.json").read_text())
    md = report.markdown({**committed, **got})
    assert f"suffix-free head + KL, {said}" in md
    assert "suffix-free head, undecided (not scored on odd, mbpp_test)" in md


def test_examples_load_the_baselines_arrays_and_concat_keeps_them_only_when_all_have_them(tmp_path):
    ex = _examples()
    folder = tmp_path / "set"
    folder.mkdir()
    index = [{"label": bool(y), "kind": "whole" if w else "prefix", "task": t, "answer": int(a), "length": int(n),
              "how": "", "weight": 1.0} for y, w, t, a, n in zip(ex.label, ex.whole, ex.task, ex.answer, ex.length)]  # fmt: skip
    (folder / "index.jsonl").write_text("".join(json.dumps(r) + "\n" for r in index))
    np.save(folder / "features.npy", ex.hidden)
    np.save(folder / "zero_shot.npy", ex.zero_shot)
    plain = probe.Examples.load(folder, source="a")
    assert plain.kl is None and plain.hidden_at_prefix is None and not compare.available(plain)
    np.save(folder / "kl.npy", ex.kl)
    np.save(folder / "hidden_at_prefix.npy", ex.hidden_at_prefix)
    full = probe.Examples.load(folder, source="b")
    assert compare.available(full) and np.array_equal(full.kl, ex.kl)
    assert np.array_equal(full.subset(full.whole).hidden_at_prefix, ex.hidden_at_prefix[ex.whole])
    assert probe.Examples.concat([full, full]).kl.shape == (2 * len(ex), len(KL_FEATURES))
    assert probe.Examples.concat([full, plain]).kl is None
    with pytest.raises(ValueError, match="--baselines"):
        plain.features(("hidden_at_prefix",))
    with pytest.raises(ValueError, match="--baselines"):
        plain.scalar("kl_td_mean")
