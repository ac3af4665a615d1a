"""Admission and membership: which requests wait, which run (request ids and counts only)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


class EngineFullError(RuntimeError):
    """The waiting queue is full: retry later (HTTP 429/503)."""


@dataclass
class Scheduler:
    max_num_seqs: int
    max_waiting: int
    waiting: deque[str] = field(default_factory=deque)
    running: list[str] = field(default_factory=list)

    def add(self, request_id: str) -> None:
        """Queue a request. `max_waiting` counts the requests beyond the free seats: requests that arrive together
        at an idle engine (all queued before the next round admits them) take the free seats first, so a burst of
        max_num_seqs + max_waiting requests is accepted. (Where KV memory, not seats, holds requests back, up to
        max_waiting + the free seats wait.)"""
        free_seats = max(0, self.max_num_seqs - len(self.running))
        if len(self.waiting) >= self.max_waiting + free_seats:
            raise EngineFullError(
                f"the engine's queue is full ({len(self.running)} requests running, {len(self.waiting)} waiting); "
                f"retry later"
            )
        self.waiting.append(request_id)

    def admit(self, allocate: Callable[[list[str]], int]) -> list[str]:
        """Move waiting requests to running, first come first served, while seats and KV memory last.

        `allocate` gets the head of the queue, as many as there are free seats, reserves their KV caches in order and
        answers how many fit; the rest wait (no request overtakes the head of the queue, so a long prompt cannot
        starve)."""
        candidates = list(itertools.islice(self.waiting, max(0, self.max_num_seqs - len(self.running))))
        if not candidates:
            return []
        num_fit = allocate(candidates)
        if not 0 <= num_fit <= len(candidates):
            raise ValueError(f"allocate answered {num_fit} for {len(candidates)} requests")
        admitted = [self.waiting.popleft() for _ in range(num_fit)]
        self.running.extend(admitted)
        return admitted

    def remove(self, request_id: str) -> None:
        if request_id in self.running:
            self.running.remove(request_id)
        elif request_id in self.waiting:
            self.waiting.remove(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
