"""Blocking code over asyncio: one event loop in a background thread, every wait bounded.

``SyncPublisher`` (publishing from threads and WSGI apps) and the Spark data source (which
Spark calls synchronously, on the driver and on executors) both run their NATS work on
a ``LoopThread``. Its loop starts on first use; ``run`` hands a coroutine over and waits
at most its timeout (then cancels it); ``close`` runs a last coroutine (closing the
connection), stops the loop, cancels what is left and joins the thread, each step bounded.
Calls from any thread, or from inside another running loop (a notebook), are alike. After
``fork`` a child never touches its parent's loop: its first call starts its own.

Example::

    bridge = LoopThread("meshforge-spark")
    info = bridge.run(js.stream_info("MESHFORGE_EVENTS"), timeout=5.0)
    bridge.close(timeout=5.0, last=nc.close)
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["BridgeClosed", "BridgeTimeout", "LoopThread"]

T = TypeVar("T")

_LIVE: weakref.WeakSet[LoopThread] = weakref.WeakSet()
_CANCEL_WAIT = 1.0  # at close, how long cancelled leftovers get to finish


class BridgeClosed(RuntimeError):
    """The bridge was closed: nothing runs on it any more."""


class BridgeTimeout(TimeoutError):
    """A call outlived its timeout (and was cancelled); not a TimeoutError of the call's own."""


class LoopThread:
    """One event loop in one daemon thread named ``name``; thread-safe; see the module docstring."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pid = os.getpid()
        _LIVE.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def thread(self) -> threading.Thread | None:
        """The loop's thread, once started (and until closed)."""
        return self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop (started if need be); ``BridgeClosed`` once closed."""
        with self._lock:
            if self._closed:
                coro.close()
                raise BridgeClosed(f"{self.name} is closed")
            if self._pid != os.getpid():
                self._forget()  # the parent's thread does not exist here
            if self._loop is None:
                self._start()
            loop = self._loop
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` and return its result (or raise its error), waiting at most
        ``timeout`` seconds: then it is cancelled and ``BridgeTimeout`` raised."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(f"{self.name}: run() called from its own loop would wait for ever")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.done() and not future.cancelled():
                return future.result(0)  # finished after all, or a TimeoutError of its own
            future.cancel()
            raise BridgeTimeout(f"{self.name}: no result within {timeout:g}s") from None

    def close(
        self, timeout: float = 10.0, last: Callable[[], Coroutine[Any, Any, object]] | None = None
    ) -> None:
        """Run ``last()`` (its error ignored), stop the loop and join the thread, each within
        ``timeout``. Idempotent; in a child after fork it leaves the parent's loop alone."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None or self._pid != os.getpid():
            return
        if last is not None and thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(last(), loop)
            with contextlib.suppress(Exception):  # closing must not fail: the loop stops anyway
                done.result(timeout)
        with contextlib.suppress(RuntimeError):  # the loop already closed itself
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    def _start(self) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        thread = threading.Thread(
            target=_serve, args=(loop, ready), name=f"{self.name}-loop", daemon=True
        )
        thread.start()
        ready.wait()
        self._loop, self._thread = loop, thread

    def _forget(self) -> None:
        """After fork: drop the parent's loop and thread (never touch them)."""
        self._loop = self._thread = None
        self._pid = os.getpid()


def _serve(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    """The thread's body: run the loop until stopped, then end what is left and close it."""
    asyncio.set_event_loop(loop)
    loop.call_soon(ready.set)
    try:
        loop.run_forever()
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left, timeout=_CANCEL_WAIT))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _close_all() -> None:
    for bridge in list(_LIVE):
        bridge.close(timeout=5.0)


def _after_fork_in_child() -> None:
    for bridge in list(_LIVE):
        bridge._lock = threading.Lock()  # another parent thread may have held it at the fork
        bridge._forget()


atexit.register(_close_all)  # imported first, so it runs after its users' own exit hooks
os.register_at_fork(after_in_child=_after_fork_in_child)
