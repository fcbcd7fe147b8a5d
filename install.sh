#!/usr/bin/env bash
# Installs moe-serve into a virtual environment (default .venv beside this file).
#   bash install.sh          # the server
#   bash install.sh --test   # the server plus what the tests need
# Environment: PYTHON (interpreter, default python3), VENV (folder), TORCH_SPEC
# (default torch==2.13.0; set it to pick another build, e.g. a CUDA one).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
pip install -q "$TORCH_SPEC"  # first, so nothing below pulls a different torch build
pip install -q -e ".$extras"
pip install -q --no-deps -r requirements-nodeps.txt
