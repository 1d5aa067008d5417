#!/usr/bin/env bash
# Build .venv-xla: the XLA lane's interpreter (torch_xla SPMD on virtual CPU devices).
#
# torch_xla is built against one exact torch release, so both are pinned together.
# Idempotent: a venv that already imports the pinned pair is left as it is, so
# `make test-xla` pays the download (about 3.5 GB; 7.4 GB installed) only once per machine.
#
# Usage: bash scripts/setup_xla_venv.sh            (from the repository root)
#        XLA_VENV=/path/to/venv bash scripts/setup_xla_venv.sh
set -euo pipefail

TORCH_VERSION="2.9.1"
TORCH_XLA_VERSION="2.9.0"
VENV="${XLA_VENV:-.venv-xla}"
PYTHON="${PYTHON:-python3}"

# Everything the XLA tests import besides torch/torch_xla (the repo's core/ needs pyyaml;
# train.py's default metrics sinks need tensorboard).
EXTRA_PACKAGES=(
  "pyyaml"
  "pyarrow"
  "zstandard"
  "psutil"
  "pytest"
  "safetensors"
  "tokenizers"
  "numpy"
  "tensorboard>=2.14"
)

venv_is_ready() {
  [ -x "$VENV/bin/python" ] || return 1
  "$VENV/bin/python" - "$TORCH_VERSION" "$TORCH_XLA_VERSION" <<'PY' >/dev/null 2>&1
import sys
import importlib.metadata as md
want_torch, want_xla = sys.argv[1], sys.argv[2]
assert md.version("torch").split("+")[0] == want_torch
assert md.version("torch_xla").split("+")[0] == want_xla
for name in ("yaml", "pyarrow", "zstandard", "psutil", "pytest", "safetensors", "tokenizers", "numpy", "tensorboard"):
    __import__(name)
PY
}

if venv_is_ready; then
  echo "setup_xla_venv: $VENV already has torch==$TORCH_VERSION torch_xla==$TORCH_XLA_VERSION"
  exit 0
fi

echo "setup_xla_venv: building $VENV (torch==$TORCH_VERSION, torch_xla==$TORCH_XLA_VERSION; about 7.4 GB installed)"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --no-cache-dir --upgrade pip
# One resolver run for the pinned pair and the helpers, so pip cannot pick a torch that
# torch_xla was not built against. No wheel cache: torch's CUDA wheels would otherwise stay on
# disk a second time (about 3.5 GB) beside the 7.4 GB venv.
"$VENV/bin/python" -m pip install --quiet --no-cache-dir \
  "torch==$TORCH_VERSION" \
  "torch_xla==$TORCH_XLA_VERSION" \
  "${EXTRA_PACKAGES[@]}"

if ! venv_is_ready; then
  echo "setup_xla_venv: $VENV was built but does not import the pinned packages" >&2
  exit 1
fi
echo "setup_xla_venv: ready"
