"""The head beside the field's judges, on the same examples and splits as the head (the
baselines stage's data, baselines.py), and the head's own training figure with its feature
choice inside the folds.

The judges, each a score where higher means "more likely correct" (a column of the score
tables, scores.py, so the report recomputes from them):

* ``kl``: the KL judge, untrained: minus one of baselines.KL_FEATURES. Which statistic (mean,
  max or 90th percentile, either direction) is the one thing chosen, on the training sets:
  the best training AUC (the mean of the whole-answer and prefix AUCs).
* ``suffix_free``: the head's probe (probe.model) on the target's hidden state at the prefix's
  own last token, which the window's forward computes anyway: a judge with no verification
  pass.
* ``suffix_free_kl``: the same plus the six KL statistics (scalars boosted like the head's).
* ``head_kl``: the head's own feature set plus the six KL statistics.

The fitted judges get C like the head: out-of-fold scores on the training sets from nested
cross-validation (C chosen inside each outer fold, folds grouped by task), then a fit on every
training example, saved beside the head (FITS_FILE: weights over standardised features, the
standardisation, the features, the KL statistic), with which ``--evaluate`` scores a held-out
set. A held-out AUC is compared with the head's by a paired task bootstrap
(``auc_<judge>_minus_head_<kind>_<split>``).

``selection_nested_oof``: the head's reported training CV chooses its features on all folds
(probe.choose_feature_set) and only C inside them. Here each outer fold runs the whole choice --
candidate feature sets, forward selection, C -- on its own training part, scored by plain
grouped CV there, so the out-of-fold scores never took part in any choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import probe
from .baselines import KL_FEATURES

FITS_FILE = "baseline_judges.npz"
JUDGES = ("kl", "suffix_free", "suffix_free_kl", "head_kl")
SUFFIX_FREE_JUDGES = ("suffix_free", "suffix_free_kl")  # the judges that need no verification pass
SUFFIX_FREE_MARGIN = 0.02  # a suffix-free judge this close to the head's AUC (or better) would ship


def grid() -> tuple[float, ...]:
    """C for the compared judges and inside the selection-nested folds: every other C of probe.C_GRID."""
    return probe.C_GRID[::2]


def available(ex: probe.Examples) -> bool:
    """Whether the examples carry the baselines stage's arrays."""
    return ex.kl is not None and ex.hidden_at_prefix is not None


def fitted_sets(head_features: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The feature set of each fitted judge."""
    return {
        "suffix_free": ("hidden_at_prefix",),
        "suffix_free_kl": ("hidden_at_prefix", *KL_FEATURES),
        "head_kl": (*head_features, *KL_FEATURES),
    }


@dataclass
class LinearJudge:
    """A fitted probe as numbers: log-odds = ((x - mean) / scale) · weight + bias."""

    features: tuple[str, ...]
    weight: np.ndarray  # [F] over the standardised features
    bias: float
    mean: np.ndarray  # [F]
    scale: np.ndarray  # [F] (a boosted scalar's boost folded in)

    @classmethod
    def of(cls, pipe, features: tuple[str, ...]) -> LinearJudge:
        scaler, lr = pipe[0], pipe[-1]
        return cls(tuple(features), np.asarray(lr.coef_[0], dtype=np.float64), float(lr.intercept_[0]),
                   np.asarray(scaler.mean_, dtype=np.float64), np.asarray(scaler.scale_, dtype=np.float64))  # fmt: skip

    def logit(self, ex: probe.Examples) -> np.ndarray:
        return ((ex.features(self.features) - self.mean) / self.scale) @ self.weight + self.bias


def kl_statistic(ex: probe.Examples) -> tuple[str, dict[str, dict[str, float | None]]]:
    """The KL statistic whose negation ranks the examples best (the mean of the whole and
    prefix AUCs; the first in KL_FEATURES on a tie), and every statistic's AUCs."""
    aucs = {f: probe.kind_aucs(-ex.scalar(f), ex) for f in KL_FEATURES}
    best = max(KL_FEATURES, key=lambda f: (probe._mean(aucs[f]), -KL_FEATURES.index(f)))
    return best, {f: {"auc_whole": w, "auc_prefix": p} for f, (w, p) in aucs.items()}


def train(ex: probe.Examples, head_features: tuple[str, ...], log=print, judges=None) -> dict[str, Any]:
    """Each judge's out-of-fold scores on the training examples and its fit on all of them
    (the KL judge and the fitted ones named in `judges`, all of them when None)."""
    stat, stat_aucs = kl_statistic(ex)
    log(f"compare: KL judge -{stat} (training AUC whole {stat_aucs[stat]['auc_whole']}, "
        f"prefixes {stat_aucs[stat]['auc_prefix']})")  # fmt: skip
    oof = {"kl": -ex.scalar(stat)}
    fits, chosen_c = {}, {}
    H = ex.hidden.shape[1]
    for name, names in fitted_sets(tuple(head_features)).items():
        if judges is not None and name not in judges:
            continue
        X = ex.features(names)
        with probe.boosting(names, H):
            oof[name], per_fold = probe.nested_oof(X, ex, grid=grid())
            C, _ = probe.choose_c(X, ex, grid=grid())
            fits[name] = LinearJudge.of(probe.fit(C, X, ex.label, ex.weight), names)
        chosen_c[name] = {"C": C, "C_per_fold": per_fold}
        w, p = probe.kind_aucs(oof[name], ex)
        log(f"compare: {name} ({','.join(names)}): nested-CV AUC whole {w}, prefixes {p}")
    return {"kl_statistic": stat, "kl_statistic_aucs": stat_aucs, "oof": oof, "fits": fits, "C": chosen_c}


def score(ex: probe.Examples, stat: str, fits: dict[str, LinearJudge]) -> dict[str, np.ndarray]:
    """Every judge's scores [N] of a held-out set, from the training run's choice and fits."""
    return {"kl": -ex.scalar(stat), **{name: fit.logit(ex) for name, fit in fits.items()}}


def save(path: Path, stat: str, fits: dict[str, LinearJudge]) -> Path:
    arrays: dict[str, np.ndarray] = {"kl_statistic": np.array(stat)}
    for name, f in fits.items():
        arrays.update({f"{name}.features": np.array(f.features), f"{name}.weight": f.weight,
                       f"{name}.bias": np.array(f.bias), f"{name}.mean": f.mean, f"{name}.scale": f.scale})  # fmt: skip
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)
    return path


def load(path: Path) -> tuple[str, dict[str, LinearJudge]]:
    with np.load(path) as z:
        names = sorted({k.split(".")[0] for k in z.files if "." in k})
        fits = {
            n: LinearJudge(
                tuple(str(x) for x in z[f"{n}.features"]),
                z[f"{n}.weight"],
                float(z[f"{n}.bias"]),
                z[f"{n}.mean"],
                z[f"{n}.scale"],
            )  # fmt: skip
            for n in names
        }
        return str(z["kl_statistic"]), fits


def choose_features(ex: probe.Examples, features: str) -> tuple[str, ...]:
    """The head's feature choice (probe.choose_feature_set for a --features mode) made on `ex`
    alone, each candidate set scored by its best grouped-CV score over grid() (not nested: `ex`
    is already one outer fold's training part)."""
    H = ex.hidden.shape[1]

    def cv_score(names: tuple[str, ...]) -> float:
        with probe.boosting(names, H):
            _, table = probe.choose_c(ex.features(names), ex, grid=grid())
        return max(r["score"] for r in table)

    return probe.choose_feature_set(ex, features, cv_score)


def selection_nested_oof(ex: probe.Examples, features: str, log=print) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Out-of-fold scores [N] where each outer fold chose the features and C on its own
    training part (module docstring), and what each fold chose."""
    from sklearn.model_selection import GroupKFold

    out, folds = np.zeros(len(ex)), []
    H = ex.hidden.shape[1]
    for k, (tr, te) in enumerate(GroupKFold(n_splits=probe.OUTER_FOLDS).split(np.zeros(len(ex)), ex.label, ex.task)):
        inner = ex.subset(np.isin(np.arange(len(ex)), tr))
        keep = choose_features(inner, features)
        X = ex.features(keep)
        with probe.boosting(keep, H):
            C, _ = probe.choose_c(X[tr], inner, grid=grid())
            out[te] = probe.fit_score(C, X[tr], ex.label[tr], ex.weight[tr], X[te])
        folds.append({"features": list(keep), "C": C})
        log(f"compare: selection-nested fold {k + 1}/{probe.OUTER_FOLDS}: {','.join(keep)}, C {C:g}")
    return out, folds


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """For each suffix-free judge (SUFFIX_FREE_JUDGES), whether it is within SUFFIX_FREE_MARGIN
    of the head (or better) on every held-out split and kind, and its worst paired difference
    there (how far short it falls); None where some held-out split has no score for it. The
    held-out splits are those neither trained on nor cross-validated (train_split,
    train_sets). `judge_mode` is what the runtime reads: the suffix, until a suffix-free judge
    mode is built for a judge that meets the margin."""
    cv = {summary.get("train_split"), *summary.get("train_sets", [])}
    held = [sp for sp in summary.get("splits", []) if sp not in cv]
    out: dict[str, Any] = {"judge_mode": "suffix", "suffix_free_margin": SUFFIX_FREE_MARGIN}
    for judge in SUFFIX_FREE_JUDGES:
        by_split = {
            sp: [d for k in ("whole", "prefix") if (d := summary.get(f"auc_{judge}_minus_head_{k}_{sp}")) is not None]
            for sp in held
        }
        diffs = [d for ds in by_split.values() for d in ds]
        decided = bool(held) and all(by_split.values())  # a paired difference on every held-out split
        out[f"{judge}_within_margin"] = bool(min(diffs) >= -SUFFIX_FREE_MARGIN) if decided else None
        out[f"{judge}_worst_minus_head"] = min(diffs) if decided else None
        out[f"{judge}_not_scored_on"] = [sp for sp, ds in by_split.items() if not ds]
    return out
