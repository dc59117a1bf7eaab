"""ParseScheduler: vLLM's scheduler minus the KV blocks PARSE uses as scratch.

The workers allocate all N blocks; this scheduler is told there are N - R, so
block ids [N - R, N) are never given to a request and the verification pass
can write its suffix KV there (verify/forked.py). R comes from the same function
the runner uses, on the same inputs.
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
