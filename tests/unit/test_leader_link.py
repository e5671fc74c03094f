"""LeaderLink against masters on loopback (asyncio servers that speak the frames): it resolves the
leader, follows a new one after its connection fails or it answers NotLeader (under the same
request id), leaves a frozen leader for its successor within the leader check, gives a fixed
master that does not answer up after its timeout, and once closed stays closed. The leader is
the one a test names (a locator that reads it from the test, not from etcd)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kvstore.errors import ConnectionFailed, KVStoreError, NotLeader, StoreClosed, Timeout
from kvstore.protocol import ErrorReply, Stats, StatsReply, decode_payload, encode
from transfer.aio import read_payload
from transfer.discovery import MasterLocator
from transfer.leader_link import LeaderLink
from transfer.rpc import HA_ATTEMPT_S


class Master:
    """A master on loopback that answers Stats with its number; ``deposed``: NotLeader instead;
    ``frozen``: nothing (the connection stays open). Every request id it read is in ``asked``."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.deposed = False
        self.frozen = False
        self.asked: list[int] = []
        self.connections = 0
        self.address = ""
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> Master:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while (payload := await read_payload(reader)) is not None:
                request_id, _ = decode_payload(payload)
                self.asked.append(request_id)
                if self.frozen:
                    continue
                if self.deposed:
                    reply = encode(ErrorReply.from_error(NotLeader(f"master {self.number} leads no more")), request_id)
                else:
                    reply = encode(StatsReply({"master": self.number}), request_id)
                writer.write(reply)
        except (ConnectionError, KVStoreError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        """Gone: its connections cut, its port refusing."""
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        await self._server.wait_closed()


class Elected(MasterLocator):
    """An etcd locator (so the link follows leaders) whose etcd is the test: a read names ``leader``."""

    def __init__(self, leader: str) -> None:
        super().__init__("etcd://127.0.0.1:9/test")
        self.leader = leader

    def refresh(self, min_interval: float = 0.0) -> str:
        self.asked += 1
        self._saw(self._revision + 1, self.leader)
        return self.leader


@pytest.fixture
async def masters() -> AsyncIterator[tuple[Master, Master]]:
    a, b = await Master(0).start(), await Master(1).start()
    yield a, b
    for master in (a, b):
        await master.stop()


def answered_by(reply: StatsReply) -> int | float:
    return reply.stats["master"]


async def test_a_call_resolves_the_leader_and_follows_a_new_one_when_its_connection_fails(
    masters: tuple[Master, Master],
) -> None:
    a, b = masters
    locator = Elected(a.address)
    link = LeaderLink(locator, timeout=5.0)
    assert link.address == locator.spec  # nothing resolved before the first call
    assert answered_by(await link.call(Stats(), StatsReply)) == 0
    await a.stop()
    locator.leader = b.address  # etcd names the successor
    began = time.monotonic()
    assert answered_by(await link.call(Stats(), StatsReply)) == 1
    assert time.monotonic() - began < 1.0
    assert link.address == b.address
    await link.close()


async def test_a_not_leader_answer_sends_the_call_to_the_leader_under_the_same_request_id(
    masters: tuple[Master, Master],
) -> None:
    a, b = masters
    locator = Elected(a.address)
    link = LeaderLink(locator, timeout=5.0)
    await link.follow()
    assert link.address == a.address
    a.deposed = True
    locator.leader = b.address
    assert answered_by(await link.call(Stats(), StatsReply)) == 1
    assert len(a.asked) == 1 and b.asked == a.asked  # the master answers a retry once: the same id
    await link.close()


@pytest.mark.parametrize("retry_moved", [False, True])
async def test_one_attempt_goes_on_at_once_to_a_new_leader_only_with_retry_moved(
    masters: tuple[Master, Master], retry_moved: bool
) -> None:
    """What the conductor's lookups ask: one attempt (no time to ride out a failover), but the first
    after a leader died finds its successor, as the blocking Connection's did."""
    a, b = masters
    locator = Elected(a.address)
    link = LeaderLink(locator, timeout=5.0)
    await link.follow()
    await a.stop()
    locator.leader = b.address
    if retry_moved:
        assert answered_by(await link.call(Stats(), StatsReply, retry_for=0.0, retry_moved=True)) == 1
    else:
        with pytest.raises(ConnectionFailed):
            await link.call(Stats(), StatsReply, retry_for=0.0)
        assert not b.asked
    await link.close()


async def test_a_frozen_leader_is_left_for_its_successor_within_the_leader_check(
    masters: tuple[Master, Master],
) -> None:
    a, b = masters
    locator = Elected(a.address)
    link = LeaderLink(locator, timeout=10.0)
    await link.follow()
    a.frozen = True
    locator.leader = b.address  # elected while the call waits on the frozen one
    began = time.monotonic()
    assert answered_by(await link.call(Stats(), StatsReply)) == 1
    took = time.monotonic() - began
    assert a.asked and took < HA_ATTEMPT_S, f"the call took {took:.2f} s: the attempt's timeout, not the check"
    await link.close()


async def test_a_fixed_master_that_does_not_answer_is_given_up_after_the_timeout(
    masters: tuple[Master, Master],
) -> None:
    a, _ = masters
    a.frozen = True
    link = LeaderLink(MasterLocator(a.address), timeout=0.3)
    began = time.monotonic()
    with pytest.raises(Timeout, match="no reply within"):
        await link.call(Stats(), StatsReply)
    assert 0.3 <= time.monotonic() - began < 2.0
    assert len(a.asked) == 1  # a fixed master's silence is not retried: there is no other to ask
    await link.close()


async def test_a_stopped_link_makes_no_call_but_sends_a_notice(masters: tuple[Master, Master]) -> None:
    """A client closing gives back what it holds (single requests) after its calls ended."""
    a, _ = masters
    link = LeaderLink(MasterLocator(a.address), timeout=5.0)
    link.stop()
    with pytest.raises(StoreClosed):
        await link.call(Stats(), StatsReply)
    assert not a.asked
    assert answered_by(await link.request(Stats(), StatsReply)) == 0
    await link.close()


async def test_a_closed_link_stays_closed_though_a_new_leader_is_named(masters: tuple[Master, Master]) -> None:
    a, b = masters
    locator = Elected(a.address)
    link = LeaderLink(locator, timeout=5.0)
    await link.follow()
    a.frozen = True
    call = asyncio.ensure_future(link.call(Stats(), StatsReply))
    while not a.asked:
        await asyncio.sleep(0.01)
    locator.leader = b.address
    began = time.monotonic()
    await link.close()
    with pytest.raises(KVStoreError):  # ended by the close, not by a new leader's answer
        await asyncio.wait_for(call, 2.0)
    assert time.monotonic() - began < 1.0
    with pytest.raises(StoreClosed):
        await link.call(Stats(), StatsReply)
    with pytest.raises(ConnectionFailed, match="is closed"):
        await link.request(Stats(), StatsReply)
    assert b.connections == 0 and link.address == a.address
