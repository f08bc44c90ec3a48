"""`restart.cost`: the job time a fault cost, from step times (pure arithmetic, synthetic timelines)."""

from __future__ import annotations

import pytest

from nemo_checkpointless.restart.cost import StepTimes, fault_costs


def _timeline(records: list[tuple[int, float]]) -> StepTimes:
    return StepTimes.parse("".join(f"{s} {t:.6f};" for s, t in records))


def _steady(first: int, last: int, t0: float, rate: float) -> list[tuple[int, float]]:
    return [(s, t0 + (s - first) / rate) for s in range(first, last + 1)]


def test_a_pause_costs_its_length_and_a_slower_job_costs_the_extra_time() -> None:
    # 10 steps/s; the fault interrupts step 51: a 2 s pause, then 20 step intervals at 5 steps/s, then 10 steps/s again.
    before = _steady(1, 50, 0.0, 10.0)
    t = before[-1][1] + 2.0 + 0.1  # step 51 completes 2 s late
    slow = _steady(51, 71, t, 5.0)
    fast = _steady(72, 100, slow[-1][1] + 0.1, 10.0)
    (cost,) = fault_costs(_timeline(before + slow + fast), [51], final_step=100)
    assert cost.rate_before == pytest.approx(10.0)
    assert cost.rate_after == pytest.approx(5.0)
    # 2 s of pause + 20 intervals at 0.2 s instead of 0.1 s.
    assert cost.lost_s == pytest.approx(2.0 + 20 * 0.1)


def test_a_restart_is_charged_the_steps_it_redoes() -> None:
    # Checkpoint at 40, fault in step 51: steps 41..50 complete twice; the restart itself takes 5 s.
    first_pass = _steady(1, 50, 0.0, 10.0)
    redo = _steady(41, 100, first_pass[-1][1] + 5.0, 10.0)
    (cost,) = fault_costs(_timeline(first_pass + redo), [51], final_step=100)
    times = _timeline(first_pass + redo)
    assert times.first[45] < times.last[45]
    # From step 50's first completion to step 100: 5 s + 59 intervals; 50 intervals expected.
    assert cost.lost_s == pytest.approx(5.0 + 59 * 0.1 - 50 * 0.1)
    assert cost.rate_before == pytest.approx(10.0) and cost.rate_after == pytest.approx(10.0)


def test_a_restart_is_not_charged_the_next_restart() -> None:
    # Checkpoints every 10 steps; faults in steps 31 and 61, each restart takes 2 s and redoes steps 31.., 61..
    a = _steady(1, 30, 0.0, 10.0)
    b = _steady(31, 60, a[-1][1] + 2.0 + 0.1, 10.0)  # the first restart: nothing to redo (checkpoint at 30)
    c = _steady(51, 90, b[-1][1] + 2.0, 10.0)  # the second restarts from 50: steps 51..60 again
    first, second = fault_costs(_timeline(a + b + c), [31, 61], final_step=90)
    assert first.lost_s == pytest.approx(2.0)
    # 2 s from step 60 to the redone step 51 (in place of one step's 0.1 s), then steps 52..60 again.
    assert second.lost_s == pytest.approx(2.0 - 0.1 + 10 * 0.1)


def test_each_fault_is_charged_until_the_next_and_rates_never_span_a_fault() -> None:
    a = _steady(1, 30, 0.0, 10.0)
    b = _steady(31, 60, a[-1][1] + 1.0 + 0.1, 10.0)  # fault in step 31: 1 s
    c = _steady(61, 90, b[-1][1] + 3.0 + 0.1, 10.0)  # fault in step 61: 3 s
    first, second = fault_costs(_timeline(a + b + c), [31, 61], final_step=90)
    assert first.lost_s == pytest.approx(1.0) and second.lost_s == pytest.approx(3.0)
    assert second.rate_before == pytest.approx(10.0)  # steps 40..60 only, after the first fault


def test_unknown_steps_give_no_figure() -> None:
    costs = fault_costs(_timeline(_steady(1, 10, 0.0, 10.0)), [None, 200], final_step=10)
    assert [c.lost_s for c in costs] == [None, None]
