"""What the benchmarks share, and ``parse-vllm eval`` with them: models, engine arguments, the
results folder and summary.json, tables and figures, ROUGE-L and the drift limit."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

#: Keys of bench/results/summary.json (null where a run did not measure them).
SUMMARY_KEYS = (
    "verify_over_floor_N256_K8",
    "verify_token_bound_N256_K8",
    "sequential_over_parallel_N256_K8",
    "accept_all_fraction_of_ideal",
    "reject_all_over_ideal_overhead",
    "e2e_speedup_bs1",
    "e2e_speedup_bs16",
    "draft_token_acceptance_rate",
    "draft_mean_acceptance_length",
)


#: |target-again / target - 1| above this: the machine was not quiet (the run's ratios are suspect)
DRIFT_LIMIT = 0.10


def rouge_l(a: list[int], b: list[int]) -> float:
    """ROUGE-L F1 of two token sequences (longest common subsequence)."""
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def setup_env() -> dict[str, Any]:
    """The lab tools' environment, set before vLLM starts an engine; returns the engine mode
    (`cpu_engine_setup`)."""
    # The probes are callables sent to the workers (collective_rpc), which vLLM
    # only unpickles when this is set.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return cpu_engine_setup()


def cpu_engine_setup(world_size: int = 1) -> dict[str, Any]:
    """How the lab tools run an engine here. On vLLM's CPU platform: in one process, so the
    model gets every core (`_vllm.cpu_engine_in_one_process`; README "CPU"), and float32
    weights (this project's CPUs have no native bf16). Elsewhere: vLLM's defaults, bf16.
    Every report states the mode (`machine()["engine_mode"]`): compare figures within one."""
    from parse_vllm import _vllm

    on_cpu = _vllm.builtin_platform_qualname() == "vllm.platforms.cpu.CpuPlatform"
    one = _vllm.cpu_engine_in_one_process(world_size) if on_cpu else False
    if not on_cpu:
        description = "GPU, vLLM's default processes"
    elif one:
        description = "CPU, engine in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the model on every core)"
    else:
        description = "CPU, vLLM's default processes (the worker on the cores the engine core leaves it)"
    return {
        "device": "cpu" if on_cpu else "gpu",
        "in_one_process": one,
        "dtype": "float32" if on_cpu else "bfloat16",
        "description": description,
    }


def resolve_models(target: Path | None, draft: Path | None) -> tuple[Path, Path]:
    """The given pair, else the CPU pair: SmolLM2-135M-Instruct and its shipped trained draft."""
    from parse_vllm.tools.prepare_models import DEMO_TARGET_NAME, prepare_demo_draft, prepare_models

    if target is None:
        target = prepare_models(names=(DEMO_TARGET_NAME,), progress=False)[DEMO_TARGET_NAME]
    if draft is None:
        draft = prepare_demo_draft(progress=False)
    return target, draft


def engine_kwargs(target: Path, *, max_model_len: int, max_num_seqs: int = 16, **extra) -> dict:
    kw = dict(
        model=str(target),
        dtype="bfloat16",
        enforce_eager=True,
        block_size=32,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_bytes=2 << 30,
        seed=0,
    )
    kw.update(extra)
    return kw


def parse_engine(target: Path, draft: Path, window: int, parse: dict, **kw) -> dict:
    return engine_kwargs(
        target,
        speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": window},
        additional_config={"parse": parse},
        **kw,
    )


def machine_identity() -> dict[str, Any]:
    """What a run's times belong to: the CPU, its cores and memory, and this boot of the
    machine (Linux's ``boot_id``, new at every boot and on every fresh VM of the same kind)."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    boot_id = Path("/proc/sys/kernel/random/boot_id")
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
        "boot": boot_id.read_text().strip() if boot_id.is_file() else platform.node(),
    }


def machine() -> dict[str, Any]:
    import torch

    from parse_vllm._vllm import VLLM_VERSION

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **machine_identity(),
        "torch": torch.__version__,
        "vllm": VLLM_VERSION,
        "torch_threads": torch.get_num_threads(),
        # vLLM's CPU worker pins its compute threads (one core here unless told otherwise)
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        # the engine mode every figure of the report was measured in (cpu_engine_setup)
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
        "engine_mode": "in one process"
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        else "multiprocessing",
    }


def engine_mode(machine: dict) -> str:
    """The engine mode a run was measured in (runs before it was recorded used vLLM's default)."""
    if machine.get("engine_mode") == "in one process":
        return "CPU engine in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the model on every core)"
    return "vLLM's default processes (VLLM_ENABLE_V1_MULTIPROCESSING=1: on 2 cores the model gets one)"


def update_summary(results_dir: Path, values: dict[str, Any]) -> Path:
    """Merge ``values`` into summary.json (every key present, null if never measured)."""
    path = results_dir / "summary.json"
    summary = {k: None for k in SUMMARY_KEYS}
    if path.exists():
        summary.update(json.loads(path.read_text()))
    summary.update(values)
    results_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return path


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Markdown table; cols = (key, header, format)."""
    head = "| " + " | ".join(h for _, h, _ in cols) + " |"
    sep = "|" + "|".join("---:" for _ in cols) + "|"
    body = []
    for r in rows:
        cells = []
        for key, _, fmt in cols:
            v = r.get(key)
            cells.append("—" if v is None else (format(v, fmt) if fmt else str(v)))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])


def two_panels():
    """A figure with two side-by-side axes (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, 2, figsize=(11, 4))


def save_panels(fig, axes, path: Path) -> None:
    """Legends, grids, tight layout, PNG at ``path``; closes the figure."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
