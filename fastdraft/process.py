"""Process-wide settings for programs that run models: :func:`configure_process`.

fastdraft's constructors never change state that the whole process shares (the C library's
allocator, PyTorch's thread pool): a library cannot know what else runs in its host process.
Entry points call :func:`configure_process` once instead: the ``fastdraft`` command, the
server's engine process, the benchmarks; a program that embeds fastdraft may call it too.

**malloc.** Every decode step allocates and frees the same large tensors: the logits ([rows,
vocab] fp32, 0.6 MB a row for Qwen's 152k vocabulary) and, when sampling, the distributions
derived from them. With glibc's defaults such a block is mmap'ed afresh, or handed back to the
kernel when it is freed at the top of the heap, so each step page-faults it in again, a fault
for every 4 KB page: the faults can cost a softmax over the logits far more than its arithmetic
(in some processes and not others, depending on how their heap happens to be laid out), and
they add up over the several such tensors of a speculative verification step. :func:`tune_malloc`
raises both thresholds so that freed blocks stay in the heap for the next step, which is what
the jemalloc / tcmalloc preloads that ipex-llm and vLLM's CPU backend recommend achieve.

**Threads.** PyTorch's intra-op pool, which the C++ kernels share; results do not depend on
its size.
"""

from __future__ import annotations

import ctypes
import logging
import platform

import torch

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


def configure_process(num_threads: int | None = None) -> bool:
    """Apply fastdraft's process-wide settings; call it once, at the start of a program.

    Tunes malloc for decode loops (:func:`tune_malloc`) and, when ``num_threads`` is given,
    sets PyTorch's intra-op thread count, which the C++ kernels share (``None`` leaves it as
    it is: all cores by default). Returns whether the malloc tuning took effect (False off
    glibc, which is harmless). Calling it again is harmless.

    Raises ValueError when ``num_threads`` is less than 1."""
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    is_tuned = tune_malloc()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    return is_tuned
