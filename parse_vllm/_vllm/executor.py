"""vLLM's Ray executor made to run on CPU workers."""

from __future__ import annotations

import os


def cpu_ray_executor_cls():
    """vLLM's Ray executor (vllm.v1.executor.ray_executor_v2.RayExecutorV2, the
    default `ray` backend of 0.32, VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1) adapted
    to CPU workers. What it assumes of GPUs, and what replaces it:

    - vllm.v1.executor.ray_utils.initialize_ray_cluster and
      vllm.v1.executor.ray_utils.get_bundles_sorted_by_node read
      `current_platform.ray_device_key` for
      the placement-group bundles: "CPU" while the executor starts (the
      engine-core process only), so each worker's bundle reserves one CPU.
    - RayExecutorV2._get_actor_resource_kwargs asks for
      `resources={ray_device_key: n}`, which Ray refuses for "CPU": the actor
      asks for nothing itself (num_cpus=0, as vLLM sets) and runs in its
      bundle.
    - vllm.v1.executor.ray_executor_v2.RayWorkerProc.get_node_and_physical_gpu_ids
      reads Ray's accelerator ids, which have no "CPU": the CPU actor answers
      its node and no devices. RayExecutorV2._init_executor builds actors
      from the module global `vllm.v1.executor.ray_executor_v2.RayWorkerProc`,
      swapped for the CPU one during start-up.
    - vllm.v1.executor.multiproc_executor.MultiprocExecutor gives each CPU
      worker process its OpenMP threads before it starts
      (vllm.utils.ompmultiprocessing.OMPProcessManager, from
      VLLM_CPU_OMP_THREADS_BIND); the Ray actors get nothing, so torch ran as
      many threads as the node has cores, spinning against the engine core
      for the same cores (on 2 cores: 64 tokens/s instead of ~450). The CPU
      actor sets its threads before the worker starts: `cpu_worker_threads`.

    The workers themselves are vLLM's (WorkerProc building
    parallel_config.worker_cls, the PARSE CPU worker), and load the plugin
    through its entry points like any vLLM process."""
    import ray
    import vllm.v1.executor.ray_executor_v2 as rx
    from vllm.platforms import current_platform

    from .log import init_logger

    class CpuRayWorkerProc(rx.RayWorkerProc):
        def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
            return ray.get_runtime_context().get_node_id(), []

        def initialize_worker(
            self, local_rank: int, env_vars: dict, distributed_init_method: str, driver_env_vars=None, **kwargs
        ):
            # Before the worker starts: vLLM's CPU worker disables
            # torch.set_num_threads in init_device.
            env = {**(driver_env_vars or {}), **os.environ, **env_vars}
            threads, cores = cpu_worker_threads(local_rank, env, self._parallel_config)
            init_logger("parse_vllm.executor").info(
                "PARSE CPU Ray worker (local rank %d): %d OpenMP thread(s), cores %s",
                local_rank,
                threads,
                "not pinned" if cores is None else cores,
            )
            return super().initialize_worker(local_rank, env_vars, distributed_init_method, driver_env_vars, **kwargs)

    class CpuRayExecutor(rx.RayExecutorV2):
        @staticmethod
        def _get_actor_resource_kwargs() -> dict:
            return {"num_gpus": 0}

        def _init_executor(self) -> None:
            saved_proc = rx.RayWorkerProc
            had_key = "ray_device_key" in vars(current_platform)
            rx.RayWorkerProc = CpuRayWorkerProc
            current_platform.ray_device_key = "CPU"
            try:
                super()._init_executor()
            finally:
                rx.RayWorkerProc = saved_proc
                if not had_key:
                    del current_platform.ray_device_key

    return CpuRayExecutor, CpuRayWorkerProc


def cpu_worker_threads(local_rank: int, env: dict, parallel_config) -> tuple[int, list[int] | None]:
    """OpenMP threads (and cores) of a CPU worker in a Ray actor, set in the
    actor before its worker starts; `env` is what the worker will see
    (driver variables under node-local ones). VLLM_CPU_OMP_THREADS_BIND as
    vLLM reads it for its own CPU workers:

    - a list ("0-3|4-7", one entry per worker on the node, by local rank):
      the worker is pinned to its entry's cores, one thread per core;
    - "nobind": nothing pinned; OMP_NUM_THREADS threads if set, else torch's
      default (all cores);
    - "auto" (the default): one thread per CPU that the worker's Ray
      placement-group bundle reserves ({"CPU": 1} in the bundles vLLM makes;
      give the engine a placement group with larger CPU bundles for more),
      nothing pinned.

    Returns (threads, pinned cores or None)."""
    import torch

    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    cores = None
    if bind == "nobind":
        threads = int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS", "").isdigit() else None
    elif bind == "auto":
        threads = _bundle_cpus(local_rank, parallel_config)
    else:
        from vllm.utils.cpu_resource_utils import parse_id_list

        lists = bind.split("|")
        if local_rank >= len(lists):
            raise RuntimeError(
                f"VLLM_CPU_OMP_THREADS_BIND={bind!r} names {len(lists)} core list(s); "
                f"the Ray worker of local rank {local_rank} on this node has none"
            )
        cores = parse_id_list(lists[local_rank])
        threads = len(cores)
        for tid in os.listdir("/proc/self/task"):  # every thread, those OpenMP made already too
            os.sched_setaffinity(int(tid), cores)
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads(), cores


def _bundle_cpus(local_rank: int, parallel_config) -> int:
    """CPUs of the placement-group bundle of the worker with this local rank:
    vLLM gives a node's workers its CPU bundles in index order
    (vllm.v1.executor.ray_utils.get_bundles_sorted_by_node); 1 where that
    cannot be read (VLLM_RAY_BUNDLE_INDICES, no placement group)."""
    import ray

    pg = getattr(parallel_config, "placement_group", None)
    if pg is None or os.environ.get("VLLM_RAY_BUNDLE_INDICES"):
        return 1
    table = ray.util.placement_group_table(pg)
    node = ray.get_runtime_context().get_node_id()
    mine = sorted(
        int(i)
        for i, n in table.get("bundles_to_node_id", {}).items()
        if n == node and table["bundles"][i].get("CPU", 0) > 0
    )
    if local_rank >= len(mine):
        return 1
    return max(1, int(table["bundles"][mine[local_rank]]["CPU"]))
