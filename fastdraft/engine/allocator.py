"""glibc malloc settings for decode loops.

Every decode step allocates and frees the same large tensors: the logits ([rows, vocab] fp32,
0.6 MB a row for Qwen's 152k vocabulary) and, when sampling, the distributions derived from
them. With glibc's defaults such a block is mmap'ed afresh, or handed back to the kernel when
it is freed at the top of the heap, so each step page-faults it in again, at about 1.3 us per
4 KB page on a cloud VM: a softmax over [4, 152k] logits can take 1.6-2.2 ms instead of 0.2 ms
(in about half of all processes, depending on how their heap happens to be laid out), and
speculative sampling can lose about 3.6 ms a verification step to it.

:func:`tune_malloc` raises both thresholds so that freed blocks stay in the heap for the next
step, which is what the jemalloc / tcmalloc preloads that ipex-llm and vLLM's CPU backend
recommend achieve. It changes the whole process's allocator, so the engine applies it when a
:class:`fastdraft.engine.generate.TextGenerator` is built; other callers may call it themselves.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# Blocks up to 32 MiB (glibc's largest allowed mmap threshold on 64-bit) come from the heap,
# and up to 1 GiB of free heap top is kept instead of trimmed.
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2**30


def tune_malloc() -> bool:
    """Keep freed large blocks in the process for reuse (see the module docstring).

    Returns True when glibc accepted both settings, False elsewhere (another C library or OS),
    where nothing is changed. Calling it again is harmless."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    is_set = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
              and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not is_set:
        logger.info("glibc rejected the malloc thresholds; decode steps may page-fault their buffers")
    return is_set
