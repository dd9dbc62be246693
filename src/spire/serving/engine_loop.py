"""The engine thread of ``spire serve``: one thread steps the :class:`~spire.engine.engine.Engine` while it has
work and hands each output to the callback its request was submitted with (:class:`EngineLoop`); the thread that
runs a server's torch work (:func:`torch_thread`); the C heap given back when idle (:func:`trim_heap`)."""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from spire.engine.engine import Engine
from spire.engine.scheduler import RequestOutput
from spire.params import RequestParams

log = logging.getLogger("spire.serve")


def torch_thread() -> ThreadPoolExecutor:
    """The one thread that runs a server's torch work, in order: loading, calibration, then the engine loop.

    Every OS thread that runs an OpenMP parallel region gets a team of its own; with two teams (a model loaded on
    the main thread, then stepped on an engine thread) libgomp counts more threads than cores and stops spinning
    between regions, and a decode step, hundreds of short regions, pays a wake-up for each: SmolLM2 AD on 2
    cores took 27 ms a step on a second thread against 21 ms on the thread that loaded it."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="spire-engine")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``; nothing where libc is not
    glibc). Returns whether it ran. The engine loop calls it once the engine has been idle for half a second (so
    never under sustained load, where the pages would be faulted back in at once): freed prefill
    activations and oneDNN's scratch leave free holes in glibc's heap that it keeps resident (a load of 150 requests
    of 128-1,710 tokens at concurrency 16 left ~330 MB of them, which this returned; a call costs milliseconds)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class EngineLoop:
    """The engine thread: :meth:`Engine.step` while there is work, each output handed to the callback its request
    was submitted with (called on the engine thread). Thread-safe :meth:`submit` / :meth:`abort`. runner: the
    thread to step on (:func:`torch_thread`; the one that built the engine, so torch runs on one thread), else a
    new one."""

    def __init__(self, engine: Engine, runner: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self._subs: dict[int, Callable[[RequestOutput], None]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.runner = runner if runner is not None else torch_thread()
        self._running: Future | None = None

    def start(self) -> None:
        self._running = self.runner.submit(self._run)

    def alive(self) -> bool:
        return self._running is not None and not self._running.done()

    def submit(self, prompt: list[int], params: RequestParams, callback: Callable[[RequestOutput], None]) -> int:
        """Queue a request (Engine.add_request; its ConfigError passes through). Returns its id."""
        with self._lock:
            rid = self.engine.add_request(prompt, params)
            self._subs[rid] = callback
        self._wake.set()
        return rid

    def submit_many(self, prompt: list[int], params: list[RequestParams],
                    callbacks: list[Callable[[RequestOutput], None]], texts=None) -> list[int]:
        """Queue one request per settings, all of one prompt, at once (Engine.add_requests: they join together and
        share the prefill; its ConfigError passes through, nothing queued). texts: each request's output processor
        (:class:`~spire.engine.output.TextStream`), which the engine's stop-string check shares. Returns their ids."""
        with self._lock:
            rids = self.engine.add_requests(prompt, params, texts)
            self._subs.update(zip(rids, callbacks))
        self._wake.set()
        return rids

    def abort(self, rid: int) -> None:
        self.engine.abort(rid)
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every submitted request; each finishes at the next step with finish_reason "abort"."""
        with self._lock:
            for rid in list(self._subs):
                self.engine.abort(rid)
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every request, end the thread (within ``timeout`` seconds)."""
        self.abort_all()
        self._stop = True
        self._wake.set()
        if self.alive():
            try:
                self._running.result(timeout)
            except Exception:  # a timeout, or the loop's own failure (already logged): the server is stopping
                pass

    def _run(self) -> None:
        trimmed = True
        while True:
            if self._stop and not self.engine.has_work():
                return
            if not self.engine.has_work():
                woke = self._wake.wait(0.5)
                self._wake.clear()
                if not woke and not trimmed:  # idle for half a second: no request waits on this
                    trim_heap()
                    trimmed = True
                continue
            trimmed = False
            try:
                outputs = self.engine.step()
            except Exception:  # a bug must not hang every client: fail the requests, keep serving
                log.exception("engine step failed; aborting every running request")
                outputs = self._fail_all()
            with self._lock:
                for out in outputs:
                    cb = self._subs.pop(out.request_id, None) if out.finished else self._subs.get(out.request_id)
                    if cb is not None:
                        cb(out)

    def _fail_all(self) -> list[RequestOutput]:
        eng = self.engine
        for rid in eng.status().requests:
            eng.abort(rid)
        return [RequestOutput(o.request_id, [], True, "error") for o in eng.step() if o.finished]
