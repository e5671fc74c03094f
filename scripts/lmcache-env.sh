#!/usr/bin/env bash
# Build the LMCache environment the LMCache tests run in: LMCache 0.5.6 on the CPU build of torch
# 2.13.0, with this checkout installed editable, in its own virtualenv (LMCache pins numpy,
# transformers and setuptools of its own, so it stays out of the main environment).
#
#   scripts/lmcache-env.sh [VENV]     # default .venv-lmcache; reused when complete
#
# LMCache's wheel asks for CUDA packages (cupy-cuda13x, cuda-python, cufile-python) besides torch;
# its L2 adapters, plugin loader, memory objects and remote connectors run without them. So: torch
# first, then the wheel's requirements without those, then the wheel with --no-deps. Set
# KVSTORE_LMCACHE_MOONCAKE=1 to add Mooncake's Python store (mooncake-transfer-engine) here too
# (bench/lmcache_connectors.py takes it from the peers' environment, ../shared/peers/setup.sh).
# bench/lmcache.py runs LMCache's multiprocess server from this environment.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-lmcache}
version=${LMCACHE_VERSION:-0.5.6}
py="$venv/bin/python"
stamp="$venv/.kvstore-lmcache-$version"
pip() { "$py" -m pip install --quiet --disable-pip-version-check "$@"; }
if [ -f "$stamp" ]; then
    pip --no-deps -e . # this checkout may have moved
    exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
pip --upgrade pip
pip torch==2.13.0
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$py" -m pip download --quiet --no-deps -d "$wheels" "lmcache==$version"
wheel=$(ls "$wheels"/lmcache-*.whl)
"$py" scripts/wheel-requirements.py "$wheel" torch cupy-cuda13x cuda-python cufile-python > "$wheels/requirements.txt"
pip -r "$wheels/requirements.txt"
pip --no-deps "$wheel"
pip -e ".[test]"
if [ "${KVSTORE_LMCACHE_MOONCAKE:-0}" = 1 ]; then
    pip mooncake-transfer-engine==0.3.13.post1
fi
"$py" -c "import lmcache.v1.distributed.l2_adapters.factory, lmcache.v1.storage_backend.connector"
touch "$stamp"
