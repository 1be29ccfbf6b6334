"""Every kernel test runs once per instruction-set variant this CPU runs."""

import pytest


@pytest.fixture(autouse=True)
def _every_isa(each_isa: str) -> str:
    return each_isa
