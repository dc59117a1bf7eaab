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
