"""Presets (configs/*.yaml): read and checked without vLLM.

`parse-vllm serve --config PRESET` and `parse-vllm flags` (cli.py) turn a preset into
`vllm serve` flags; `parse-vllm eval --config` and scripts/ray_batch.py build their engines
from one. Checking the flags with vLLM's own `serve` parser is cli.py's (`check_with_vllm`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any

# A preset is one YAML mapping with these sections, all optional:
#   model               the target (HF hub name or folder); $PARSE_VLLM_CACHE,
#                       $VARS and ~ are expanded in model paths
#   hardware            what the preset is sized for: device (cuda | cpu),
#                       gpus, gpu_memory_gib, description; checked against
#                       the parallel sizes in `engine`, never sent to vLLM
#   speculative_config  {method: parse, model: DRAFT, num_speculative_tokens: W}
#                       and any other draft-model key of vLLM's (method
#                       draft_model, vLLM's own name, is read too); PARSE
#                       options in it join the `parse` section
#   parse               PARSE options
#   engine              any other `vllm serve` arguments, flat, spelled like
#                       the flags (underscores or dashes), in the format of
#                       vLLM's own `--config` file: true -> --flag,
#                       false -> --no-flag, list -> --flag a b, mapping -> JSON
# `parse-vllm serve --config` takes this format rather than vLLM's flat one:
# a flat vLLM config file is the `engine` section of a preset.

PRESET_SECTIONS = ("model", "hardware", "speculative_config", "parse", "engine")
HARDWARE_KEYS = ("device", "gpus", "gpu_memory_gib", "description")
DEVICES = ("cuda", "cpu")
# vLLM flags a preset says through its own sections, never in `engine`.
_SECTION_OF_FLAG = {
    "--model": "model",
    "--speculative-config": "speculative_config",
    "--additional-config": "parse",
    "--config": "(a preset does not include another file)",
}


class PresetError(SystemExit):
    """A preset or the flags it makes are refused. The message names the file
    and the field. A SystemExit: on the command line it ends the command with
    that message, before any engine starts."""


@dataclass(frozen=True)
class Preset:
    """A validated preset (`load_preset`)."""

    path: str
    model: str | None = None
    hardware: dict[str, Any] | None = None
    speculative_config: dict[str, Any] | None = None
    parse: dict[str, Any] = dataclasses.field(default_factory=dict)
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)

    def flags(self) -> list[str]:
        """The `vllm serve` flags this preset stands for, without the model: with
        method parse, one `--speculative-config` holding the PARSE options; without a
        speculative config (or with vLLM's draft_model), the options in
        `--additional-config`."""
        from parse_vllm.config import PARSE_METHOD

        flags: list[str] = []
        spec = self.speculative_config
        if spec and spec.get("method") == PARSE_METHOD:
            flags += ["--speculative-config", json.dumps({**spec, **self.parse})]
        else:
            if spec:
                flags += ["--speculative-config", json.dumps(spec)]
            flags += ["--additional-config", json.dumps({"parse": self.parse})]
        for key, value in self.engine.items():
            flags += engine_flag(key, value)
        return flags

    def argv(self) -> list[str]:
        """`vllm serve` arguments: the model (if the preset names one), then flags."""
        return ([self.model] if self.model else []) + self.flags()

    def engine_int(self, key: str, default: int = 1) -> int:
        value = self.engine.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PresetError(f"{self.path}: engine.{key}={value!r}: must be an integer >= 1")
        return value


def engine_flag(key: str, value: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        # vLLM's boolean arguments come in --flag / --no-flag pairs.
        return [flag] if value else ["--no-" + key.replace("_", "-")]
    if isinstance(value, list):  # an empty list says nothing, as in vLLM's --config
        return [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)] if value else []
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def load_preset(path: str | os.PathLike) -> Preset:
    """Read and check a preset without vLLM: its sections and keys, the PARSE
    options (ParseConfig), the draft-model speculative config, and that the
    parallel sizes fit the hardware it is for. Raises PresetError, or
    ParseConfigError for a bad `parse` option (both name the field)."""
    import yaml

    from parse_vllm.config import ParseConfig, ParseConfigError, merge_parse_options

    path = str(path)
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise PresetError(f"{path}: cannot read the preset: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise PresetError(f"{path}: not valid YAML: {e}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise PresetError(f"{path}: expected a mapping of sections {list(PRESET_SECTIONS)} at the top level")
    unknown = sorted(map(str, set(raw) - set(PRESET_SECTIONS)))
    if unknown:
        raise PresetError(
            f"{path}: unknown top-level keys {unknown}; a preset has the sections "
            f"{list(PRESET_SECTIONS)} (other `vllm serve` arguments go under `engine:`)"
        )

    model = raw.get("model")
    if model is not None:
        if not isinstance(model, str) or not model.strip():
            raise PresetError(f"{path}: model={model!r}: must be a model name or folder")
        model = _expand_path(model)

    parse = raw.get("parse")
    if parse is None:
        parse = {}
    if not isinstance(parse, dict):
        raise PresetError(f"{path}: parse: must be a mapping of PARSE options, got {parse!r}")
    spec, spec_options = _check_speculative_config(path, raw.get("speculative_config"))
    try:
        parse = merge_parse_options(spec_options, parse, where="the preset's parse section")
        ParseConfig.from_dict(parse)
    except (ParseConfigError, TypeError) as e:
        raise ParseConfigError(f"{path}: {e}") from None

    engine = _check_engine(path, raw.get("engine"))
    hardware = _check_hardware(path, raw.get("hardware"))
    preset = Preset(path=path, model=model, hardware=hardware, speculative_config=spec, parse=parse, engine=engine)
    _check_parallel_fits(preset)
    return preset


def _check_speculative_config(path: str, spec: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The speculative config without PARSE's options, and those options."""
    from parse_vllm.config import PARSE_METHOD, VLLM_METHOD, split_speculative_config

    if spec is None:
        return None, {}
    where = f"{path}: speculative_config"
    if not isinstance(spec, dict):
        raise PresetError(f"{where}: must be a mapping, got {spec!r}")
    spec = dict(spec)
    options: dict[str, Any] = {}
    if spec.get("method") == PARSE_METHOD:
        # Which of the other keys are vLLM's is checked with vLLM (cli.check_with_vllm).
        spec, options = split_speculative_config(spec, given={"model", "num_speculative_tokens"})
    elif spec.get("method") != VLLM_METHOD:
        raise PresetError(
            f"{where}.method={spec.get('method')!r}: use method: {PARSE_METHOD} (PARSE drafts with "
            f"vLLM's draft-model speculation, method {VLLM_METHOD})"
        )
    draft = spec.get("model")
    if not isinstance(draft, str) or not draft.strip():
        raise PresetError(f"{where}.model={draft!r}: must name the draft model (HF hub name or folder)")
    spec["model"] = _expand_path(draft)
    window = spec.get("num_speculative_tokens")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise PresetError(f"{where}.num_speculative_tokens={window!r}: the draft window W, an integer >= 1")
    return spec, options


def _check_engine(path: str, engine: Any) -> dict[str, Any]:
    if engine is None:
        return {}
    if not isinstance(engine, dict):
        raise PresetError(f"{path}: engine: must be a mapping of `vllm serve` arguments, got {engine!r}")
    for key, value in engine.items():
        if not isinstance(key, str) or not re.fullmatch(r"[a-z][a-z0-9_-]*", key):
            raise PresetError(f"{path}: engine: {key!r} is not a `vllm serve` argument name")
        flag = "--" + key.replace("_", "-")
        if flag in _SECTION_OF_FLAG:
            raise PresetError(f"{path}: engine.{key}: say it in the preset's section {_SECTION_OF_FLAG[flag]}")
        if value is None:
            raise PresetError(f"{path}: engine.{key}: no value; give one or leave the key out")
    return dict(engine)


def _check_hardware(path: str, hw: Any) -> dict[str, Any] | None:
    if hw is None:
        return None
    where = f"{path}: hardware"
    if not isinstance(hw, dict):
        raise PresetError(f"{where}: must be a mapping with keys {list(HARDWARE_KEYS)}")
    unknown = sorted(map(str, set(hw) - set(HARDWARE_KEYS)))
    if unknown:
        raise PresetError(f"{where}: unknown keys {unknown}; known: {list(HARDWARE_KEYS)}")
    device = hw.get("device")
    if device not in DEVICES:
        raise PresetError(f"{where}.device={device!r}: must be one of {list(DEVICES)}")
    gpus = hw.get("gpus", 0)
    if device == "cuda" and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise PresetError(f"{where}.gpus={gpus!r}: a cuda preset says how many GPUs it is for (integer >= 1)")
    if device == "cpu" and gpus:
        raise PresetError(f"{where}.gpus={gpus!r}: a cpu preset uses no GPU")
    mem = hw.get("gpu_memory_gib")
    if mem is not None and (device != "cuda" or isinstance(mem, bool) or not isinstance(mem, (int, float)) or mem <= 0):
        raise PresetError(f"{where}.gpu_memory_gib={mem!r}: memory per GPU in GiB, a number > 0 (cuda presets only)")
    desc = hw.get("description")
    if desc is not None and not isinstance(desc, str):
        raise PresetError(f"{where}.description: must be text")
    return dict(hw)


def _check_parallel_fits(preset: Preset) -> None:
    """PARSE refuses pipeline parallelism; tensor x data parallel workers must
    fit the GPUs the preset is for."""

    def size(name: str) -> int:
        for key in (name, name.replace("_", "-")):
            if key in preset.engine:
                return preset.engine_int(key)
        return 1

    if size("pipeline_parallel_size") != 1:
        raise PresetError(f"{preset.path}: engine.pipeline_parallel_size: PARSE refuses pipeline parallelism")
    tp, dp = size("tensor_parallel_size"), size("data_parallel_size")
    hw = preset.hardware
    if hw and hw["device"] == "cuda" and tp * dp > hw["gpus"]:
        raise PresetError(
            f"{preset.path}: engine.tensor_parallel_size={tp} x data_parallel_size={dp} needs "
            f"{tp * dp} GPUs; hardware.gpus={hw['gpus']}"
        )


def _expand_path(path: str) -> str:
    from parse_vllm.cache import default_cache_dir

    path = path.replace("$PARSE_VLLM_CACHE", str(default_cache_dir()))
    return os.path.expandvars(os.path.expanduser(path))
