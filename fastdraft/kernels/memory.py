"""Memory that every decode step streams (weights, the KV cache): backed by transparent huge pages.

Decoding reads every weight byte once per token, in long sequential runs. With 4 KiB pages
the hardware prefetchers stop at every page boundary and the TLB misses on every page; on
Linux, memory advised with ``MADV_HUGEPAGE`` gets 2 MiB pages instead, so the streams cross a
page boundary 512 times less often.

Small weights (a 0.5B model's q/k/v: 0.5 MiB) would waste most of a 2 MiB page each, so they
are packed one after another into shared 32 MiB regions: an allocator, like torch's own, that
changes where bytes live and never what they are. A region is unmapped when the last tensor
in it is freed. Where huge pages are unavailable, tensors get plain memory.
"""

from __future__ import annotations

import math
import mmap
import threading

import torch

HUGE_PAGE_BYTES = 2 << 20
REGION_BYTES = 32 << 20
ALIGN_BYTES = 4096  # each tensor starts on its own page: no false sharing, aligned loads


class _Region:
    def __init__(self, nbytes: int) -> None:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(region, dtype=torch.uint8)  # the storage keeps ``region`` mapped
        offset = (-raw.data_ptr()) % HUGE_PAGE_BYTES  # huge pages need 2 MiB-aligned ranges
        self.raw = raw[offset:offset + nbytes]
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        start = -(-self.used // ALIGN_BYTES) * ALIGN_BYTES
        if start + nbytes > self.raw.numel():
            return None
        self.used = start + nbytes
        return self.raw[start:start + nbytes]


class _HugePageAllocator:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: _Region | None = None
        self.is_available = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        if not self.is_available:
            return None
        try:
            # Normal (not inference) tensors even when called under inference_mode: a region
            # outlives the call, and its tensors (a KV cache) may be written outside that mode.
            with self._lock, torch.inference_mode(False):
                if nbytes > REGION_BYTES // 4:  # large: a region of its own
                    return _Region(nbytes).take(nbytes)
                block = self._current.take(nbytes) if self._current is not None else None
                if block is None:
                    self._current = _Region(REGION_BYTES)
                    block = self._current.take(nbytes)
                return block
        except (OSError, ValueError):  # no madvise / mmap here: plain memory
            self.is_available = False
            return None


_ALLOCATOR = _HugePageAllocator()


def _huge_page_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised CPU tensor in huge-page memory (fresh anonymous pages, so all zero
    bytes), or ``None`` where that is not possible."""
    block = _ALLOCATOR.allocate(math.prod(shape) * dtype.itemsize)
    if block is None:
        return None
    with torch.inference_mode(False):  # see _HugePageAllocator.allocate
        return block.view(dtype).view(shape)


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` in memory advised for transparent huge pages, or
    ``t.contiguous()`` where that is not possible (other devices, non-Linux)."""
    out = _huge_page_empty(t.shape, t.dtype) if t.device.type == "cpu" else None
    if out is None:
        return t.contiguous()
    out.copy_(t)
    return out


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape)`` in memory advised for transparent huge pages on the CPU (plain
    ``torch.zeros`` elsewhere). For buffers decoding streams through at every step, such as
    the KV cache, for the reason weights live there."""
    out = _huge_page_empty(shape, dtype) if torch.device(device).type == "cpu" else None
    return out if out is not None else torch.zeros(shape, dtype=dtype, device=device)
