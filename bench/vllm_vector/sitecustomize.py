"""Started in every process of a vLLM engine run with ``--cpu-isa vector`` (``bench/vllm_engine.py``
puts this directory on ``PYTHONPATH``): vLLM's CPU engine starts its engine core and workers with
``spawn``, so a patch made in the driver process would not reach them. torch's AMX check answers
False, so vLLM's CPU attention takes its AVX-512 vector kernels and their page layout, the path a
CPU without AMX takes."""

import os

if os.environ.get("KVSTORE_VLLM_CPU_ISA") == "vector":
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
