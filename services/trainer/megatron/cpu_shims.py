"""The few shims megatron-core needs to run on CPU (gloo), in one place.

megatron-core is written for GPUs: a handful of its code paths allocate on
`torch.cuda.current_device()` unconditionally (the global memory buffer of its attention,
the rotary embedding's frequencies, tensor-parallel gathers) and its dropout runs inside
the CUDA RNG tracker's `fork()`, which swaps CUDA RNG states. On a machine without CUDA
(CI, the tests, a laptop) `apply()` makes both harmless; on a GPU machine it does nothing,
so megatron-core runs unmodified there.
"""

from __future__ import annotations

import contextlib

import torch

_applied = False


def apply() -> bool:
    """Install the shims when this process has no CUDA device; idempotent. Returns whether
    they are in place."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core.tensor_parallel import random as mcore_random

    # torch.cuda.current_device() raises without CUDA. megatron-core only passes it on as a
    # `device=` argument (buffers, rotary frequencies, gather outputs), so naming the CPU
    # keeps every such tensor beside the rest of the model.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]

    # The tracker forks CUDA RNG states around dropout; on CPU there are none to fork (and
    # the trainer runs with dropout off, see layout.build_model's TransformerConfig).
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        return contextlib.nullcontext()

    mcore_random.CudaRNGStatesTracker.fork = fork  # type: ignore[method-assign]
    _applied = True
    return True
