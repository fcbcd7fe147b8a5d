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

fail() { echo "install.sh: $*" >&2; exit 1; }
command -v "$PYTHON" > /dev/null || fail "no $PYTHON found: install Python 3.10 or newer (or set PYTHON=/path/to/python3)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || fail "$("$PYTHON" --version 2>&1) is too old: moe-serve needs Python 3.10 or newer (set PYTHON=python3.12, say)"
# a venv an earlier run left without pip (the venv module lacked ensurepip) is made again
if ! "$VENV/bin/python" -m pip --version > /dev/null 2>&1; then
  [ ! -e "$VENV" ] || [ -f "$VENV/pyvenv.cfg" ] || fail "$VENV exists and is not a virtual environment (set VENV=...)"
  "$PYTHON" -m venv --clear "$VENV" || fail "could not create a virtual environment with $PYTHON -m venv: \
on Debian or Ubuntu install the venv module first (sudo apt install python3-venv), then run this again"
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
pip install -q "$TORCH_SPEC"  # first, so nothing below pulls a different torch build
pip install -q -e ".$extras"
pip install -q --no-deps -r requirements-nodeps.txt
