"""Lab tools around the PARSE runtime: nothing in the runtime imports them.

Leaf modules first; each imports only the ones above it (and the runtime):

prompts         training prompts (topic-driven generator), MT-Bench's questions, chat rendering
draft_delta     the shipped draft's format: a delta over its target (export, assemble)
prepare_models  `parse-vllm prepare-models`: HF folders from PyPI GGUF packages, the demo draft
engine          running a vLLM LLM: requests kept in flight, spec-decode counters, shutdown
train_draft     `parse-vllm train-draft`: distil a small draft from the target's own answers
benchmarks/     scripts/bench_verify.py, bench_e2e.py, bench_report.py (BENCHMARKS.md)
eval/           `parse-vllm eval`: speed against quality, with a recommendation

tests/test_import_graph.py checks that no runtime module imports them and that there is no
import cycle.
"""
