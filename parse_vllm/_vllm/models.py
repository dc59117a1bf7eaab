"""The models vLLM loads: the target's tokenizer as vLLM loads it, and model
architectures registered with vLLM's model registry."""

from __future__ import annotations

import functools


def target_tokenizer(vllm_config):
    """The target model's tokenizer, as vLLM itself loads it
    (vllm.v1.spec_decode.draft_model.DraftModelProposer.__init__), loaded once per process
    for the same files: the start-up checks and the worker (the same process on a CPU) each
    read it, and a load takes 0.5-1 s (SmolLM2's, on this CPU). The key holds the tokenizer
    files' sizes and times, so a folder written again is loaded again."""
    mc = vllm_config.model_config
    key = (str(mc.tokenizer), mc.tokenizer_mode, mc.trust_remote_code, mc.tokenizer_revision)
    return _tokenizer(key, _files_stamp(str(mc.tokenizer)))


def _files_stamp(folder: str) -> tuple:
    """(name, size, mtime) of a local tokenizer folder's files; () for a hub name."""
    import os

    if not os.path.isdir(folder):
        return ()
    return tuple(
        sorted(
            (e.name, e.stat().st_size, e.stat().st_mtime_ns)
            for e in os.scandir(folder)
            if e.is_file() and e.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "added_tokens"))
        )
    )


def same_tokenizer_files(a: str, b: str) -> bool:
    """Whether two local model folders hold byte-identical tokenizer files (the same names,
    the same bytes): then their tokenizers are one, without loading either."""
    from pathlib import Path

    names = [x[0] for x in _files_stamp(a)]
    if not names or names != [x[0] for x in _files_stamp(b)]:
        return False
    return all((Path(a) / n).read_bytes() == (Path(b) / n).read_bytes() for n in names)


@functools.lru_cache(maxsize=4)
def _tokenizer(key: tuple, stamp: tuple):
    from vllm.tokenizers.registry import get_tokenizer

    name, mode, trust_remote_code, revision = key
    return get_tokenizer(name, tokenizer_mode=mode, trust_remote_code=trust_remote_code, revision=revision)


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
