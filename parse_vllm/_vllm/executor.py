"""vLLM's Ray executor made to run on CPU workers."""

from __future__ import annotations


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

    The workers themselves are vLLM's (WorkerProc building
    parallel_config.worker_cls, the PARSE CPU worker), and load the plugin
    through its entry points like any vLLM process."""
    import ray
    import vllm.v1.executor.ray_executor_v2 as rx
    from vllm.platforms import current_platform

    class CpuRayWorkerProc(rx.RayWorkerProc):
        def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
            return ray.get_runtime_context().get_node_id(), []

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
