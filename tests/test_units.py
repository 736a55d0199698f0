"""Sizes and bandwidths as scenarios write them: the unit rules of docs/design.md, 'Units'."""

import pytest

from kvscope.units import format_bytes, parse_bandwidth, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("88.1KB", 88_100),
        ("429.5GB", 429_500_000_000),
        ("46.09TB", 46_090_000_000_000),
        ("50GiB", 50 * 1024**3),
        ("1 MiB", 1024**2),
        ("512", 512),
        ("4096B", 4096),
        (1234, 1234),
    ],
)
def test_sizes_use_powers_of_1000_and_1024(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["88.1XB", "GB", "-5GB", "1.2.3GB", "10gb"])
def test_bad_sizes_name_the_value(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "bytes_per_second"),
    [("400Gb/s", 50e9), ("400Gbps", 50e9), ("1.6Tb/s", 200e9), ("50GB/s", 50e9), ("1GiB/s", 1024**3)],
)
def test_bandwidth_in_bits_or_bytes(text, bytes_per_second):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_second)


@pytest.mark.parametrize("text", ["400Gb", "400Xb/s", "0GB/s", "0.5B/s", 5e-324, 0, -1])
def test_bad_bandwidths_are_rejected(text):
    with pytest.raises(ValueError, match="invalid bandwidth"):
        parse_bandwidth(text)


def test_format_bytes():
    assert format_bytes(449_586_380_800) == "449.6 GB"
    assert format_bytes(999) == "999 B"


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90.0), (90, 90.0), ("250ms", 0.25), ("5m", 300.0), ("1.5h", 5400.0)]
)
def test_durations_in_prometheus_units(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["5 minutes", "-1s", "0", "1w", ""])
def test_bad_durations_name_the_value(text):
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@pytest.mark.parametrize("value", [None, {}, [1], (1,)])
def test_values_of_the_wrong_type_are_value_errors_naming_them(value):
    """JSON can carry anything; validators turn only ValueError into a 422, so nothing else may escape."""
    for parse in (parse_size, parse_bandwidth, parse_duration):
        with pytest.raises(ValueError, match="invalid"):
            parse(value)


@pytest.mark.parametrize(
    ("parse", "value", "says"),
    [
        (parse_size, "1e400GB", "invalid size '1e400GB': not a finite number"),
        (parse_size, float("inf"), "invalid size inf: not a finite number"),
        (parse_size, float("nan"), "invalid size nan: not a finite number"),
        (parse_size, 2**80, "invalid size (an integer of 25 digits): more than 2^63 - 1 bytes"),
        (parse_size, "1e30PB", "more than 2^63 - 1 bytes"),
        (parse_bandwidth, "1e400Gb/s", "invalid bandwidth '1e400Gb/s': not a finite number"),
        (parse_bandwidth, float("inf"), "not a finite number"),
        (parse_duration, "1e400s", "invalid duration '1e400s': not a finite number"),
    ],
)
def test_numbers_without_a_finite_value_are_refused_by_name(parse, value, says):
    with pytest.raises(ValueError) as caught:
        parse(value)
    assert says in str(caught.value)
