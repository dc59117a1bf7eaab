"""The vLLM model class of head-pruned drafts (draft_vocab.py holds their math).

Registered with vLLM's model registry by the plugin in every vLLM process
(plugin.DRAFT_MODEL_CLS), and imported by vLLM only when it loads such a draft:
its vLLM base classes come through `parse_vllm._vllm`."""

from __future__ import annotations

import torch

from parse_vllm import _vllm, draft_vocab


class ParseDraftLlamaForCausalLM(_vllm.LlamaForCausalLM):
    """vLLM's LlamaForCausalLM with a head of `parse_head_vocab_size` rows
    (vllm.model_executor.models.llama.LlamaForCausalLM builds a
    full-vocabulary ParallelLMHead and LogitsProcessor in __init__; both are
    replaced) whose logits come back as full-vocabulary rows
    (draft_vocab.full_vocab_logits)."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        config = vllm_config.model_config.hf_config
        rows = getattr(config, draft_vocab.HEAD_VOCAB_KEY, None)
        if not isinstance(rows, int) or not 0 < rows <= config.vocab_size:
            raise ValueError(
                f"{draft_vocab.ARCHITECTURE} needs config.{draft_vocab.HEAD_VOCAB_KEY} "
                f"in (0, {config.vocab_size}], got {rows!r}"
            )
        self.full_vocab_size = config.vocab_size
        self.lm_head = _vllm.ParallelLMHead(
            rows,
            config.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=_vllm.maybe_prefix(prefix, "lm_head"),
        )
        self.logits_processor = _vllm.LogitsProcessor(rows, scale=getattr(config, "logit_scale", 1.0))
        # vllm.model_executor.models.interfaces.LocalArgmaxMixin.get_top_tokens maps head row k
        # to target id k + draft_id_to_target_id[k]; filled at load.
        self.draft_id_to_target_id = torch.nn.Parameter(torch.zeros(rows, dtype=torch.long), requires_grad=False)
        self.register_buffer("head_token_ids", torch.arange(rows), persistent=False)  # [rows]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        head = self.logits_processor(self.lm_head, hidden_states)  # [T, rows]
        if head is None:
            return None
        return draft_vocab.full_vocab_logits(head, self.head_token_ids, self.full_vocab_size)

    def load_weights(self, weights):
        found = []

        def model_weights():
            for name, tensor in weights:
                if name == draft_vocab.HEAD_IDS_KEY:
                    found.append(tensor)
                else:
                    yield name, tensor

        loaded = set(super().load_weights(model_weights()))
        if len(found) != 1 or found[0].shape != self.head_token_ids.shape:
            raise ValueError(
                f"{draft_vocab.ARCHITECTURE}: the weights need one {draft_vocab.HEAD_IDS_KEY} "
                f"tensor of shape {tuple(self.head_token_ids.shape)}"
            )
        ids = found[0].to(torch.long)
        if ids.min() < 0 or ids.max() >= self.full_vocab_size or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"{draft_vocab.HEAD_IDS_KEY} must be ascending ids in [0, {self.full_vocab_size})")
        self.head_token_ids.copy_(ids)
        self.draft_id_to_target_id.data.copy_(ids - torch.arange(ids.numel()))
        return loaded | {"draft_id_to_target_id"}
