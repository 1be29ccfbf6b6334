"""Batch-invariant execution: a scoped kernel mode, as ``torch.inference_mode`` is a scoped autograd mode.

Inside ``batch_invariant()``, every matmul computes each row the same way whatever the number
of rows: dense bf16 linears run fastdraft's dot-product kernel at every row count instead of
oneDNN's GEMM, and weight-only linears stay on the VNNI kernel instead of switching to
dequantize + AMX GEMM at large row counts. With the paged attention, which computes every
query row alike, a sequence's logits then depend on its own tokens only: not on what else is
in the batch, how its prompt was chunked, or whether its prefix came from the cache.

The serving engine's runner enters the mode around each step when its configuration asks
(``EngineConfig.batch_invariant``); the state is a context variable, so it never leaks out of
that scope or into other threads.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_IS_BATCH_INVARIANT = contextvars.ContextVar("fastdraft_batch_invariant", default=False)


def is_batch_invariant() -> bool:
    """Whether the calling code runs inside :func:`batch_invariant` (enabled)."""
    return _IS_BATCH_INVARIANT.get()


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Run the enclosed kernels row-invariantly (``enabled``) or as fast as they can (not)."""
    token = _IS_BATCH_INVARIANT.set(enabled)
    try:
        yield
    finally:
        _IS_BATCH_INVARIANT.reset(token)
