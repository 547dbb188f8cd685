# Structured requests whose grammar is not compiled yet wait here while it compiles on
# a thread of its own (xgrammar releases the GIL), so that the scheduler's steps go on
# meanwhile: a large schema takes seconds. Each comes out with its grammar kept for the
# engine, or with the error that refuses it (a bad schema, or a compile past the limit).

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from pipeline.errors import InvalidRequest, PipelineError
from pipeline.messages import Structure
from workers.scheduler.grammar import Grammars, field_of
from workers.scheduler.held import Running

COMPILE_LIMIT_S = 10.0  # a structure's grammar compiles within this (from its arrival)


class Compiles:
    def __init__(self, grammars: Grammars):
        self.grammars = grammars
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._waiting: dict[str, tuple[asyncio.Future, Running, float]] = {}  # request id ->

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def needed(self, structure: Structure | None) -> bool:
        return structure is not None and not self.grammars.ready(structure)

    def start(self, run: Running) -> None:
        compiling = asyncio.get_running_loop().run_in_executor(
            self._thread, self.grammars.compile, run.submit.sampling.structure)
        compiling.add_done_callback(_retrieved)  # its request may be gone by then
        self._waiting[run.submit.request_id] = (compiling, run, time.monotonic())

    def done(self, limit_s: float) -> list[tuple[Running, PipelineError | None]]:
        """The runs whose wait is over: compiled (None; the grammar kept), or refused
        (its error; a compile past `limit_s` runs on, unkept)."""
        now, over = time.monotonic(), []
        for request_id, (compiling, run, began) in list(self._waiting.items()):
            if not compiling.done() and now - began < limit_s:
                continue
            del self._waiting[request_id]
            structure = run.submit.sampling.structure
            if not compiling.done():
                over.append((run, InvalidRequest(f"{field_of(structure)} did not compile "
                                                 f"within {limit_s:g} s",
                                                 param=field_of(structure))))
            elif isinstance(error := compiling.exception(), PipelineError):
                over.append((run, error))
            else:
                self.grammars.keep(structure, compiling.result())
                over.append((run, None))
        return over

    async def wait(self, timeout_s: float) -> None:
        """Until a compile ends, `timeout_s` at most."""
        await asyncio.wait([compiling for compiling, *_ in self._waiting.values()],
                           timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)


def _retrieved(future: asyncio.Future) -> None:
    """A compile's outcome, taken so asyncio does not log an abandoned one's as lost."""
    if not future.cancelled():
        future.exception()
