"""Worker channels (deployments/channel.py) without Ray: calls, order, errors, the token, a closed peer, no spinning."""

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
    first, second = client.send({"sleep": 0.05}), client.send(array)
    tag, value = client.receive(second)  # read out of order: the first reply is kept for its ticket
    assert tag == "echo" and np.array_equal(value, array)
    assert client.receive(first) == ("echo", {"sleep": 0.05})
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


def test_a_peer_that_goes_away_mid_call_is_an_error_not_a_hang():
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = f"/tmp/ddtree-test-{os.getpid()}.sock"
    listener.bind(path)
    listener.listen(1)

    def accept_then_die():
        conn, _ = listener.accept()
        conn.recv(64)  # the token and the start of a call, then the process "dies"
        conn.close()

    thread = threading.Thread(target=accept_then_die)
    thread.start()
    try:
        client = ChannelClient(ChannelAddress("node", path, bytes(16)), "doomed")
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
