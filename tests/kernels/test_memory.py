"""Huge-page placement of streamed weights and KV caches (kernels/memory.py): a copy, never a change."""

import torch

from fastdraft.kernels.memory import (REGION_BYTES, huge_page_copy, huge_page_zeros, release_pages, resident_bytes,
                                     small_pages)


def test_copies_are_equal_contiguous_and_independent():
    for t in (torch.randn(3, 5), torch.randint(0, 255, (1024, 700), dtype=torch.uint8), torch.randn(4, 6)[:, ::2]):
        out = huge_page_copy(t)
        assert torch.equal(out, t) and out.is_contiguous() and out.dtype == t.dtype
        assert out.data_ptr() != t.data_ptr()
        out.zero_()  # writable, and does not alias the source
        assert not torch.equal(out, t) or not t.any()


def test_small_tensors_share_regions_and_large_ones_get_their_own():
    small = [huge_page_copy(torch.full((1000,), float(i))) for i in range(8)]
    for i, t in enumerate(small):  # neighbours in one region never overlap
        assert torch.all(t == i)
    large = huge_page_copy(torch.ones(REGION_BYTES // 2, dtype=torch.uint8))
    assert int(large.sum()) == REGION_BYTES // 2


def test_zeros_are_zero_and_writable_outside_inference_mode():
    with torch.inference_mode():  # as when a KV cache is made inside a generate call
        copies = [huge_page_copy(torch.full((1000,), 7.0)) for _ in range(3)]
        zeros = huge_page_zeros((3, 50, 16), torch.bfloat16)
        big = huge_page_zeros((4, 3 << 20), torch.float32)  # a region of its own
    del copies
    for t in (zeros, big):
        assert not t.is_inference() and t.is_contiguous() and not t.any()
        t.add_(1)  # a KV cache is written in place, in or out of inference mode
        assert bool((t == 1).all())
    assert huge_page_zeros((2, 3), torch.float32, device="meta").device.type == "meta"


def test_released_pages_leave_memory_and_read_as_zeros_until_written():
    pool = huge_page_zeros((REGION_BYTES // 4096, 4096), torch.uint8)  # a region of its own, untouched
    small_pages(pool)  # before the first write: 4 KiB pages from here on
    assert resident_bytes(pool) == 0
    pool[:16] = 1
    assert resident_bytes(pool) == 16 * 4096  # only the pages written
    assert release_pages(pool[2:10]) == 8 * 4096
    assert resident_bytes(pool) == 8 * 4096
    pool[5] = 3  # written again: back in memory
    assert resident_bytes(pool) == 9 * 4096 and bool((pool[5] == 3).all())
    # (Read last: mincore counts a read page as resident, though the read maps the zero page.)
    assert not pool[[2, 3, 4, 6, 7, 8, 9]].any() and bool((pool[:2] == 1).all()) and bool((pool[10:16] == 1).all())
    # A range shorter than a page releases nothing, and nothing outside it.
    assert release_pages(pool[0, 100:200]) == 0 and bool((pool[0] == 1).all())
