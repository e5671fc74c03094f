"""Two hosts with two shaped links each (network namespaces): slices use both links, and survive one going down."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from bench.netns import NetnsUnavailable, TwoHosts, stop

pytestmark = [pytest.mark.slow, pytest.mark.netns]
BLOCKS, BLOCK_BYTES = 12, 4 << 20  # 48 MiB: about a second over two 200 Mbit/s links


@pytest.fixture
def hosts() -> Iterator[TwoHosts]:
    try:
        two = TwoHosts(links=2, rate="200mbit").up()
    except NetnsUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    try:
        yield two
    finally:
        two.down()


def _client(hosts: TwoHosts, master: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "bench.netns_client", master, "get", "--blocks", str(BLOCKS),
            "--block-bytes", str(BLOCK_BYTES), "--slice-bytes", "1MiB", "--rail-timeout", "1.0"]  # fmt: skip
    client = subprocess.Popen(hosts.exec_args("a", argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert client.stdout is not None
    ready = client.stdout.readline().strip()
    assert ready == "ready", f"client did not get ready: {ready!r}"
    return client


def _result(client: subprocess.Popen[str]) -> dict[str, object]:
    out, _ = client.communicate(timeout=120)
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def _cut_when_busy(hosts: TwoHosts, link: int, sent: int, timeout: float = 30.0) -> None:
    """Take host a's end of ``link`` down once host b has sent ``sent`` bytes over it (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while hosts.tx_bytes("b", link) < sent and time.monotonic() < deadline:
        time.sleep(0.005)
    hosts.set_link("a", link, "down")


def test_a_large_get_uses_both_links_at_once(hosts: TwoHosts, tmp_path: object) -> None:
    master, procs = hosts.start_store(str(tmp_path))
    try:
        client = _client(hosts, master)
        sent_before = [hosts.tx_bytes("b", i) for i in (1, 2)]
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
        result = _result(client)
        sent = [hosts.tx_bytes("b", i) - sent_before[i - 1] for i in (1, 2)]
    finally:
        stop(procs)
    assert result["ok"] is True
    rail_bytes = result["rail_bytes"]
    assert isinstance(rail_bytes, dict) and len(rail_bytes) == 2
    total = BLOCKS * BLOCK_BYTES
    # Each link carried a fair share, by the client's count and by the kernel's counters of each veth.
    assert all(n >= 0.3 * total for n in rail_bytes.values()), rail_bytes
    assert all(n >= 0.3 * total for n in sent), sent


def test_a_link_going_down_mid_get_moves_its_slices_to_the_other_link(hosts: TwoHosts, tmp_path: object) -> None:
    master, procs = hosts.start_store(str(tmp_path))
    try:
        client = _client(hosts, master)
        assert client.stdin is not None
        # Cut the second link once it has carried some of the get (a timer raced the client's start under load).
        cut = threading.Thread(target=_cut_when_busy, args=(hosts, 2, hosts.tx_bytes("b", 2) + (8 << 20)))
        client.stdin.write("go\n")
        client.stdin.flush()
        start = time.monotonic()
        cut.start()
        result = _result(client)
        cut.join()
    finally:
        stop(procs)
    assert result["ok"] is True, result  # every byte, checked against the block's checksum and the source
    rail_bytes = result["rail_bytes"]
    assert isinstance(rail_bytes, dict)
    first, second = (rail_bytes[a] for a in sorted(rail_bytes))
    assert first > second > 0, rail_bytes  # the second link carried some before it went down
    assert result["paused"] == [sorted(rail_bytes)[1]]  # it kept failing: resting, to be probed after a cooldown
    assert time.monotonic() - start < 60
