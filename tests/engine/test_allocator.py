import platform

import pytest

from fastdraft.engine.allocator import tune_malloc


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="needs glibc")
def test_glibc_accepts_the_malloc_thresholds():
    assert tune_malloc() is True
    assert tune_malloc() is True  # idempotent
