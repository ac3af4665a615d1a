import pytest

from ddtree.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("stop", [""]),
        ("stop_token_ids", [-3]),
        ("seed", "x"),
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", True),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=1e-40).is_greedy and SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_defaults_and_single_stop_string():
    p = SamplingParams(stop="###")
    assert p.stop == ["###"] and p.is_greedy and p.max_tokens == 256
