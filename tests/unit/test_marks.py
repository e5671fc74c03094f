"""NodeMarks on a clock the test owns: each mark holds until its time and goes when spent or when
the node's daemon answers; a read given up at a patience marks the node slow (and tells the
hedging), one that waited the whole timeout suspects it; a refused connection is reported to the
master at most every REPORT_GAP_S."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvstore.errors import ConnectionFailed, Timeout
from kvstore_client.hedging import SLOW_S, ReadTimes
from kvstore_client.marks import REPORT_GAP_S, SUSPECT_S, UNREACHED_S, NodeMarks

FAILOVER_S = 0.1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr("kvstore_client.marks.time", SimpleNamespace(monotonic=clock))
    return clock


def test_a_read_that_waited_the_whole_timeout_suspects_its_node_until_an_answer_or_the_time(clock: Clock) -> None:
    marks = NodeMarks(FAILOVER_S, ReadTimes(FAILOVER_S))
    assert not (marks.suspected_until or marks.slow_until or marks.silent_until or marks.unreached_until)
    marks.note_unreachable("node0", Timeout("no reply within the timeout"), 0.0)
    assert marks.suspected("node0") and marks.silent("node0") and not marks.slow("node0")
    assert marks.unreached() == ["node0"] and marks.suspected_until and marks.unreached_until
    clock.now += SUSPECT_S
    assert not marks.suspected("node0") and not marks.suspected_until  # spent: gone
    assert marks.silent("node0") and marks.unreached() == ["node0"]  # these last UNREACHED_S
    marks.answered("node0")
    assert not marks.silent("node0") and marks.unreached() == [] and not (marks.silent_until or marks.unreached_until)


def test_a_read_given_up_at_its_patience_marks_its_node_slow_and_a_failover_unreached(clock: Clock) -> None:
    read_times = ReadTimes(FAILOVER_S)
    marks = NodeMarks(FAILOVER_S, read_times)
    marks.note_unreachable("node0", Timeout("no reply began"), FAILOVER_S / 2)  # a hedge
    assert marks.slow("node0") and marks.silent("node0") and not marks.suspected("node0")
    assert marks.unreached() == [] and read_times.hedged == 1  # a hedge is no failed attempt
    marks.note_unreachable("node1", Timeout("no reply began"), FAILOVER_S)  # the failover
    assert marks.slow("node1") and marks.unreached() == ["node1"] and read_times.hedged == 1
    clock.now += SLOW_S
    assert not marks.slow("node0") and not marks.slow("node1") and marks.silent("node0")
    clock.now += UNREACHED_S
    assert not marks.silent("node0") and marks.unreached() == []


def test_a_refused_connection_is_reported_at_most_every_report_gap(clock: Clock) -> None:
    marks = NodeMarks(FAILOVER_S, ReadTimes(FAILOVER_S))
    reported: list[str] = []
    marks.reporter = reported.append
    marks.note_unreachable("node0", ConnectionFailed("refused"), FAILOVER_S)
    assert reported == ["node0"] and marks.unreached() == ["node0"]
    assert not marks.suspected("node0") and not marks.silent("node0")  # a refusal costs no wait
    marks.report("node0", ConnectionFailed("refused again"))
    marks.report("node1", Timeout("a silence is not reported"))
    assert reported == ["node0"]
    clock.now += REPORT_GAP_S
    marks.report("node0", ConnectionFailed("refused again"))
    assert reported == ["node0", "node0"]


def test_the_masters_suspects_keep_the_later_of_two_marks_until_one_answers(clock: Clock) -> None:
    marks = NodeMarks(FAILOVER_S, ReadTimes(FAILOVER_S))
    marks.note_suspects([])
    assert not marks.suspected_until
    marks.note_unreachable("node0", Timeout("no reply within the timeout"), 0.0)  # until 101.0
    clock.now = 100.5
    marks.note_suspects(["node0", "node1"])  # until 101.5
    clock.now = 101.25
    assert marks.suspected("node0") and marks.suspected("node1")
    marks.clear_suspect("node0")  # it answered a read
    assert not marks.suspected("node0") and marks.suspected("node1")
    clock.now = 101.5
    assert not marks.suspected("node1") and not marks.suspected_until
