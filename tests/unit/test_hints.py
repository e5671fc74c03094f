"""The client's location hints: a read's word counts only against the hints it could have known."""

from __future__ import annotations

from kvstore_client.hints import LocationHints

A = ("node0", "127.0.0.1:1")
B = ("node1", "127.0.0.1:2")


def test_a_read_that_began_before_a_put_leaves_the_puts_hint() -> None:
    """The race a chaos run found: a get of k begins, this client's cached put of k is answered (its
    hint set), the get misses k at the master (which does not know the put yet) and forgot the
    hint, so the writer's next get asked the master too and missed its own put."""
    hints = LocationHints(16)
    since = hints.now()  # the get begins
    hints.note([("k", A)])  # the put is answered
    hints.note([("k", None)], since)  # the get's miss at the master
    assert hints.get("k") == A
    hints.forget(["k"], since)  # nor does a miss at a node it read earlier
    assert hints.get("k") == A
    hints.note([("k", B)], since)  # nor where it found an older block
    assert hints.get("k") == A


def test_a_read_that_began_after_the_hint_is_believed() -> None:
    hints = LocationHints(16)
    hints.note([("k", A), ("j", A)])
    since = hints.now()
    hints.forget(["k"], since)
    hints.note([("j", B)], since)
    assert hints.get("k") is None and hints.get("j") == B
    hints.forget(["j"])  # a remove: whenever it began
    assert hints.get("j") is None and len(hints) == 0


def test_the_bound_drops_the_least_recently_used_with_its_stamp() -> None:
    hints = LocationHints(2)
    hints.note([("a", A), ("b", A)])
    since = hints.now()
    hints.note([("c", B)])  # "a" goes
    assert hints.get("a") is None and len(hints) == 2
    hints.note([("a", B)], since)  # "a" has no hint now: the read's word stands
    assert hints.get("a") == B and hints.get("b") is None
