import platform

import pytest
import torch

import fastdraft
from fastdraft.process import configure_process, tune_malloc

IS_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not IS_GLIBC, reason="needs glibc")
def test_glibc_accepts_the_malloc_thresholds():
    assert tune_malloc() is True
    assert tune_malloc() is True  # idempotent


@pytest.mark.skipif(not IS_GLIBC, reason="needs glibc")
def test_configure_process_tunes_malloc_and_leaves_threads_alone_by_default():
    before = torch.get_num_threads()
    assert fastdraft.configure_process() is True
    assert fastdraft.configure_process() is True  # idempotent
    assert torch.get_num_threads() == before


def test_configure_process_sets_the_thread_count():
    before = torch.get_num_threads()
    try:
        configure_process(num_threads=1)
        assert torch.get_num_threads() == 1
        configure_process(num_threads=before)
        assert torch.get_num_threads() == before
    finally:  # later tests keep the count they started with
        torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [0, -2])
def test_configure_process_rejects_fewer_than_one_thread(num_threads):
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="at least 1"):
        configure_process(num_threads=num_threads)
    assert torch.get_num_threads() == before


def test_configure_process_is_exported():
    assert "configure_process" in fastdraft.__all__
    assert fastdraft.configure_process is configure_process
