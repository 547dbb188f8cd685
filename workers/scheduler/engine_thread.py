# The engine on a thread of its own that steps for as long as it has work. The
# scheduler's event loop queues its changes (admissions, aborts), which apply
# between steps on this thread, and takes each step's results in order.

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from workers.scheduler.engine import Engine, EngineRequest, EngineStats, StepResult

STATS_EVERY_S = 0.25  # how stale `stats` may be (the heartbeat's; a step never waits for it)


@dataclass(frozen=True)
class Stepped:
    results: list[StepResult]
    num_changes: int  # changes applied before the step: its results are of those requests


class EngineThread:
    """Steps `engine` back to back on `thread` (the executor's one thread, where
    the engine was built: torch's thread count holds for that thread alone).
    Handed over step by step from the event loop, a step started 0.1-4 ms
    after the last one ended (a thread that slept waits for a core on a busy
    2-core host); this thread only sleeps when the engine has nothing to do.
    Everything here that the loop reads is published under `lock` between steps."""

    def __init__(self, engine: Engine, thread: ThreadPoolExecutor):
        self.engine = engine
        self.thread = thread
        self.results: asyncio.Queue[Stepped | BaseException] = asyncio.Queue()
        self.stats: EngineStats = engine.stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._changes: list[Callable[[], object]] = []
        self._num_adds = 0  # of _changes: they take room the engine has not counted yet
        self._num_changes = 0  # ever queued
        self._num_applied = 0
        self._room = engine.can_admit()
        self._num_unread = 0  # steps started whose results the loop has not taken
        self._has_work = False
        self._is_stopped = False
        self._stats_at = 0.0
        self._done: Future | None = None

    def start(self) -> None:
        """Start stepping; results go to the running event loop's `results`."""
        self._loop = asyncio.get_running_loop()
        self._done = self.thread.submit(self._run)

    def add(self, request: EngineRequest) -> int:
        """Queue `request` for the engine; raises what Engine.add would, here and now.
        Returns the change's number: results of steps with fewer changes applied
        (Stepped.num_changes) are not this request's, though they may bear its id
        (an earlier attempt's, still on its way)."""
        self.engine.check(request)
        return self._change(lambda: self.engine.add(request), is_add=True)

    def abort(self, request_id: str) -> None:
        self._change(lambda: self.engine.abort(request_id))

    def can_admit(self) -> int:
        with self._lock:
            return max(0, self._room - self._num_adds)

    def is_busy(self) -> bool:
        """Whether results are still to come: work, changes, or a step not yet read."""
        with self._lock:
            return self._has_work or bool(self._changes) or self._num_unread > 0

    async def next_results(self) -> Stepped:
        """The next step's results, in step order; raises what the engine raised."""
        results = await self.results.get()
        with self._lock:
            self._num_unread -= 1
        if isinstance(results, BaseException):
            raise results
        return results

    def stop(self) -> None:
        with self._lock:
            self._is_stopped = True
            self._wake.set()

    def _change(self, change: Callable[[], object], is_add: bool = False) -> int:
        with self._lock:
            self._changes.append(change)
            self._num_adds += is_add
            self._num_changes += 1
            self._wake.set()
            return self._num_changes

    def _run(self) -> None:
        try:
            while self._wake.wait():
                due = self._apply_changes()
                if due is None:
                    return
                if due:
                    stepped = Stepped(self.engine.step(), self._num_applied)
                    with self._lock:  # what is left, before the loop can see the results
                        self._room = self.engine.can_admit()
                        self._has_work = self.engine.has_work()
                    self._post(stepped)
                    if time.monotonic() - self._stats_at >= STATS_EVERY_S:
                        self.stats, self._stats_at = self.engine.stats(), time.monotonic()
        except BaseException as error:  # the loop reads it next and raises it
            with self._lock:
                self._has_work = True  # busy for good: the loop waits for results
            self._post(error)

    def _apply_changes(self) -> bool | None:
        """Apply the queued changes; whether a step is due, or None once stopped.
        Changes that leave no work still answer (no results), so that a loop
        waiting for results after queueing them is not left waiting."""
        with self._lock:  # the loop sees changes applied and room counted at once
            if self._is_stopped:
                return None
            changed = bool(self._changes)
            for change in self._changes:
                change()
            self._num_applied += len(self._changes)
            self._changes.clear()
            self._num_adds = 0
            self._room = self.engine.can_admit()
            self._has_work = self.engine.has_work()
            if self._has_work or changed:
                self._num_unread += 1
            if not self._has_work:
                self._wake.clear()  # under the lock: a change queued now sets it again
                self.stats = self.engine.stats()
                if changed:
                    self._post(Stepped([], self._num_applied))
            return self._has_work

    def _post(self, item: Stepped | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
            self._loop.call_soon_threadsafe(self.results.put_nowait, item)
