"""Worker channels (deployments/channel.py) without Ray: calls, order, errors, the token, a closed peer, blocking
waits and polling ones."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import pytest

from deployments.channel import ChannelAddress, ChannelClient, ChannelClosedError, ChannelServer


@pytest.fixture
def echo():
    def handle(message):
        if isinstance(message, dict) and "fail" in message:
            raise KeyError(message["fail"])
        if isinstance(message, dict) and "sleep" in message:
            time.sleep(message["sleep"])
        return ("echo", message)

    server = ChannelServer("node", "echo", handle=handle)
    yield server
    server.close()


def test_calls_come_back_in_order_and_two_can_be_in_flight(echo):
    import numpy as np

    client = ChannelClient(echo.address, "echo")
    assert client.call(1) == ("echo", 1)
    assert not os.path.exists(os.path.dirname(echo.address.path))  # its one peer is in: nothing left on disk
    with pytest.raises(ChannelClosedError, match="cannot reach"):
        ChannelClient(echo.address, "echo")  # and no second peer can connect
    array = np.arange(100_000, dtype=np.float32)  # larger than a socket buffer
    sent_at = time.perf_counter()
    first, second = client.send({"sleep": 0.05}), client.send(array)
    tag, value = client.receive(second)  # read out of order: the first reply is kept for its ticket
    assert tag == "echo" and np.array_equal(value, array)
    second_arrived_at = client.arrived_at
    assert sent_at + 0.05 <= second_arrived_at <= time.perf_counter()
    assert client.receive(first) == ("echo", {"sleep": 0.05})
    assert sent_at + 0.05 <= client.arrived_at <= second_arrived_at  # when it came, not when it was taken
    with pytest.raises(ValueError, match="no reply pending"):
        client.receive(first)
    client.close()


def test_a_handler_error_is_raised_by_the_caller_with_its_traceback(echo):
    client = ChannelClient(echo.address, "echo")
    with pytest.raises(KeyError, match="x") as info:
        client.call({"fail": "x"})
    assert "handle" in str(info.value.__cause__)  # the remote traceback names the function that raised
    assert client.call(2) == ("echo", 2)  # the channel goes on


def test_only_a_peer_with_the_token_is_heard(echo):
    received = []
    server = ChannelServer("node", "guarded", on_message=received.append)
    try:
        wrong = ChannelAddress("node", server.address.path, bytes(16))
        client = ChannelClient(wrong, "guarded")
        with pytest.raises(ChannelClosedError):
            for _ in range(100):  # the server closes the connection; a send then fails
                client.send("not for you")
                time.sleep(0.01)
        assert received == []
        mode = stat.S_IMODE(os.stat(os.path.dirname(server.address.path)).st_mode)
        assert mode == 0o700  # nobody else can even reach the socket
    finally:
        server.close()


def test_one_way_messages_and_the_end_of_the_sender():
    received, closed = [], threading.Event()
    server = ChannelServer("node", "inbox", on_message=received.append, on_close=closed.set)
    try:
        client = ChannelClient(server.address, "inbox")
        for i in range(3):
            client.send(i)
        client.close()
        assert closed.wait(5)
        assert received == [0, 1, 2]
    finally:
        server.close()


@pytest.mark.parametrize("poll_seconds", [0.0, 30.0])  # a caller blocked in the kernel, or polling
def test_a_peer_that_goes_away_mid_call_is_an_error_not_a_hang(poll_seconds):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = f"/tmp/ddtree-test-{os.getpid()}.sock"
    listener.bind(path)
    listener.listen(1)

    def accept_then_die():
        conn, _ = listener.accept()
        conn.recv(64)  # the token and the start of a call, then the process "dies"
        time.sleep(0.1)  # (the caller waits for its reply by now)
        conn.close()

    thread = threading.Thread(target=accept_then_die)
    thread.start()
    try:
        client = ChannelClient(ChannelAddress("node", path, bytes(16)), "doomed", poll_seconds=poll_seconds)
        t0 = time.monotonic()
        with pytest.raises(ChannelClosedError, match="doomed"):
            client.call("anything")
        assert time.monotonic() - t0 < 5
    finally:
        thread.join()
        listener.close()
        os.unlink(path)
    with pytest.raises(ChannelClosedError, match="cannot reach"):
        ChannelClient(ChannelAddress("node", path, bytes(16)), "gone")


def test_a_waiting_server_and_a_waiting_caller_use_no_cpu(echo):
    """Both ends block in the kernel: a worker waiting for its next call, and an engine waiting for a reply,
    leave the cores to the model (Ray Compiled Graph channels keep one busy each)."""
    client = ChannelClient(echo.address, "echo")
    client.call(0)
    t0, cpu0 = time.monotonic(), time.process_time()
    client.call({"sleep": 0.5})  # the caller waits 0.5 s; the server thread sleeps
    time.sleep(0.3)  # the server waits for a call
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    assert wall >= 0.8 and cpu < 0.1, (wall, cpu)


def _polling_echo(poll_seconds: float) -> ChannelServer:
    def handle(message):
        if isinstance(message, dict) and "sleep" in message:
            time.sleep(message["sleep"])
        return ("echo", message)

    return ChannelServer("node", "polling", handle=handle, poll_seconds=poll_seconds)


def test_polling_ends_carry_calls_as_blocking_ones_do():
    import numpy as np

    server = _polling_echo(0.05)
    try:
        client = ChannelClient(server.address, "polling", poll_seconds=0.05)
        assert client.call(1) == ("echo", 1)
        array = np.arange(100_000, dtype=np.float32)  # larger than a socket buffer
        first, second = client.send({"sleep": 0.2}), client.send(array)  # the first outlasts both poll windows
        tag, value = client.receive(second)
        assert tag == "echo" and np.array_equal(value, array)
        assert client.receive(first) == ("echo", {"sleep": 0.2})
        time.sleep(0.1)  # the server's window passed: it blocks, and the next call still wakes it
        assert client.call(2) == ("echo", 2)
        client.close()
    finally:
        server.close()


def test_a_polling_caller_polls_for_its_window_and_then_blocks(echo):
    """The caller's CPU time while it waits for a reply is its poll window, not the whole wait: polling ends that
    wait on a core of their own pay no wake-up, and an idle one burns no CPU past the window."""
    short = ChannelClient(echo.address, "echo", poll_seconds=1.0)
    short.call(0)
    cpu0 = time.process_time()
    short.call({"sleep": 0.2})  # shorter than the window: polled all along
    assert time.process_time() - cpu0 > 0.08
    short.close()


def test_a_polling_caller_blocks_once_its_window_has_passed():
    server = _polling_echo(0.0)
    try:
        client = ChannelClient(server.address, "polling", poll_seconds=0.1)
        client.call(0)
        cpu0 = time.process_time()
        client.call({"sleep": 0.6})  # polled for 0.1 s, then blocked
        cpu = time.process_time() - cpu0
        assert 0.03 < cpu < 0.35, cpu
        client.close()
    finally:
        server.close()


def test_a_polling_server_polls_after_a_reply_and_then_blocks():
    server = _polling_echo(0.2)
    try:
        client = ChannelClient(server.address, "polling")
        client.call(0)
        cpu0 = time.process_time()
        time.sleep(0.6)  # the server's thread (in this process) polls for 0.2 s of it, then blocks
        cpu = time.process_time() - cpu0
        assert 0.08 < cpu < 0.45, cpu
        client.close()
    finally:
        server.close()


@pytest.mark.parametrize("bad", [-0.001, float("inf"), float("nan"), True, "0.1"])
def test_a_bad_poll_window_is_refused(echo, bad):
    with pytest.raises(ValueError, match="poll_seconds"):
        ChannelServer("node", "bad", handle=lambda m: m, poll_seconds=bad)
    with pytest.raises(ValueError, match="poll_seconds"):
        ChannelClient(echo.address, "echo", poll_seconds=bad)
