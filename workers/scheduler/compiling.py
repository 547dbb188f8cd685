# Structured requests whose grammar is not compiled yet wait here while it compiles on
# a thread of its own (xgrammar releases the GIL), so that the scheduler's steps go on
# meanwhile: a large schema takes seconds. Each comes out with its grammar kept for the
# engine, or with the error that refuses it (a bad schema, or a compile past the limit).
#
# One compile runs at a time, one per distinct structure: requests that ask for the same
# one share it. Its limit counts from its own start, so a request never pays for the
# compile ahead of it. A compile past the limit is refused with every request waiting for
# it; its structure is remembered as too slow (asked again, it is refused at once rather
# than compiled again), and it runs on to its end on the thread it has (xgrammar cannot be
# stopped) while a fresh thread takes the next. The scheduler's process exits without
# waiting for such a compile (`abandoned`; role.py).

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from pipeline.errors import InvalidRequest, PipelineError
from pipeline.messages import Structure
from workers.scheduler.grammar import Grammars, field_of
from workers.scheduler.held import Running

TOO_SLOW_KEPT = 256  # structures remembered as too slow, least recently asked dropped

log = logging.getLogger(__name__)


class Compiles:
    def __init__(self, grammars: Grammars):
        self.grammars = grammars
        self._thread = _grammar_thread()
        self._waiting: dict[Structure, list[Running]] = {}  # in arrival order
        # the compile under way: its structure, its outcome to come, when it began
        self._current: tuple[Structure, asyncio.Future, float] | None = None
        self._too_slow: OrderedDict[Structure, float] = OrderedDict()  # -> the limit it missed
        self._abandoned: list[asyncio.Future] = []  # compiles past their limit, running on

    def __contains__(self, request_id: str) -> bool:
        return any(run.submit.request_id == request_id
                   for runs in self._waiting.values() for run in runs)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def needed(self, structure: Structure | None) -> bool:
        return structure is not None and not self.grammars.ready(structure)

    def start(self, run: Running) -> None:
        """`run` waits for its structure's grammar; InvalidRequest for a structure that
        missed the limit before."""
        structure = run.submit.sampling.structure
        if (limit_s := self._too_slow.get(structure)) is not None:
            self._too_slow.move_to_end(structure)
            raise _too_slow(structure, limit_s)
        self._waiting.setdefault(structure, []).append(run)
        self._begin_next()

    def done(self, limit_s: float) -> list[tuple[Running, PipelineError | None]]:
        """The runs whose wait is over: compiled (None; the grammar kept), or refused
        (its error; a compile past `limit_s` runs on, unkept)."""
        if self._current is None:
            return []
        structure, compiling, began = self._current
        if not compiling.done() and time.monotonic() - began < limit_s:
            return []
        self._current = None
        error = None
        if not compiling.done():
            error = _too_slow(structure, limit_s)
            self._too_slow[structure] = limit_s
            while len(self._too_slow) > TOO_SLOW_KEPT:
                self._too_slow.popitem(last=False)
            self._thread.shutdown(wait=False)  # its compile ends there, unheeded
            self._thread = _grammar_thread()
            self._abandoned = [*(f for f in self._abandoned if not f.done()), compiling]
        elif isinstance(compiling.exception(), PipelineError):
            error = compiling.exception()
        elif compiling.exception() is not None:  # not a schema's fault: a bug of ours
            log.error("a grammar failed to compile", exc_info=compiling.exception())
            error = PipelineError(f"{field_of(structure)} could not be compiled")
        else:
            self.grammars.keep(structure, compiling.result())
        runs = self._waiting.pop(structure)
        self._begin_next()
        return [(run, error) for run in runs]

    def abandoned(self) -> bool:
        """Whether a compile past its limit is still running: its thread would hold
        back the process's exit until it ends (Python joins an executor's threads)."""
        return any(not compiling.done() for compiling in self._abandoned)

    async def wait(self, timeout_s: float) -> None:
        """Until the compile under way ends, `timeout_s` at most."""
        if self._current is not None:
            await asyncio.wait([self._current[1]], timeout=timeout_s)

    def _begin_next(self) -> None:
        if self._current is not None or not self._waiting:
            return
        structure = next(iter(self._waiting))
        compiling = asyncio.get_running_loop().run_in_executor(
            self._thread, self.grammars.compile, structure)
        compiling.add_done_callback(_retrieved)  # it may be abandoned by then
        self._current = (structure, compiling, time.monotonic())


def _grammar_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="grammar")


def _too_slow(structure: Structure, limit_s: float) -> InvalidRequest:
    return InvalidRequest(f"{field_of(structure)} did not compile within {limit_s:g} s",
                          param=field_of(structure))


def _retrieved(future: asyncio.Future) -> None:
    """A compile's outcome, taken so asyncio does not log an abandoned one's as lost."""
    if not future.cancelled():
        future.exception()
