"""The verification pass: `Verifier.judge(CopyBatch) -> Judgments` (base.py),
by forked block tables (forked.py) or the fused prefix-verify kernel
(kernel.py, imported on demand: GPU)."""

from parse_vllm.verify.base import CopyBatch, Judgments, Verifier, VerifierBase
from parse_vllm.verify.forked import ForkedBlockTableVerifier, scratch_block_count

__all__ = ["CopyBatch", "ForkedBlockTableVerifier", "Judgments", "Verifier", "VerifierBase", "scratch_block_count"]
