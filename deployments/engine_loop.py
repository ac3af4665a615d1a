"""Runs an Engine in a background thread and serves its requests to asyncio code.

Only the loop thread ever touches the engine (it is not thread-safe): requests and aborts reach it through an inbox,
and each request's outputs go back through its own asyncio queue on the event loop that asked. The thread steps the
engine while work exists and sleeps on the inbox when there is none. A request's admission errors (bad input, prompt
too long, queue full) come back to its caller before any output.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ddtree.detokenizer import Detokenizer, TextDecoder
from ddtree.outputs import RequestOutput
from ddtree.sampling_params import SamplingParams
from deployments.priority import set_thread_nice

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's round failed: every request in flight fails with this (a server error, never the client's
    fault, whatever the exception inside was), and the loop stops so that the replica's health check fails."""


@dataclass
class _Add:
    prompt: object
    params: SamplingParams
    request_id: str
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future
    outputs: asyncio.Queue


@dataclass
class _Abort:
    request_id: str
    outputs: asyncio.Queue  # the stream's own queue: an abort never touches a newer request that reuses the id


@dataclass
class _Call:
    """Run `fn(engine)` on the loop thread (reads of engine state that must not race a step)."""

    fn: Callable
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass
class _Stop:
    pass


@dataclass
class RoundReport:
    """What one step did, for metrics: its wall time and the outputs it produced."""

    wall_seconds: float
    outputs: list[RequestOutput]
    num_running: int
    num_waiting: int


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


@dataclass
class EngineLoop:
    engine: object  # ddtree.engine.Engine
    on_round: Callable[[RoundReport], None] | None = None
    on_idle: Callable[[], None] | None = None  # called every `idle_every_s` while no round runs (idle, or target lost)
    # decodes the outputs the engine leaves undecoded (`Engine(detokenize=False)`), on each stream's event loop: with
    # a tokenizer of its own, as the loop thread decodes stop strings' outputs at the same time
    detokenizer: Detokenizer | None = None
    idle_every_s: float = 1.0
    # all streams together get about this many outputs per second at most (`stream_interval`); None: no bound
    max_chunks_per_s: float | None = None
    nice: int | None = None  # the loop thread's nice value (the app's `round_nice`; None: the replica's)
    _inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _streams: dict[str, _Stream] = field(default_factory=dict)
    _thread: threading.Thread | None = None
    _ids: itertools.count = field(default_factory=itertools.count)
    error: BaseException | None = None  # set when the loop failed: the engine's state is unknown, the loop stops
    # time.monotonic() when the loop thread's current pass began (inbox items, a step, its callbacks: every worker
    # call it makes); None while it waits for work
    _busy_since: float | None = None
    # Closing and putting are ordered by this lock: after the loop closes its inbox (and fails what is in it),
    # no request can be put there to wait forever.
    _inbox_lock: threading.Lock = field(default_factory=threading.Lock)
    _is_closed: bool = False
    num_callback_errors: int = 0  # on_round / on_idle failures (logged; they never stop the engine)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ddtree-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_Stop())
            if not self._is_closed:  # abandoned: the thread may be stuck in a worker call; nothing waits for it
                self._thread.join(timeout)

    def abandon(self, error: BaseException) -> None:
        """From another thread: give up on the engine (a worker hung inside a round, or one died): every request
        in flight or waiting fails with `error` now, new ones are refused, and the loop thread exits when (if ever)
        its round returns. The replica then holds no request that a graceful stop would wait for."""
        if self.error is None:
            self.error = error
        self._fail_all(error)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def seconds_in_round(self) -> float:
        """How long the loop thread's current pass (a round, with the inbox items and callbacks around it) has run;
        0 while it waits for work. A hung worker shows here, not as an error, whichever call it hangs in."""
        started = self._busy_since
        return 0.0 if started is None else time.monotonic() - started

    # ------------------------------------------------------------------------------------------------------------
    # asyncio side

    async def stream(
        self, prompt: object, params: SamplingParams, request_id: str | None = None, interval_s: float = 0.0
    ) -> AsyncIterator[RequestOutput]:
        """The request's incremental outputs, the last one `finished`. Raises the engine's admission error (ValueError,
        PromptTooLongError, EngineFullError) before the first output. Leaving early aborts the request.

        With `interval_s`, outputs come at most that often: the steps' outputs in between are merged into one
        (`RequestOutput.following`); where the loop bounds its streams' outputs per second, each waits
        `stream_interval` instead. The first output and the last are never held back."""
        loop = asyncio.get_running_loop()
        request_id = request_id or f"loop-{next(self._ids)}"
        add = _Add(prompt, params, request_id, loop, loop.create_future(), asyncio.Queue())
        self._put(add)
        finished = False
        decoder: TextDecoder | None = None
        held: RequestOutput | None = None  # merged outputs not sent yet
        next_send = 0.0  # loop.time() from which the next output may go
        try:
            await add.admitted  # raises the admission error
            while True:
                if held is None:
                    item = await add.outputs.get()
                else:
                    try:
                        item = await asyncio.wait_for(add.outputs.get(), max(0.0, next_send - loop.time()))
                    except asyncio.TimeoutError:
                        item = None
                if isinstance(item, BaseException):
                    raise item
                if item is not None:
                    if item.text_pending:
                        decoder = decoder or self._text_decoder(params)
                        item = decoder.fill(item)
                    held = item if held is None else item.following(held)
                    finished = item.finished
                if held is not None and (finished or loop.time() >= next_send):
                    output, held = held, None
                    next_send = loop.time() + self.stream_interval(interval_s)
                    yield output
                if finished:
                    return
        finally:
            rejected = add.admitted.done() and not add.admitted.cancelled() and add.admitted.exception() is not None
            if not finished and not rejected:
                self._inbox.put(_Abort(request_id, add.outputs))

    def stream_interval(self, interval_s: float) -> float:
        """A stream's wait after an output: `interval_s`, or longer where the open streams would otherwise get more
        than `max_chunks_per_s` outputs per second together (each output wakes the replica's event loop and, over
        HTTP, Serve's proxy: on a CPU shared with the model, every wake-up takes a core from its threads)."""
        if not self.max_chunks_per_s:
            return interval_s
        return max(interval_s, len(self._streams) / self.max_chunks_per_s)

    def _text_decoder(self, params: SamplingParams) -> TextDecoder:
        if self.detokenizer is None:
            raise RuntimeError("the engine left the text undecoded and the loop has no detokenizer")
        return TextDecoder(self.detokenizer, params)

    async def generate(self, prompt: object, params: SamplingParams, request_id: str | None = None) -> RequestOutput:
        final = None
        async for output in self.stream(prompt, params, request_id):
            final = output
        return final

    async def call(self, fn: Callable):
        """`fn(engine)` evaluated on the loop thread, between steps."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._put(_Call(fn, loop, done))
        return await done

    def _put(self, item) -> None:
        with self._inbox_lock:
            if self._is_closed or not self.is_alive:
                raise RuntimeError(f"the engine loop is not running: {self.error!r}")
            self._inbox.put(item)

    # ------------------------------------------------------------------------------------------------------------
    # loop thread

    def _run(self) -> None:
        """The loop thread. Whatever fails in it (a step, or a worker call around one: an abort's, an admission's,
        a callback's) fails every request in flight and stops the loop: no caller is left waiting on a dead thread."""
        set_thread_nice(self.nice)
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - every waiting caller must hear of it
            logger.exception("engine loop failed: failing %d requests and stopping the loop", len(self.engine.requests))
            if self.error is None:
                self.error = exc
            dead = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
            dead.__cause__ = exc
            self._fail_all(dead)
        finally:
            self._busy_since = None

    def _serve(self) -> None:
        engine = self.engine
        while True:
            # Block on the inbox only when there is nothing to step (waking every idle_every_s for on_idle), or
            # when nothing can run until a new target is attached (the replica's health check sends it here).
            item = None
            is_target_lost = engine.target_lost is not None
            if not engine.has_unfinished_requests() or is_target_lost:
                self._busy_since = None
                try:
                    item = self._inbox.get(
                        timeout=self.idle_every_s if self.on_idle is not None or is_target_lost else None
                    )
                except queue.Empty:
                    self._call_back(self.on_idle)
                    if not is_target_lost:
                        continue
            # (with the target lost, a step does nothing but let queued requests time out: it runs once per wake-up)
            self._busy_since = time.monotonic()
            if item is not None and not self._handle(item):
                return
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if not self._handle(item):
                    return
            if not engine.has_unfinished_requests():
                continue
            t0 = time.perf_counter()
            outputs = engine.step()
            wall = time.perf_counter() - t0
            orphans = []
            with self._inbox_lock:
                if self._is_closed:  # abandoned while the round ran: its requests have failed already
                    return
                # One hand-over per event loop and round, not per output: each wakes that loop's thread, whose
                # work then competes with this thread's for the GIL and with the workers for the cores
                deliveries: dict[asyncio.AbstractEventLoop, list] = {}
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        del self._streams[out.request_id]
                    deliveries.setdefault(stream.loop, []).append((stream.outputs, out))
                for loop, items in deliveries.items():
                    if not _notify(loop, _deliver, items):  # the callers' event loop is gone: no one reads them
                        for _, out in items:
                            if not out.finished:
                                self._streams.pop(out.request_id, None)
                                orphans.append(out.request_id)
            for request_id in orphans:  # (a worker call: not under the lock that abandon() takes)
                engine.abort_request(request_id)
            if self.on_round is not None:
                self._call_back(self.on_round, RoundReport(wall, outputs, engine.num_running, engine.num_waiting))

    def _call_back(self, fn: Callable | None, *args) -> None:
        if fn is None:
            return
        try:
            fn(*args)
        except Exception:  # metrics must never stop the engine
            self.num_callback_errors += 1
            logger.exception("%s failed", getattr(fn, "__name__", "a callback"))

    def _handle(self, item) -> bool:
        """Apply one inbox item; False means stop."""
        if self._is_closed:  # abandoned: an item taken before the abandoning thread drained the inbox
            self._fail_item(item, self._closed_error())
            return False
        if isinstance(item, _Stop):
            self._fail_all(RuntimeError("the engine loop stopped"))
            return False
        if isinstance(item, _Add):
            try:
                self.engine.add_request(item.prompt, item.params, request_id=item.request_id)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, nothing was recorded
                _notify(item.loop, _settle, item.admitted, None, exc)
                return True
            with self._inbox_lock:
                is_served = not self._is_closed and _notify(item.loop, _settle, item.admitted, item.request_id, None)
                if is_served:
                    self._streams[item.request_id] = _Stream(item.loop, item.outputs)
            if not is_served:
                if self._is_closed:  # abandoned meanwhile: the caller hears of it first (its worker may be dead)
                    self._fail_item(item, self._closed_error())
                    return False
                self.engine.abort_request(item.request_id)  # its caller's event loop is gone
        elif isinstance(item, _Abort):
            with self._inbox_lock:  # (abandon() may be reading the streams from another thread)
                stream = self._streams.get(item.request_id)
                if stream is not None and stream.outputs is not item.outputs:
                    return True  # a newer request reusing the id (the aborted one has finished): not this abort's
                self._streams.pop(item.request_id, None)
            if item.request_id in self.engine.requests:
                self.engine.abort_request(item.request_id)
        elif isinstance(item, _Call):
            try:
                result, exc = item.fn(self.engine), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, exc = None, e
            _notify(item.loop, _settle, item.done, result, exc)
        return True

    def _closed_error(self) -> BaseException:
        return self.error or RuntimeError("the engine loop stopped")

    def _fail_all(self, exc: BaseException) -> None:
        """Close the inbox, then fail every stream and every caller waiting in it (from the loop thread, or from
        another one through `abandon`: the lock orders it with the loop thread's deliveries and admissions)."""
        with self._inbox_lock:
            self._is_closed = True
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            _notify(stream.loop, stream.outputs.put_nowait, exc)
        while True:  # callers still waiting to be admitted
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._fail_item(item, exc)

    @staticmethod
    def _fail_item(item, exc: BaseException) -> None:
        if isinstance(item, _Add):
            _notify(item.loop, _settle, item.admitted, None, exc)
        elif isinstance(item, _Call):
            _notify(item.loop, _settle, item.done, None, exc)


def _notify(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> bool:
    """Schedule `fn(*args)` on a caller's event loop; False when that loop is closed (its caller is gone, e.g. at
    shutdown), which must not stop the engine's thread."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _deliver(items: list) -> None:
    """On a caller's event loop: each (queue, output) of a round."""
    for outputs, out in items:
        outputs.put_nowait(out)


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():  # the caller went away (cancelled)
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
