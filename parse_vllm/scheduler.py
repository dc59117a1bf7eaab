"""ParseScheduler: vLLM's scheduler minus the KV blocks PARSE uses as scratch,
holding back the requests whose window is being drafted.

The workers allocate all N blocks; this scheduler is told there are N - R, so
block ids [N - R, N) are never given to a request and the verification pass
can write its suffix KV there (verify/forked.py). R comes from the same function
the runner uses, on the same inputs.

After each step the runner reports (`windows.StepReport`, on the model runner's output)
every request's draft for the next step and the requests whose window is still being
drafted (windows.py): such a request is held: it stays running (it keeps its blocks, the
W lookahead slots its last step reserved, and counts towards max_num_seqs) but is not
scheduled; once its window is complete it gets it as its draft and is scheduled again. A
held request that is preempted is released: it drafts its window again once resumed.
"""

from __future__ import annotations

import dataclasses

from parse_vllm import _vllm
from parse_vllm.config import ParseConfig, parse_section
from parse_vllm.verify import scratch_block_count

logger = _vllm.init_logger("parse_vllm.scheduler")


class ParseScheduler(_vllm.Scheduler):
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        config = ParseConfig.from_dict(parse_section(vllm_config.additional_config))
        scratch = scratch_block_count(config.scratch_blocks, kv_cache_config.num_blocks, config.verifier)
        kv_cache_config = dataclasses.replace(kv_cache_config, num_blocks=kv_cache_config.num_blocks - scratch)
        logger.info("PARSE: %d KV blocks held back as verification scratch", scratch)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        report = _vllm.step_report(model_runner_output)
        if report is not None:
            _vllm.deliver_drafts(self, report.drafts)
            for request in self.running:
                if request.request_id in report.open:
                    _vllm.hold_request(request)
                else:
                    _vllm.release_request(request)
        return outputs

    def _preempt_request(self, request, *args, **kwargs) -> None:
        _vllm.release_request(request)
        super()._preempt_request(request, *args, **kwargs)
