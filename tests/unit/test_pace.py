"""AnswerPace: a lane's seconds an answer, from when its answers come."""

from __future__ import annotations

import pytest

from loaderd.stream.pace import GAPS, AnswerPace


def test_the_pace_is_known_only_after_enough_gaps_and_a_first_answers_wait_is_not_one() -> None:
    pace = AnswerPace()
    pace.answered(at=5.0, asked_at=0.0)  # the stream's opening: 5 s, no gap
    assert pace.seconds == 0.0 and pace.last_at == 5.0
    for k in range(1, GAPS):
        pace.answered(at=5.0 + 0.01 * k, asked_at=0.0)
        assert pace.seconds == 0.0, "not known yet"
    pace.answered(at=5.0 + 0.01 * GAPS, asked_at=0.0)
    assert pace.seconds == pytest.approx(0.01)


def test_bursts_average_out_and_an_idle_spell_does_not_count() -> None:
    pace = AnswerPace()
    at = 1.0
    pace.answered(at, asked_at=0.0)
    for _ in range(10):  # two answers together every 20 ms (two workers): 10 ms an answer
        at += 0.02
        pace.answered(at, asked_at=0.0)
        pace.answered(at, asked_at=0.0)
    assert 0.005 < pace.seconds < 0.02
    # Nothing was out for 10 s: the next answer counts from when it was asked (10 ms), not from the last one.
    pace.answered(at + 10.01, asked_at=at + 10.0)
    assert pace.seconds < 0.02
