"""The models vLLM loads: the target's tokenizer as vLLM loads it, and model
architectures registered with vLLM's model registry."""

from __future__ import annotations


def target_tokenizer(vllm_config):
    """The target model's tokenizer, as vLLM itself loads it
    (vllm.v1.spec_decode.draft_model.DraftModelProposer.__init__)."""
    from vllm.tokenizers.registry import get_tokenizer

    mc = vllm_config.model_config
    return get_tokenizer(
        mc.tokenizer,
        tokenizer_mode=mc.tokenizer_mode,
        trust_remote_code=mc.trust_remote_code,
        revision=mc.tokenizer_revision,
    )


def register_model(architecture: str, class_path: str) -> None:
    """Make `architecture` (a config.json "architectures" entry) loadable as
    the class at `class_path` ("module:Class"), lazily: vLLM imports the
    module only when it loads such a model
    (vllm.model_executor.models.registry.ModelRegistry.register_model with a
    "module:Class" string). Idempotent; the plugin
    calls it in every process it loads in."""
    from vllm.model_executor.models.registry import ModelRegistry

    if architecture not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(architecture, class_path)


def target_shape(vllm_config) -> dict:
    """The target's name, architecture, hidden size, layers and vocabulary
    (vllm.config.model.ModelConfig: hf_config.architectures, get_hidden_size,
    get_num_layers_by_block_type / hf_text_config.num_hidden_layers, get_vocab_size)."""
    mc = vllm_config.model_config
    return {
        "target": str(mc.model),
        "architecture": (getattr(mc.hf_config, "architectures", None) or ["?"])[0],
        "hidden_size": mc.get_hidden_size(),
        "num_layers": mc.hf_text_config.num_hidden_layers,
        "vocab_size": mc.get_vocab_size(),
    }


def lm_head_columns(model, token_ids, dims: int):
    """[len(token_ids), dims] float32 on the host: the first `dims` columns of the target's
    LM-head rows of `token_ids`, read through the model's own compute_logits (vocab-parallel
    heads are gathered there; a tied head is the embedding) on unit vectors."""
    import torch

    first = next(model.parameters())
    size = _hidden_size(model)
    eye = torch.eye(dims, size, dtype=first.dtype, device=first.device)
    logits = model.compute_logits(eye)  # [dims, vocab]
    return logits[:, list(token_ids)].T.float().cpu().numpy()


def _hidden_size(model) -> int:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return int(config.hidden_size)
