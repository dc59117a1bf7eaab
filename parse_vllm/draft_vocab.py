"""A draft whose output head covers only the tokens its target actually says.

SmolLM2's tied 49152 x 576 head costs 28 M multiply-adds per token, more than
a 135M model's eight layers. A draft that keeps the whole head spends most of
its budget there; one that keeps only the few thousand tokens the target's
answers use (the top 8192 cover 99.5% of them; FR-Spec and EAGLE-3 prune the
same way) can afford three times the layers for the same cost.

The draft still speaks the target's vocabulary to vLLM: its logits are the
head rows' logits scattered into a full-vocabulary row, -inf elsewhere, so
vLLM's `draft_model` proposer, its argmax and its probabilistic drafting need
no change. The head's rows are the target's embedding rows (tied, shared,
never trained); the draft ships only which token ids they are.

The vLLM model class (``ParseDraftLlamaForCausalLM``) lives in
``draft_model.py``, over vLLM's Llama obtained through ``parse_vllm._vllm``;
this module is its math and imports no vLLM.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

#: config.json architecture of a head-pruned draft (registered by the plugin)
ARCHITECTURE = "ParseDraftLlamaForCausalLM"
#: config.json key: number of head rows
HEAD_VOCAB_KEY = "parse_head_vocab_size"
#: weights-file key: the head rows' token ids, int64, ascending
HEAD_IDS_KEY = "lm_head.token_ids"


def choose_head_tokens(counts: Counter, size: int, vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent token ids in ``counts`` (ties by lower id),
    with every id in ``always`` (EOS, chat-turn tokens) included; ascending.
    Deterministic for the same counts."""
    always = sorted({int(t) for t in always})
    if size <= len(always) or size > vocab_size:
        raise ValueError(f"head size {size} must be in ({len(always)}, {vocab_size}]")
    for t in always:
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} is outside the vocabulary of {vocab_size}")
    chosen = set(always)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    # Tokens never seen fill any remaining rows, lowest ids first, so the size is exact.
    for tok in [t for t, _ in ranked] + list(range(vocab_size)):
        if len(chosen) == size:
            break
        chosen.add(int(tok))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def head_coverage(counts: Counter, token_ids: torch.Tensor) -> float:
    """Fraction of the counted tokens that the head can say."""
    ids = set(token_ids.tolist())
    total = sum(counts.values())
    return sum(v for t, v in counts.items() if t in ids) / max(total, 1)


def to_head_index(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] map from target id to head row, -1 for ids the head lacks."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[token_ids] = torch.arange(token_ids.numel())
    return index


def full_vocab_logits(head_logits: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[T, n] head logits -> [T, vocab_size] logits, -inf where the head has
    no row (so argmax, softmax and sampling never pick those ids)."""
    full = head_logits.new_full((head_logits.shape[0], vocab_size), float("-inf"))
    return full.index_copy_(1, token_ids.to(head_logits.device), head_logits)
