"""The engine replica that serves HTTP itself (`ingress: engine`, the default): the OpenAI API and the engine in one
Serve deployment.

    HTTP ──> Serve's proxy ──> DDTreeServer replica (OpenAI API + Engine + loop thread) ──> target / drafter actors

A streamed chunk then crosses one Ray streaming hop (replica -> proxy) instead of two (engine replica -> ingress
replica -> proxy). Each hop costs a few ms of CPU per chunk across the two processes (docs/serving.md), taken from
the cores the model runs on. Serve's proxy routes each HTTP request to the replica with the fewest ongoing
requests, as the separate ingress's handle would. `ingress: separate` keeps the two deployments
(deployments/ingress.py, deployments/engine_server.py).

`LocalEngine` lets the API code call the engine in its own process exactly as it calls a DeploymentHandle.
"""

from __future__ import annotations

import asyncio
import contextlib

from deployments.config import AppArgs, parse_args
from deployments.engine_server import DDTreeEngine
from deployments.ingress import OpenAIIngress


class _LocalCall:
    """A coroutine of the engine run as a task: awaitable, and `cancel()`-able, like a DeploymentResponse."""

    def __init__(self, coroutine) -> None:
        self._task = asyncio.ensure_future(coroutine)

    def __await__(self):
        return self._task.__await__()

    def cancel(self) -> None:
        self._task.cancel()


class _LocalStream:
    """An async generator of the engine, iterated like a streaming DeploymentResponseGenerator. `cancel()` closes it
    (its `finally` aborts the request on the engine)."""

    def __init__(self, generator) -> None:
        self._generator = generator

    def __anext__(self):
        return self._generator.__anext__()

    def cancel(self) -> None:
        async def close() -> None:
            with contextlib.suppress(RuntimeError):  # (still running in a task being cancelled: it closes itself)
                await self._generator.aclose()

        asyncio.ensure_future(close())


class _LocalMethod:
    def __init__(self, fn, is_stream: bool) -> None:
        self._fn, self._is_stream = fn, is_stream

    def remote(self, *args, **kwargs):
        result = self._fn(*args, **kwargs)
        return _LocalStream(result) if self._is_stream else _LocalCall(result)


class LocalEngine:
    """A DDTreeEngine in this process, behind the part of the DeploymentHandle API the ingress uses
    (`engine.generate.remote(r)`, `engine.options(stream=True).generate_stream.remote(r)`, `ready`, `info`)."""

    def __init__(self, engine: DDTreeEngine) -> None:
        self._engine = engine

    def options(self, stream: bool = False) -> LocalEngine:
        return self

    def __getattr__(self, name: str) -> _LocalMethod:
        if name not in ("generate", "generate_stream", "ready", "info"):
            raise AttributeError(name)
        return _LocalMethod(getattr(self._engine, name), is_stream=name == "generate_stream")


class DDTreeServer(OpenAIIngress):
    """The OpenAI API (HTTP routes, Python handle methods) over an engine in the same replica."""

    async def __init__(self, args: AppArgs | dict) -> None:
        args = parse_args(args)
        # (loading the models blocks: off the event loop, which Serve's own calls need meanwhile)
        self._engine_replica = await asyncio.get_running_loop().run_in_executor(None, DDTreeEngine, args)
        await super().__init__(LocalEngine(self._engine_replica), args)

    async def check_health(self) -> None:
        await self._engine_replica.check_health()
