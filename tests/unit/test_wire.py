"""Blocking frame I/O over a real socket pair: scatter-gather both ways, timeouts, bad frames."""

from __future__ import annotations

import socket
import threading
import tracemalloc

import numpy as np
import pytest

from kvstore.errors import ConnectionFailed, InvalidArgument, ProtocolError, Timeout
from kvstore.protocol import FRAME_HEADER, ReadBlocks, ReadReply, Stats, StatsReply, encode
from transfer import native
from transfer.rpc import Connection
from transfer.wire import (
    NoRequest,
    io_errors,
    parse_address,
    recv_all_into,
    recv_message,
    recv_parts,
    recv_read_reply,
    send_all,
    send_message,
    set_timeouts,
)


@pytest.fixture(autouse=True, params=["native", "python"])
def _loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here runs through the native loops and through the pure-Python fallback."""
    if request.param == "native" and not native.active():
        pytest.skip(f"the native part is not loaded ({native.reason})")
    monkeypatch.setattr(native, "lib", native.lib if request.param == "native" else None)


def test_scatter_send_and_receive_of_many_uneven_buffers() -> None:
    a, b = socket.socketpair()
    set_timeouts(a, 5)
    set_timeouts(b, 5)
    rng = np.random.default_rng(0)
    # More buffers than IOV_MAX, and more bytes than a socket buffer holds.
    sizes = [int(s) for s in rng.integers(1, 70_000, 1500)]
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dst = [np.zeros(n, dtype=np.uint8) for n in sizes]
    sender = threading.Thread(target=send_all, args=(a, [memoryview(s) for s in src]))
    sender.start()
    recv_all_into(b, [memoryview(d) for d in dst])
    sender.join()
    assert all(np.array_equal(s, d) for s, d in zip(src, dst, strict=True))
    a.close()
    b.close()


def test_a_read_reply_fills_the_matching_targets_and_drops_the_rest_in_step() -> None:
    a, b = socket.socketpair()
    set_timeouts(a, 5)
    set_timeouts(b, 5)
    big = 2_500_000  # a block of another size than asked, larger than the discard scratch: read and dropped
    payload = [b"abc", bytes(big), b"wxyz"]
    reply = ReadReply([3, big, -1, 4], [0, 0, 0, 0])
    sender = threading.Thread(target=lambda: (send_message(a, reply, 1, payload), send_message(a, Stats(), 2)))
    sender.start()
    targets = [memoryview(bytearray(n)) for n in (3, 10, 5, 4)]
    request_id, message = recv_message(b)
    assert request_id == 1
    assert recv_read_reply(message, b, targets, "test") == [True, False, False, True]
    assert (bytes(targets[0]), bytes(targets[3])) == (b"abc", b"wxyz")
    assert recv_message(b) == (2, Stats())  # the stream stayed in step
    sender.join()
    a.close()
    b.close()


def test_frames_round_trip_and_idle_and_eof_are_told_apart() -> None:
    a, b = socket.socketpair()
    set_timeouts(b, 0.05)
    send_message(a, Stats(), 7)
    assert recv_message(b) == (7, Stats())
    with pytest.raises(NoRequest):
        recv_message(b)  # nothing sent: an idle peer, not an error
    a.sendall(FRAME_HEADER.pack(100) + b"x" * 10)
    with pytest.raises(BlockingIOError):
        recv_message(b)  # a frame stalled halfway
    a.close()
    with pytest.raises(ConnectionFailed):
        recv_message(b)
    b.close()


def test_a_frame_that_comes_in_pieces_is_put_together() -> None:
    """A header in pieces, then a payload in pieces: one frame, as if it had come whole; a peer
    gone mid-header or mid-payload is a closed connection."""
    frame = encode(StatsReply({"objects": 3, "bytes": 1 << 40}), 9)
    for cuts in ([1, 3], [4, 7], [2, 6, len(frame) - 1]):
        a, b = socket.socketpair()
        with a, b:
            set_timeouts(b, 2.0)

            def dribble(cuts: list[int] = cuts, a: socket.socket = a) -> None:
                at = 0
                for cut in [*cuts, len(frame)]:
                    a.sendall(frame[at:cut])
                    at = cut
                    threading.Event().wait(0.02)  # each piece its own receive

            sender = threading.Thread(target=dribble, daemon=True)
            sender.start()
            assert recv_message(b) == (9, StatsReply({"objects": 3, "bytes": 1 << 40}))
            sender.join()
    for cut in (2, 6):
        a, b = socket.socketpair()
        with b:
            a.sendall(frame[:cut])
            a.close()
            with pytest.raises(ConnectionFailed, match="mid-message"):
                recv_message(b)


def test_oversize_frame_is_refused_before_reading_it() -> None:
    a, b = socket.socketpair()
    a.sendall(FRAME_HEADER.pack(1 << 30))
    with pytest.raises(ProtocolError, match="exceeds"):
        recv_message(b, max_frame=1 << 20)
    a.close()
    b.close()


@pytest.mark.parametrize("address", ["nohost", "host:", ":80", "host:99999", "host:x"])
def test_bad_addresses(address: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_address(address)


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    """A peer that answers each frame with Stats' reply carrying the request id, over TCP on loopback."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)  # closing a listener does not wake accept(): poll

    def serve() -> None:
        while listener.fileno() != -1:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                set_timeouts(conn, 5)
                try:
                    while True:
                        request_id, _ = recv_message(conn)
                        send_message(conn, StatsReply({"n": request_id}), request_id)
                except (ConnectionFailed, NoRequest, OSError):
                    continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_a_pipelined_reply_read_later_keeps_the_connection_and_an_unread_one_closes_it() -> None:
    listener, thread = _echo_server()
    conn = Connection(f"127.0.0.1:{listener.getsockname()[1]}", timeout=5)
    try:
        with conn.pipelined(Stats()) as pending:
            first = conn._sock
            reply, _ = pending.receive()
            assert isinstance(reply, StatsReply)
        assert conn._sock is first  # read to the end: still in step, kept
        with conn.pipelined(Stats()):
            pass  # never read: the stream is out of step
        assert conn._sock is None
        assert isinstance(conn.call(Stats(), StatsReply), StatsReply)  # and the next call reconnects
        with conn.pipelined(Stats()) as pending:
            pending.abandon()
        assert conn._sock is None
    finally:
        conn.close()
        listener.close()
        thread.join(timeout=5)


def test_a_large_frame_is_received_in_pieces_and_a_stalled_one_holds_only_what_came() -> None:
    a, b = socket.socketpair()
    with a, b:
        set_timeouts(b, 0.5)
        n = 20_000
        big = ReadBlocks([f"k{i}" * 40 for i in range(n)], ["dram"] * n, [0] * n, [1] * n)
        frame = encode(big, 7)
        assert len(frame) > 1 << 20
        threading.Thread(target=a.sendall, args=(frame,), daemon=True).start()
        assert recv_message(b) == (7, big)
        # A header announcing 60 MiB, then 100 KiB, then nothing: a timeout, with no 60 MiB buffer made.
        a.sendall(FRAME_HEADER.pack(60 << 20) + b"\0" * 100_000)
        tracemalloc.start()
        try:
            with pytest.raises(Timeout), io_errors("a stalled frame"):
                recv_message(b)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20


def test_dropped_bytes_take_one_scratch_buffer_whatever_size_is_announced() -> None:
    a, b = socket.socketpair()
    with a, b:
        set_timeouts(b, 0.3)
        keep = memoryview(bytearray(5))
        a.sendall(b"x" * 10 + b"hello" + b"y" * 3)
        recv_parts(b, [10, keep, 3])
        assert bytes(keep) == b"hello"
        # A sender that names 1 TiB to drop and then stalls: a timeout, with no buffer that size.
        a.sendall(b"z" * 1000)
        tracemalloc.start()
        try:
            with pytest.raises(Timeout), io_errors("a stalled drop"):
                recv_parts(b, [1 << 40])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20


def test_abort_ends_a_call_blocked_on_a_peer_that_never_answers() -> None:
    """A daemon stopping while its master link waits on a silent master: the call ends at once
    with ConnectionFailed, not when its 60 s run out, and the connection takes no call after."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    conn = Connection(f"127.0.0.1:{server.getsockname()[1]}", timeout=60)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            conn.call(Stats(), StatsReply)
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    while not accepted:  # the request is on its way: the call is blocked on the reply
        threading.Event().wait(0.01)
    conn.abort()
    caller.join(timeout=30)
    assert not caller.is_alive() and isinstance(outcome[0], ConnectionFailed)
    with pytest.raises(ConnectionFailed, match="closed"):
        conn.call(Stats(), StatsReply)
    server.close()
    for sock in accepted:
        sock.close()
