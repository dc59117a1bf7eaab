"""Text-quality figures of one configuration's outputs (token ids), without vLLM.

* ``repeat_3gram`` -- the share of an output's token 3-grams that already occurred earlier in
  the same output (0 = no repetition; a loop drives it towards 1), pooled over outputs;
* ``rouge_l`` -- ROUGE-L F1 against the target-alone output
  (:func:`parse_vllm.tools.benchmarks.common.rouge_l`), averaged over prompts;
* ``nll_per_token`` -- how likely the target finds the text: the target's negative
  log-likelihood of the output tokens given the prompt (one prompt-logprobs pass over
  prompt + output), summed over outputs and divided by their tokens.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from parse_vllm.tools.benchmarks.common import rouge_l


def repeated_3grams(ids: Sequence[int]) -> tuple[int, int]:
    """(3-grams seen before in this output, all 3-grams)."""
    seen: set[tuple[int, ...]] = set()
    repeats = total = 0
    for i in range(len(ids) - 2):
        g = tuple(ids[i : i + 3])
        total += 1
        if g in seen:
            repeats += 1
        seen.add(g)
    return repeats, total


def repeat_3gram(outputs: Sequence[Sequence[int]]) -> float | None:
    pairs = [repeated_3grams(o) for o in outputs]
    total = sum(t for _, t in pairs)
    return sum(r for r, _ in pairs) / total if total else None


def mean_rouge_l(outputs: Sequence[Sequence[int]], refs: Sequence[Sequence[int]]) -> float:
    return statistics.mean(rouge_l(list(o), list(r)) for o, r in zip(outputs, refs, strict=True))


def output_logprobs(prompt_logprobs: Sequence[Any], ids: Sequence[int], n_prompt: int) -> list[float]:
    """The log-probabilities of ``ids[n_prompt:]`` from vLLM's ``prompt_logprobs`` of the
    sequence ``ids`` (position i: a mapping token id -> Logprob or float, None at 0)."""
    if len(prompt_logprobs) != len(ids):
        raise ValueError(f"prompt_logprobs has {len(prompt_logprobs)} positions for {len(ids)} tokens")
    out = []
    for i in range(n_prompt, len(ids)):
        entry = prompt_logprobs[i]
        if entry is None or ids[i] not in entry:
            raise ValueError(f"no log-probability for token {ids[i]} at position {i}")
        lp = entry[ids[i]]
        out.append(float(getattr(lp, "logprob", lp)))
    return out


def nll_per_token(per_output: Sequence[Sequence[float]]) -> float | None:
    """Pooled mean negative log-likelihood of the output tokens (None without tokens)."""
    total = sum(len(lps) for lps in per_output)
    if not total:
        return None
    value = -sum(sum(lps) for lps in per_output) / total
    return value if math.isfinite(value) else float("inf")
