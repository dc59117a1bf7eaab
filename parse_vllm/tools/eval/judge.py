"""Does the judge discriminate? The target's P(Correct) on answers whose correctness is
known, as PARSE's verification pass computes it, and how well it separates right from
wrong answers (ROC AUC, histograms).

A judgment here is the target reading ``prompt + answer[:cut] + suffix`` (the verification
template of ``parse_vllm.templates``: the target's own chat template closing the answer and
asking the question) and scoring both labels whole: log P(label) = Σ_j log P(label_j |
suffix, label_<j), each factor read with vLLM's ``logprob_token_ids`` on a one-token
generation (prefix caching keeps the shared prompt and answer cheap). P(yes) =
P(Correct) / (P(Correct) + P(Incorrect)), as ``LabelScoring``.

Cuts: the whole answer, and every line end (after each token holding a newline) inside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def line_end_cuts(tok, answer: Sequence[int]) -> list[int]:
    """Positions just after each token of ``answer`` that holds a newline (BPE merges a
    newline with the next line's indentation: such a cut ends at that line's start, as
    PARSE's "sentence" boundaries do), the whole answer excluded."""
    return [i + 1 for i, t in enumerate(answer[:-1]) if "\n" in tok.decode([t])]


def p_yes(llm, template, sequences: list[list[int]]) -> list[float]:
    """P(yes) of each judged sequence (prompt + answer prefix), through ``llm`` (the target)."""
    from parse_vllm._vllm import SamplingParams

    labels = template.labels
    suffix = list(template.chat_suffix_ids)
    prompts, keys = [], []
    for k, seq in enumerate(sequences):
        for which, ids in (("yes", labels.yes_ids), ("no", labels.no_ids)):
            for j, t in enumerate(ids):
                prompts.append((seq + suffix + list(ids[:j]), int(t)))
                keys.append((k, which))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in prompts],
        [SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=[t], logprobs=1) for _, t in prompts],
        use_tqdm=True,
    )
    lp = {(k, w): 0.0 for k in range(len(sequences)) for w in ("yes", "no")}
    for (k, which), (_, t), out in zip(keys, prompts, outs):
        entry = out.outputs[0].logprobs[0]
        value = entry[t]
        lp[(k, which)] += float(getattr(value, "logprob", value))
    return [1.0 / (1.0 + math.exp(lp[(k, "no")] - lp[(k, "yes")])) for k in range(len(sequences))]


def roc_auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """P(score of a random right answer > that of a random wrong one), ties half (the
    Mann-Whitney form of the ROC AUC); None without both classes."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def discrimination(scores: Sequence[float], labels: Sequence[bool], bins: int = 10) -> dict[str, Any]:
    """AUC, counts and the two histograms of P(yes) over [0, 1]."""
    edges = [i / bins for i in range(bins + 1)]

    def hist(xs):
        counts = [0] * bins
        for x in xs:
            counts[min(bins - 1, int(x * bins))] += 1
        return counts

    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    return {
        "auc": roc_auc(scores, labels),
        "n_pass": len(pos),
        "n_fail": len(neg),
        "mean_p_yes_pass": sum(pos) / len(pos) if pos else None,
        "mean_p_yes_fail": sum(neg) / len(neg) if neg else None,
        "bin_edges": edges,
        "hist_pass": hist(pos),
        "hist_fail": hist(neg),
        # what a threshold τ would do: the share of right and of wrong answers it passes
        "pass_rate_by_tau": {
            f"{t:g}": {
                "right": sum(s >= t for s in pos) / len(pos) if pos else None,
                "wrong": sum(s >= t for s in neg) / len(neg) if neg else None,
            }
            for t in (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
        },
    }


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, result[k]) for k in ("whole", "line_ends") if result.get(k)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (name, d) in zip(axes[0], panels):
        edges = d["bin_edges"]
        width = edges[1] - edges[0]
        centers = [e + width / 2 for e in edges[:-1]]
        n_pass, n_fail = max(1, d["n_pass"]), max(1, d["n_fail"])
        ax.bar(
            [c - width * 0.2 for c in centers],
            [h / n_pass for h in d["hist_pass"]],
            width * 0.4,
            label=f"answer passes its tests ({d['n_pass']})",
            color="C2",
        )
        ax.bar(
            [c + width * 0.2 for c in centers],
            [h / n_fail for h in d["hist_fail"]],
            width * 0.4,
            label=f"answer fails ({d['n_fail']})",
            color="C3",
        )
        auc = d["auc"]
        title = "whole answers" if name == "whole" else "answers cut at line ends"
        ax.set(
            xlabel="judge's P(Correct)",
            ylabel="share of answers",
            xlim=(0, 1),
            title=f"{title}: ROC AUC {auc:.3f}" if auc is not None else title,
        )
        ax.legend(fontsize=8)
    fig.suptitle(result.get("title", "Does the judge discriminate?"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
