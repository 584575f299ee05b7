"""The one rule both target-side loops hold a pass by, for rows about to arrive."""

from __future__ import annotations

import pytest

from targets.cohort import SLACK, hold_until, waits

PASS = 0.1


def test_a_pass_waits_for_the_rows_expected_soon_a_little_past_the_last_of_them():
    until = hold_until(10.0, PASS, 0.5, [10.01, 10.02])
    assert until == pytest.approx(10.02 + SLACK * PASS)


def test_a_pass_never_waits_past_its_cap():
    assert hold_until(10.0, PASS, 0.3, [10.025]) == pytest.approx(10.03)


def test_rows_expected_after_the_cap_or_stalled_for_a_whole_pass_are_not_waited_for():
    assert hold_until(10.0, PASS, 0.5, [10.2]) == 10.0  # past the cap: starts now
    assert hold_until(10.0, PASS, 0.5, [9.85]) == 10.0  # overdue by more than a pass


def test_a_row_a_little_overdue_is_still_waited_for_within_the_slack():
    assert hold_until(10.0, PASS, 0.5, [9.99]) == pytest.approx(9.99 + SLACK * PASS)
    assert hold_until(10.0, PASS, 0.5, [9.95]) == 10.0  # its slack is spent already


def test_nothing_expected_means_no_wait():
    assert hold_until(10.0, PASS, 0.5, []) == 10.0


def test_the_waits_end_once_the_rows_waited_for_are_in_or_the_hold_is_over():
    now = [10.0]
    expected = [[10.01, 10.02]]  # who is still out, as a loop's rows arrive

    def wait_for(seconds: float) -> None:  # a wait in which the first row comes in
        now[0] += seconds / 2
        expected[0] = expected[0][1:]

    got = []
    for wait in waits(10.0, PASS, 0.5, lambda: expected[0], lambda: now[0]):
        got.append(wait)
        wait_for(wait)
    # until 10.04 (the last row's 10.02 and its slack), asked at 10.0, then at 10.02
    assert got == pytest.approx([0.04, 0.02]) and SLACK * PASS == pytest.approx(0.02)
    assert expected == [[]]
    assert list(waits(10.0, PASS, 0.5, lambda: [10.2], lambda: 10.0)) == []  # past the cap
