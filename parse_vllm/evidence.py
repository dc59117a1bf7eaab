"""Cheap evidence beside the hidden state: what the target's logits over a window's draft say
about the judged prefix, read from the forward that token-level checking already runs.

Per draft token j (the target's distribution at the position that predicts it, the logits
the step already holds, `step.DraftBatch.logits`):

    logprob[j]  = log softmax(logits[j])[draft[j]]       (floored at LOGPROB_FLOOR)
    mismatch[j] = 1.0 if argmax(logits[j]) != draft[j]   (the target's greedy token differs)

and per judged prefix draft[:b] (b >= 1), the features a judge head may read beside h
(`EVIDENCE_FEATURES`, in this order):

    draft_logprob_mean    mean(logprob[:b])
    draft_logprob_min     min(logprob[:b])
    draft_logprob_last16  mean(logprob[max(0, b - 16):b])
    greedy_mismatch       mean(mismatch[:b])

The prefix is the window's: the draft tokens the step judges, from the window's first token
to the boundary (what the runtime has logits for). The training data (tools/judge/data.py)
cuts an answer into consecutive windows of W tokens, so there a boundary at absolute length
B reads the tokens from `window_start(B, W)` to B. The per-token values are computed on the
device (`token_evidence`); the prefix features on the host (`prefix_features`), by the same
function in training and at run time.
"""

from __future__ import annotations

import numpy as np
import torch

EVIDENCE_FEATURES = ("draft_logprob_mean", "draft_logprob_min", "draft_logprob_last16", "greedy_mismatch")
LAST = 16  # draft_logprob_last16 averages the last LAST tokens of the prefix
LOGPROB_FLOOR = -100.0  # a token the constraints forbid (logit -inf) counts as this
ROWS_PER_CHUNK = 256  # logits rows turned to float32 at once
# The per-token values travel in the step's one read of its inputs beside int64 values that
# float64 cannot hold (step.NO_LIMIT), so as int64 fixed point: 2**-24 resolution.
FIXED_SCALE = float(1 << 24)


def to_fixed(values: torch.Tensor) -> torch.Tensor:
    """float values -> int64 fixed point (on the device, no read-back)."""
    return torch.round(values.double() * FIXED_SCALE).long()


def from_fixed(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float64) / FIXED_SCALE


def token_evidence(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] (any float dtype), tokens [n] -> [2, n] float32 on the same device:
    row 0 the tokens' log-probabilities (floored), row 1 1.0 where the argmax is another
    token. No read-back; float32 a chunk of rows at a time."""
    n = int(tokens.shape[0])
    out = torch.empty((2, n), dtype=torch.float32, device=logits.device)
    for i in range(0, n, ROWS_PER_CHUNK):
        rows = logits[i : i + ROWS_PER_CHUNK].float()
        tok = tokens[i : i + ROWS_PER_CHUNK].long()
        lp = rows.gather(1, tok[:, None])[:, 0] - torch.logsumexp(rows, dim=-1)
        out[0, i : i + ROWS_PER_CHUNK] = torch.nan_to_num(lp, nan=LOGPROB_FLOOR).clamp(min=LOGPROB_FLOOR)
        out[1, i : i + ROWS_PER_CHUNK] = (rows.argmax(dim=-1) != tok).float()
    return out


def prefix_features(logprob: np.ndarray, mismatch: np.ndarray, lengths) -> np.ndarray:
    """[len(lengths), 4] float64: the EVIDENCE_FEATURES of each prefix logprob[:b] (b in
    `lengths`, 1 <= b <= len(logprob)); a prefix of 0 tokens gets zeros."""
    lp = np.maximum(np.asarray(logprob, dtype=np.float64), LOGPROB_FLOOR)
    mm = np.asarray(mismatch, dtype=np.float64)
    b = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if b.size and (b.min() < 0 or b.max() > lp.shape[0]):
        raise ValueError(f"prefix lengths {b.tolist()} outside 0..{lp.shape[0]}")
    cs = np.concatenate([[0.0], np.cumsum(lp)])
    cm = np.concatenate([[0.0], np.cumsum(mm)])
    running_min = np.minimum.accumulate(lp) if lp.size else lp
    out = np.zeros((b.shape[0], len(EVIDENCE_FEATURES)), dtype=np.float64)
    nz = b > 0
    bb = b[nz]
    lo = np.maximum(bb - LAST, 0)
    out[nz, 0] = cs[bb] / bb
    out[nz, 1] = running_min[bb - 1]
    out[nz, 2] = (cs[bb] - cs[lo]) / (bb - lo)
    out[nz, 3] = cm[bb] / bb
    return out


def window_start(prefix_len: int, window: int) -> int:
    """Where the W-token window that a boundary at absolute length `prefix_len` (>= 1) ends in
    starts, as the training data cuts answers (consecutive windows from the answer's start)."""
    return ((int(prefix_len) - 1) // int(window)) * int(window) if prefix_len > 0 else 0
