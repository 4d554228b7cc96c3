"""SamplingParams validation: every bad value is refused with a message naming the field."""
import dataclasses
import math

import pytest

from engine.sampling_params import SamplingParams

INVALID = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", True),
    ("max_tokens", 1.0),
    ("max_tokens", "16"),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("temperature", True),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", False),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0000001),
    ("top_p", math.nan),
    ("top_p", None),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", math.inf),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("seed", 1.5),
    ("seed", True),
    ("seed", "42"),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 7),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, 2.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.0),
    ("logprobs", True),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value)


def test_top_p_message_states_the_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        SamplingParams(top_p=0.0)


VALID_EDGES = [
    {"max_tokens": 1},
    {"temperature": 0.0},
    {"temperature": 0},
    {"temperature": 1e-6},
    {"temperature": 100.0},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"top_p": 1.0},
    {"top_p": 1e-9},
    {"top_p": 1},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"seed": 0},
    {"seed": 2**64 - 1},
    {"seed": -(2**63)},
    {"stop": []},
    {"stop": ("a", "bc")},
    {"stop_token_ids": [0, 2**31]},
    {"ignore_eos": True},
    {"logprobs": 0},
    {"logprobs": 20},
]


@pytest.mark.parametrize("kwargs", VALID_EDGES, ids=[repr(k) for k in VALID_EDGES])
def test_valid_edge_values_pass(kwargs):
    SamplingParams(**kwargs)


def test_defaults():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 1.0, -1, 1.0, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.greedy


def test_stop_string_is_normalized_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_numeric_fields_are_normalized_to_float():
    p = SamplingParams(temperature=1, top_p=1, min_p=0)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float) and isinstance(p.min_p, float)


def test_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams(temperature=0.8, top_k=2).greedy


def test_slots_reject_unknown_attributes():
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.not_a_field = 1  # type: ignore[attr-defined]


def test_clone_and_replace_validate_and_do_not_share_lists():
    p = SamplingParams(stop=["x"], stop_token_ids=[3])
    q = p.clone(temperature=0.0)
    assert q.greedy and not p.greedy
    q.stop.append("y")
    q.stop_token_ids.append(4)
    assert p.stop == ["x"] and p.stop_token_ids == [3]
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=2.0)
    with pytest.raises(ValueError, match="max_tokens"):
        dataclasses.replace(p, max_tokens=0)
