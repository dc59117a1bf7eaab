"""Who writes each request's draft in a step.

The draft model writes every window (the drafts the judge reads). The token-level drafts
(`spec_tokens` tokens: after a rejection, between redraft rounds, for PARSE-off requests and
for τ > 1) are the draft model's too, unless `parse.token_proposer` names a second proposer
(EAGLE-3, n-gram): then that one writes them all and the draft model only windows. EAGLE-3
keeps KV of every token, so it runs every step; the n-gram proposer keeps nothing and runs
only in steps where some row wants its drafts.

Pure: plain arrays in, the plan and merged drafts out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DRAFT_MODEL = "draft_model"  # the writer's name in the counters (ParseStats.token_level_*)


@dataclass
class ProposerPlan:
    """Per batch row, [B] each."""

    wants: np.ndarray  # draft tokens the row's phase asks for
    draft_model_wants: np.ndarray  # draft tokens the draft model writes (0: none)
    token_level: np.ndarray  # bool: the row's draft comes from the token proposer
    run_token_proposer: bool  # the token proposer runs this step


def plan(wants: np.ndarray, judging: np.ndarray, token_proposer: str | None, keeps_kv: bool) -> ProposerPlan:
    """`wants` [B]: draft tokens each row's phase asks for; `judging` [B]: the row drafts a
    window the judge reads; `token_proposer`: its method, or None."""
    if token_proposer is None:
        return ProposerPlan(wants, wants, np.zeros(wants.shape[0], dtype=bool), False)
    token_level = (wants > 0) & ~judging
    return ProposerPlan(wants, np.where(token_level, 0, wants), token_level, bool(keeps_kv or token_level.any()))


def merge(
    drafts: torch.Tensor,  # [B, d] the draft model's, on the device
    proposed: torch.Tensor,  # [B, k] the token proposer's
    token_level: np.ndarray,  # [B] bool
    to_device,  # host arrays -> device (the step's staged copies)
) -> torch.Tensor:
    """[B, max(d, k)]: each token-level row's draft from the token proposer, the others'
    from the draft model (0 past each row's length)."""
    if not token_level.any():
        return drafts
    width = max(drafts.shape[1], proposed.shape[1])
    merged = torch.zeros((drafts.shape[0], width), dtype=torch.int64, device=drafts.device)
    merged[:, : drafts.shape[1]] = drafts
    (rows,) = to_device(np.flatnonzero(token_level))
    merged[rows, : proposed.shape[1]] = proposed[rows].to(torch.int64)
    return merged


def writer(token_proposer: str | None) -> str:
    """Who writes the token-level drafts (verified token by token, not judged)."""
    return token_proposer or DRAFT_MODEL
