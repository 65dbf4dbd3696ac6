#!/usr/bin/env bash
# The pip-installed tritonserver (nvidia-pytriton's build) with what it needs on
# a plain Linux host: its backend directory and the venv's libpython for the
# Python backend stub. Takes tritonserver's own arguments; the CPU image uses it
# as `tritonserver`.
set -euo pipefail
ROOT="$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
TRITON_DIR="$("$PY" -c 'import importlib.util,os;print(os.path.join(os.path.dirname(importlib.util.find_spec("pytriton").origin),"tritonserver"))')"
export PATH="$VENV/bin:$PATH"
export LD_LIBRARY_PATH="$("$PY" -c 'import sysconfig;print(sysconfig.get_config_var("LIBDIR"))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$TRITON_DIR/bin/tritonserver" --backend-directory "$TRITON_DIR/backends" "$@"
