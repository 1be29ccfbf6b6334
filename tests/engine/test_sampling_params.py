"""SamplingParams rejects bad values with a ValueError that names the field."""

import math

import numpy as np
import pytest

from fastdraft import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 4.0}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": "0.7"}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": "0.9"}, "top_p"),
    ({"seed": "7"}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": 2**63 - 1}, "seed"),  # seed + 1 seeds a separate draft's generator
    ({"seed": -2**63 - 1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
])
def test_bad_values_raise_value_error(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_edge_values_are_accepted():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(temperature=1, top_p=1, seed=2**63 - 2).temperature == 1
    assert SamplingParams(seed=-2**63).seed == -2**63
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams(temperature=1e-6).is_greedy


def test_numpy_scalars_are_stored_as_python_numbers():
    params = SamplingParams(max_new_tokens=np.int64(8), temperature=np.float32(0.5), top_k=np.int32(3),
                            top_p=np.float64(0.9), seed=np.uint32(7))
    assert type(params.max_new_tokens) is int and type(params.top_k) is int and type(params.seed) is int
    assert type(params.temperature) is float and params.temperature == 0.5
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=np.bool_(True))


def test_max_tokens_and_max_new_tokens_are_one_limit():
    assert SamplingParams().max_tokens == SamplingParams().max_new_tokens == 256
    assert SamplingParams(max_tokens=5).max_new_tokens == 5
    assert SamplingParams(max_new_tokens=7).max_tokens == 7
    assert SamplingParams(max_tokens=9, max_new_tokens=9).max_new_tokens == 9
    with pytest.raises(ValueError, match="one limit"):
        SamplingParams(max_tokens=5, max_new_tokens=6)
    with pytest.raises(ValueError, match="positive integer"):
        SamplingParams(max_tokens=0)


def test_replace_changes_the_one_limit():
    import dataclasses

    params = dataclasses.replace(SamplingParams(max_tokens=10), max_new_tokens=11)
    assert params.max_tokens == params.max_new_tokens == 11
