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

import ctypes
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


_PAGE_BYTES = mmap.PAGESIZE
_MADV_DONTNEED = 4  # Linux: the range's private anonymous pages are dropped, to read as zeros
_MADV_NOHUGEPAGE = 15


def _page_range(t: torch.Tensor) -> tuple[int, int]:
    """The whole pages inside contiguous ``t``'s bytes: (first address, length), length 0 if none."""
    start = t.data_ptr()
    first = -(-start // _PAGE_BYTES) * _PAGE_BYTES
    end = (start + t.numel() * t.element_size()) // _PAGE_BYTES * _PAGE_BYTES
    return first, max(end - first, 0)


def _madvise(t: torch.Tensor, advice: int) -> int:
    """madvise(advice) over the whole pages inside contiguous CPU tensor ``t``: the bytes advised (0: none, or refused)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return 0
    first, length = _page_range(t)
    if length == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return length if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), advice) == 0 else 0


def small_pages(t: torch.Tensor) -> None:
    """Back ``t`` (untouched memory from :func:`huge_page_zeros`) with 4 KiB pages after all:
    for memory given back a few KiB at a time (:func:`release_pages`), where a huge page would
    bring in 2 MiB at the first write."""
    _madvise(t, _MADV_NOHUGEPAGE)


def release_pages(t: torch.Tensor) -> int:
    """Return the whole pages inside ``t`` (contiguous, in private anonymous CPU memory, such as
    :func:`huge_page_zeros` gives) to the OS: they read as zeros until written again. Returns the
    bytes released (0 on other devices, or where the OS does not take the advice)."""
    return _madvise(t, _MADV_DONTNEED)


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the whole pages inside contiguous CPU tensor ``t`` that are in memory now (mincore)."""
    first, length = _page_range(t)
    if length == 0:
        return 0
    num_pages = length // _PAGE_BYTES
    vec = (ctypes.c_ubyte * num_pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * _PAGE_BYTES
