"""Workers that build the PARSE model runner, and answer the PARSE RPCs
(`LLM.collective_rpc("parse_stats")`, see parse_vllm.get_stats; on a server
started with VLLM_SERVER_DEV_MODE=1, `POST /collective_rpc {"method": ...}`):

  parse_stats, parse_judgments, parse_reset_stats   PARSE counters
  parse_step_costs    on_reject adaptive: the window policy's step costs
  parse_request_stats  per request: drafts judged, tokens taken semantically / token-level
  parse_kv_blocks, parse_reset_kv_audit   the worker's view of the KV blocks
                    (leak checks; high-water marks with audit_kv_blocks)
  parse_scratch_ids   the scratch KV block ids this rank holds back (with
                    tensor parallelism every rank must hold back the same)
  parse_step_audit    per engine step, the most copies between host and
                    device and drafter calls since the last call (which resets them)"""

from __future__ import annotations

import os

from parse_vllm import _vllm


class _StatsRPC:
    @property
    def _parse(self):
        """The runner's ParseController; None without PARSE."""
        return getattr(self.model_runner, "parse", None)

    def parse_stats(self) -> dict:
        return {} if self._parse is None else self._parse.stats.as_dict()

    def parse_judgments(self) -> list[dict]:
        return [] if self._parse is None else list(self._parse.judgments)

    def parse_request_stats(self) -> dict:
        return {} if self._parse is None else self._parse.request_stats()

    def parse_step_costs(self) -> dict | None:
        policy = getattr(self._parse, "policy", None)
        return None if policy is None else policy.costs.as_dict()

    def parse_reset_stats(self) -> None:
        if self._parse is not None:
            self._parse.reset_stats()

    def parse_kv_blocks(self) -> dict:
        """The worker's side of KV-block accounting, for leak checks
        (scripts/load_test.py): how many blocks the cache has and how many
        are held back as PARSE scratch (the scheduler hands out only the
        rest), which blocks the requests now in the batch hold, whether any
        of those is a scratch block (never allowed), and how many requests
        the runner still keeps state for (0 once the server is idle)."""
        import dataclasses

        runner = self.model_runner
        verifier = getattr(self._parse, "verifier", None)
        num_blocks = int(getattr(verifier, "num_blocks", 0)) or None
        batch_requests, held, scratch = runner.parse_kv_block_use()
        audit = getattr(self._parse, "kv_audit", None)
        return {
            "pid": os.getpid(),
            "num_blocks": num_blocks,
            "scratch_blocks": int(scratch.shape[0]),
            "scheduler_blocks": None if num_blocks is None else num_blocks - int(scratch.shape[0]),
            "batch_requests": batch_requests,
            "runner_requests": len(runner.requests),
            "parse_request_states": 0 if self._parse is None else len(self._parse.states),
            "request_blocks_held": len(held),
            "scratch_blocks_in_request_tables": len(held.intersection(scratch.tolist())),
            # High-water marks since the last parse_reset_kv_audit (parse
            # option audit_kv_blocks; None when it is off).
            "audit": None if audit is None else dataclasses.asdict(audit),
        }

    def parse_scratch_ids(self) -> list[int]:
        return [] if self._parse is None else [int(x) for x in self._parse.scratch_ids()]

    def parse_step_audit(self) -> dict:
        import dataclasses

        if self._parse is None:
            return {}
        return dataclasses.asdict(self._parse.host.take_audit())

    def parse_reset_kv_audit(self) -> None:
        from parse_vllm.metrics import KvAudit

        if self._parse is not None and self._parse.kv_audit is not None:
            self._parse.kv_audit = KvAudit()


def _cpu_worker():
    class ParseCPUWorker(_StatsRPC, _vllm.cpu_worker_cls()):
        def init_device(self):
            from parse_vllm.runner import ParseCPUModelRunner

            with _vllm.cpu_worker_builds_runner(ParseCPUModelRunner):
                super().init_device()

    return ParseCPUWorker


def _gpu_worker():
    class ParseGPUWorker(_StatsRPC, _vllm.gpu_worker_cls()):
        def _make_model_runner(self):
            if self.use_v2_model_runner:
                raise RuntimeError(
                    "PARSE runs on vLLM's model runner V1, but this engine chose V2 (the plugin sets "
                    "VLLM_USE_V2_MODEL_RUNNER=0 when PARSE is named, so something overrode it after the "
                    "config was built, or vLLM chose V2 for a feature PARSE does not support)"
                )
            from parse_vllm.runner import ParseGPUModelRunner

            return ParseGPUModelRunner(self.vllm_config, self.device)

    return ParseGPUWorker


def _cpu_ray_classes():
    # vLLM's Ray executor on CPU, for PARSE engines named with
    # distributed_executor_backend="ray" (chosen by the PARSE CPU platform;
    # see _vllm.cpu_ray_executor_cls).
    executor, proc = _vllm.cpu_ray_executor_cls()
    return {"ParseCpuRayExecutor": executor, "ParseCpuRayWorkerProc": proc}


# Each class is built on first use, by the platform that names it: its vLLM
# base is platform-specific, and importing it has effects on the whole process
# (vllm.v1.worker.cpu_worker imports vllm.v1.worker.cpu.shm, which replaces
# torch.cuda.Event, torch.cuda.Stream, Tensor.pin_memory and more with CPU
# stand-ins). Module-level names, so the config and the Ray actors can refer
# to them by class path.
_BUILDERS = {
    "ParseCPUWorker": lambda: {"ParseCPUWorker": _cpu_worker()},
    "ParseGPUWorker": lambda: {"ParseGPUWorker": _gpu_worker()},
    "ParseCpuRayExecutor": _cpu_ray_classes,
    "ParseCpuRayWorkerProc": _cpu_ray_classes,
}


def __getattr__(name):
    build = _BUILDERS.get(name)
    if build is None:
        raise AttributeError(name)
    for cls_name, cls in build().items():
        cls.__name__ = cls.__qualname__ = cls_name
        cls.__module__ = __name__
        globals()[cls_name] = cls
    return globals()[name]
