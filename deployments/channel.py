"""Worker channels: messages between the processes of one engine replica over Unix domain sockets.

An engine replica calls its target and drafter actors every round. A Ray actor call pays for scheduling and gRPC, a
noticeable share of a CPU round (docs/serving.md); Ray Compiled Graph channels are cheaper but busy-wait: each idle
actor, and the caller waiting for a reply, keeps a core at 100%, which on a CPU replica takes the cores the target
computes on. These channels block in the kernel by default (a `recv` on a socket): a call costs two process wake-ups
and no CPU while nothing happens.

A process that slept through a round waits for the kernel to wake it (on a VM, for its halted virtual CPU to be
resumed), part of what a call costs (docs/serving.md). Where each process waits on a core of its own (the workers on
GPUs, with whole CPUs reserved for the replica and each worker), a channel end can poll instead (`poll_seconds`, the
app's `channel_poll_ms`): it checks the socket without blocking until a message is there, for at most that long after
it began to wait, and then blocks as before, so an idle replica burns no CPU beyond that window. On a CPU replica the
waiting processes would poll on the cores the model computes on, so there every end blocks.

A message is an 8-byte length and the bytes of a codec: a pickle (protocol 5) by default, or the worker
operations' own encoding (deployments/worker_ops.py: `WireCodec`), which sends a round's calls and replies as
msgpack lists because a pickle is decoded slowly right after a model pass has evicted the interpreter's data from the
CPU caches. Only processes of the same replica speak here: each
server listens in a folder only its user can enter (`mkdtemp`, mode 0700), and a connection must first send the
server's random 16-byte token (handed over by a Ray actor call), so nothing is unpickled from anyone else. Unix
sockets need one node: the replica's placement group is STRICT_PACK.
"""

from __future__ import annotations

import collections
import hmac
import os
import pickle
import secrets
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ddtree.workers import WorkerLostError

_HEADER = struct.Struct("!Q")
_TOKEN_BYTES = 16
_HANDSHAKE_TIMEOUT_S = 10.0


class ChannelClosedError(WorkerLostError):
    """The process at the other end of a channel is gone (an actor died) or closed it."""


@dataclass(frozen=True)
class ChannelAddress:
    node_id: str  # the Ray node the server runs on (a Unix socket reaches no other)
    path: str
    token: bytes


@dataclass
class _Failure:
    """A handler's exception, sent back in place of its reply."""

    error: BaseException | None
    description: str  # type, message and the remote traceback


class Codec(Protocol):
    """Turns a message into bytes and back. Both ends of a channel must use the same codec."""

    def encode(self, message: object) -> bytes: ...

    def decode(self, data: bytearray) -> object: ...


class PickleCodec:
    def encode(self, message: object) -> bytes:
        return pickle.dumps(message, protocol=5)

    def decode(self, data: bytearray) -> object:
        return pickle.loads(data)


PICKLE = PickleCodec()


def _send(sock: socket.socket, message: object, codec: Codec) -> None:
    data = codec.encode(message)
    # One write: the length and the message reach the peer together, so its read of the length never wakes it
    # before the rest has arrived (two writes can cost the receiver a second sleep and wake-up)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytearray:
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    received = 0
    while received < num_bytes:
        n = sock.recv_into(view[received:])
        if n == 0:
            raise EOFError("the channel closed")
        received += n
    return buffer


def _recv(sock: socket.socket, poller: _Poller | None, codec: Codec) -> tuple[object, float]:
    """The next message, and time.perf_counter() when its first bytes were read (what follows is reading the rest
    and decoding it)."""
    if poller is not None:
        poller.wait()
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    arrived_at = time.perf_counter()
    return codec.decode(_recv_exact(sock, size)), arrived_at


def check_poll_seconds(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"poll_seconds must be a finite number >= 0, got {value!r}")


class _Poller:
    """Waits for a socket to become readable by polling it, for at most `poll_seconds` (a closed peer makes it
    readable too: its read then ends the channel as a blocking read would)."""

    def __init__(self, sock: socket.socket, poll_seconds: float) -> None:
        self.poll_seconds = poll_seconds
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def wait(self) -> None:
        """Until the socket is readable or the window has passed (the read after it then blocks)."""
        deadline = time.perf_counter() + self.poll_seconds
        while not self._poll.poll(0):  # (each poll is a system call: other threads get the GIL in between)
            if time.perf_counter() >= deadline:
                return


def _poller(sock: socket.socket, poll_seconds: float) -> _Poller | None:
    return _Poller(sock, poll_seconds) if poll_seconds > 0 else None


class ChannelServer:
    """Listens on a Unix socket and serves its one peer on a thread of its own (the first connection that sends the
    token; the socket's folder is removed then, so no other can connect).

    With `handle`, each message gets `handle(message)`'s return value as its reply (an exception goes back as a
    failure the client raises). With `on_message` instead, messages are one-way: `on_message(message)` for each, and
    `on_close()` when the sender goes away. `poll_seconds`: how long the server polls for the next message before it
    blocks; `codec`: how messages are encoded (module docstring)."""

    def __init__(
        self,
        node_id: str,
        name: str,
        handle: Callable[[object], object] | None = None,
        on_message: Callable[[object], None] | None = None,
        on_close: Callable[[], None] | None = None,
        poll_seconds: float = 0.0,
        codec: Codec = PICKLE,
    ) -> None:
        if (handle is None) == (on_message is None):
            raise ValueError("give exactly one of handle (request/reply) and on_message (one-way)")
        check_poll_seconds(poll_seconds)
        self.poll_seconds = poll_seconds
        self.codec = codec
        self._dir = tempfile.mkdtemp(prefix="ddtree-channel-")  # mode 0700: only this user may connect
        path = os.path.join(self._dir, name)
        self.address = ChannelAddress(node_id, path, secrets.token_bytes(_TOKEN_BYTES))
        self._handle, self._on_message, self._on_close = handle, on_message, on_close
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(4)
        self._thread = threading.Thread(target=self._serve, name=f"ddtree-channel-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(_HANDSHAKE_TIMEOUT_S)  # (a peer that sends nothing must not hold the server)
                try:
                    token = _recv_exact(conn, _TOKEN_BYTES)
                except (EOFError, OSError):
                    continue
                if not hmac.compare_digest(bytes(token), self.address.token):
                    continue  # (nothing from it is unpickled)
                conn.settimeout(None)
                # Each channel has one peer: once it is in, the socket's folder goes (a process killed later leaves
                # nothing behind in the file system; the connection lives on)
                shutil.rmtree(self._dir, ignore_errors=True)
                self._converse(conn)

    def _converse(self, conn: socket.socket) -> None:
        poller = _poller(conn, self.poll_seconds)
        while True:
            try:
                message, _ = _recv(conn, poller, self.codec)
            except (EOFError, OSError):
                if self._on_close is not None:
                    self._on_close()
                return
            if self._on_message is not None:
                self._on_message(message)
                continue
            try:
                reply = self._handle(message)
            except BaseException as exc:  # noqa: BLE001 - the caller raises it
                reply = _Failure(
                    exc if _picklable(exc) else None,
                    "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                )
            try:
                _send(conn, reply, self.codec)
            except OSError:
                return

    def close(self) -> None:
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _picklable(exc: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure means: send its description only
        return False
    return True


class ChannelClient:
    """The calling end of a channel. Calls may be in flight several at once; replies come back in order.
    `name` says in errors what is behind it ("target worker"). One thread uses a client at a time. `poll_seconds`:
    how long a wait for a reply polls before it blocks; `codec`: the server's (module docstring)."""

    def __init__(self, address: ChannelAddress, name: str, poll_seconds: float = 0.0, codec: Codec = PICKLE) -> None:
        check_poll_seconds(poll_seconds)
        self.name = name
        self.codec = codec
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(address.path)
            self._sock.sendall(address.token)
        except OSError as exc:
            self._sock.close()
            raise ChannelClosedError(f"cannot reach the {name} at {address.path}: {exc}") from exc
        self._poller = _poller(self._sock, poll_seconds)
        self._num_sent = 0
        self._num_received = 0
        self._replies: collections.deque = collections.deque()  # received, not yet taken: (index, reply, arrived_at)
        # time.perf_counter() when the last reply `receive` returned began to arrive (its decoding came after)
        self.arrived_at = 0.0

    def send(self, message: object) -> int:
        """Send; the returned ticket names the reply for `receive` (request/reply servers)."""
        try:
            _send(self._sock, message, self.codec)
        except OSError as exc:
            raise ChannelClosedError(f"the channel to the {self.name} closed: {exc}") from exc
        self._num_sent += 1
        return self._num_sent - 1

    def receive(self, ticket: int) -> object:
        """The reply to the message `send` returned `ticket` for (replies to earlier tickets are kept for theirs)."""
        for i, (index, reply, arrived_at) in enumerate(self._replies):
            if index == ticket:
                del self._replies[i]
                self.arrived_at = arrived_at
                return _unwrap(reply, self.name)
        if not self._num_received <= ticket < self._num_sent:  # (below: its reply was taken already)
            raise ValueError(f"no reply pending for ticket {ticket}")
        while True:
            try:
                reply, arrived_at = _recv(self._sock, self._poller, self.codec)
            except (EOFError, OSError) as exc:
                raise ChannelClosedError(f"the channel to the {self.name} closed (its actor died?): {exc}") from exc
            index = self._num_received
            self._num_received += 1
            if index == ticket:
                self.arrived_at = arrived_at
                return _unwrap(reply, self.name)
            self._replies.append((index, reply, arrived_at))

    def call(self, message: object) -> object:
        return self.receive(self.send(message))

    def close(self) -> None:
        self._sock.close()


def _unwrap(reply: object, name: str) -> object:
    if isinstance(reply, _Failure):
        if reply.error is not None:
            raise reply.error from RemoteTraceback(reply.description)
        raise RuntimeError(f"the {name} failed:\n{reply.description}")
    return reply


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the `__cause__` of the one re-raised here)."""
