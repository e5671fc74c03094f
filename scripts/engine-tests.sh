#!/usr/bin/env bash
# Run the connector tests against a real vLLM or SGLang, each in a virtualenv of its own (they pin
# torch and transformers versions of their own, so they stay out of the main environment). CI builds
# the vLLM one (its real engines run from the main pytest, tests/integration/test_vllm_engine.py).
#
#   scripts/engine-tests.sh vllm   [VENV]   # vLLM's CPU build 0.32 (scripts/vllm-env.sh): ~3.4 GB, ~2.5 min
#   scripts/engine-tests.sh sglang [VENV]   # SGLang 0.5.23 without its CUDA kernels: ~3 GB, ~10 min
#
# An existing VENV is reused as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${1:?usage: $0 vllm|sglang [VENV]}
venv=${2:-.venv-$engine}
pip() { "$venv/bin/python" -m pip install --quiet "$@"; }

if [ "$engine" = vllm ]; then
    scripts/vllm-env.sh "$venv"
    # Real engines (test_vllm_engine.py) from the main environment's pytest, the scheduler tests in the venv.
    exec "$venv/bin/python" -m pytest -m vllm tests/integration/test_vllm_connector.py -p no:cacheprovider
fi
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    case $engine in
    sglang)
        # SGLang's own requirements pull CUDA kernels; its storage and memory-pool modules need only these.
        pip --no-deps sglang==0.5.23
        pip orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic pyzmq tqdm ipython \
            aiohttp transformers torchvision dill apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors gguf
        ;;
    *) echo "unknown engine $engine (vllm or sglang)" >&2; exit 2 ;;
    esac
    pip -e ".[test]"
fi
exec "$venv/bin/python" -m pytest -m "$engine" tests/integration/test_"$engine"_*.py -p no:cacheprovider
