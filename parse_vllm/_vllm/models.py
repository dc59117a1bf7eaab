"""The models vLLM loads: the target's tokenizer as vLLM loads it, and the
head-pruned draft architecture registered with vLLM's model registry."""

from __future__ import annotations

import torch


def __getattr__(name: str):
    if name == "ParseDraftLlamaForCausalLM":  # draft_vocab.ARCHITECTURE, loaded by vLLM's registry
        globals()[name] = _draft_model_cls()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def target_tokenizer(vllm_config):
    """The target model's tokenizer, as vLLM itself loads it
    (v1/spec_decode/draft_model.py:41)."""
    from vllm.tokenizers.registry import get_tokenizer

    mc = vllm_config.model_config
    return get_tokenizer(
        mc.tokenizer,
        tokenizer_mode=mc.tokenizer_mode,
        trust_remote_code=mc.trust_remote_code,
        revision=mc.tokenizer_revision,
    )


def draft_tokenizer_name(vllm_config) -> str | None:
    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        return None
    return spec.draft_model_config.tokenizer


def register_draft_architecture() -> None:
    """Make head-pruned drafts (draft_vocab.py) loadable by name from their
    config.json, lazily (model_executor/models/registry.py `register_model`
    with a "module:Class" string), in every process the plugin loads in."""
    from vllm.model_executor.models.registry import ModelRegistry

    from parse_vllm.draft_vocab import ARCHITECTURE

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:{ARCHITECTURE}")


def _draft_model_cls():
    """vLLM's LlamaForCausalLM with a head of `parse_head_vocab_size` rows
    (model_executor/models/llama.py builds a full-vocabulary ParallelLMHead
    and LogitsProcessor in __init__; both are replaced) whose logits come
    back as full-vocabulary rows (draft_vocab.full_vocab_logits)."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.utils import maybe_prefix

    from parse_vllm import draft_vocab

    class ParseDraftLlamaForCausalLM(LlamaForCausalLM):
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
            self.lm_head = ParallelLMHead(
                rows, config.hidden_size, quant_config=vllm_config.quant_config, prefix=maybe_prefix(prefix, "lm_head")
            )
            self.logits_processor = LogitsProcessor(rows, scale=getattr(config, "logit_scale", 1.0))
            # LocalArgmaxMixin.get_top_tokens (interfaces.py) maps head row k
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

    ParseDraftLlamaForCausalLM.__qualname__ = ParseDraftLlamaForCausalLM.__name__
    ParseDraftLlamaForCausalLM.__module__ = __name__
    return ParseDraftLlamaForCausalLM
