"""Acceptance by draft position, from the histogram `dflash bench` reports."""

import pytest

from dflash.bench import acceptance_by_position


def test_acceptance_by_position_is_conditional_on_reaching_the_position():
    # 10 cycles emitting 1, 2, 3, 4 tokens: 4, 3, 2, 1 times
    rates = acceptance_by_position([4, 3, 2, 1])
    assert rates == [6 / 10, 3 / 6, 1 / 3]  # position k is reached by cycles that accepted 1..k-1
    tau = (4 * 1 + 3 * 2 + 2 * 3 + 1 * 4) / 10
    assert 1 + rates[0] + rates[0] * rates[1] + rates[0] * rates[1] * rates[2] == pytest.approx(tau)


def test_positions_no_cycle_reached_have_no_rate():
    assert acceptance_by_position([5, 0, 0, 0]) == [0.0, None, None]
    assert acceptance_by_position([0, 0, 0, 0]) == [None, None, None]
    assert acceptance_by_position([3]) == []  # blocks of 1 draft nothing
