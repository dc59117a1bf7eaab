"""Workers that build the PARSE model runner, and answer `parse_stats` RPCs
(`LLM.collective_rpc("parse_stats")`, see parse_vllm.get_stats)."""

from __future__ import annotations

from parse_vllm import _vllm


class _StatsRPC:
    def parse_stats(self) -> dict:
        runner = self.model_runner
        stats = getattr(runner, "parse_stats", None)
        return {} if stats is None else stats.as_dict()

    def parse_judgments(self) -> list[dict]:
        return list(getattr(self.model_runner, "parse_judgments", ()))

    def parse_reset_stats(self) -> None:
        from parse_vllm.metrics import ParseStats

        if hasattr(self.model_runner, "parse_stats"):
            self.model_runner.parse_stats = ParseStats()
            self.model_runner._parse_last_exported = ParseStats()


class ParseCPUWorker(_StatsRPC, _vllm.cpu_worker_cls()):
    def init_device(self):
        from parse_vllm.runner import ParseCPUModelRunner

        with _vllm.cpu_worker_builds_runner(ParseCPUModelRunner):
            super().init_device()


def __getattr__(name):  # CUDA-only imports stay lazy on CPU installs
    if name == "ParseGPUWorker":

        class ParseGPUWorker(_StatsRPC, _vllm.gpu_worker_cls()):
            def _make_model_runner(self):
                if self.use_v2_model_runner:
                    raise RuntimeError(
                        "PARSE runs on vLLM's model runner V1; set VLLM_USE_V2_MODEL_RUNNER=0 "
                        "(parse-vllm sets it when PARSE is named; something overrode it)"
                    )
                from parse_vllm.runner import ParseGPUModelRunner

                return ParseGPUModelRunner(self.vllm_config, self.device)

        ParseGPUWorker.__module__ = __name__
        globals()[name] = ParseGPUWorker
        return ParseGPUWorker
    raise AttributeError(name)
