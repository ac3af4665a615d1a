"""The scheduling priority of the threads that run a round (the app's `round_nice`).

On CPU serving, a round is the engine replica's loop thread and the worker actors' compute threads taking turns on
the same cores, while the node's other processes (Ray's raylet and GCS, Serve's controller and proxy, the replica's
event loop) wake up now and then. Each such wake-up on a core the model computes on stalls one thread of a parallel
region, and the whole region waits for it. At a lower nice value the round's threads preempt those processes instead.
The loop thread takes the same value as the workers: at a higher one, the workers' threads spinning after a
verify keep it from reading the reply.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def set_thread_nice(nice: int | None) -> None:
    """The calling thread's nice value becomes `nice`; threads it starts later inherit it (Linux keeps the value per
    thread and copies it to a new one), so called first in an actor's `__init__` it reaches the channel threads and
    their OpenMP teams, while the threads running before (Ray's) keep theirs. A value below the current one needs
    CAP_SYS_NICE: without it the thread keeps its value, with a warning."""
    if nice is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except PermissionError:
            logger.warning(
                "round_nice=%d needs CAP_SYS_NICE (root); this process's round threads keep nice %d "
                "(round_nice: null leaves them as they are, without this warning)",
                nice,
                os.getpriority(os.PRIO_PROCESS, 0),
            )
