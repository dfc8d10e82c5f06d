"""knee(): the largest token count whose latency stays within tolerance x the 1-token latency."""

from __future__ import annotations

import pytest

from specserve.shared.latency_profile import knee


def test_flat_then_rising_curve():
    # 1.25 x 10 ms = 12.5 ms: 64 tokens (12.4) is the last point under it.
    curve = {1: 10.0, 2: 10.1, 4: 10.0, 8: 10.4, 16: 11.0, 32: 12.0, 64: 12.4, 128: 19.0, 256: 35.0}
    assert knee(curve) == 64
    assert knee(list(reversed(list(curve.items())))) == 64  # pairs, in any order
    assert knee(curve, tolerance=2.0) == 128


def test_curve_rising_immediately_gives_one():
    assert knee([(1, 5.0), (2, 7.0), (4, 9.0), (8, 15.0)]) == 1


def test_bad_input():
    with pytest.raises(ValueError):
        knee([])
    with pytest.raises(ValueError):
        knee({1: 1.0}, tolerance=0.5)
