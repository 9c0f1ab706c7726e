"""Built-in verifiers in worker processes that can be killed.

A verifier call on one sample has a time budget. A thread cannot be stopped, so the
verifiers run in a few worker processes of the service's own: a worker still busy at the
deadline is killed and replaced, that sample fails with "verifier timeout", and the other
samples go on. Only plain data crosses to a worker, as JSON: the verifier's name (looked up
in a table of import paths fixed when the pool is built, never taken from a request) and
the sample's response, label and metadata; the reply is a number or an error message.

Workers are forked from multiprocessing's fork server, which has the verifiers and sympy
imported already: a replacement is ready in milliseconds, and no worker inherits the
service's threads (gRPC, asyncio), as a plain fork of the service would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import select
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from rlmesh.common.plugins import load_plugin
from rlmesh.reward.verifiers import VERIFIERS

log = logging.getLogger(__name__)

# Name -> import path of each built-in verifier: workers load verifiers the way every
# plug-in is loaded, by a path the service was configured with.
BUILTIN_VERIFIERS: dict[str, str] = {name: f"{fn.__module__}:{fn.__name__}" for name, fn in VERIFIERS.items()}

_CONTEXT = multiprocessing.get_context("forkserver")
# What the fork server imports once, so that every worker starts with it.
_PRELOAD = [__name__, "sympy", "sympy.parsing.sympy_parser"]
_READY_TIMEOUT_SECONDS = 120.0  # the first worker waits for the fork server to import sympy
_RESTART_DELAY_SECONDS = 1.0
_MAX_BATCH = 8  # calls sent to a worker at once: fewer messages, and still a deadline per call
_MAX_ERROR_CHARS = 1000


class VerifierError(Exception):
    """A verifier gave no score for a sample (it raised, ran out of time, or its worker
    died); the message is the reason the sample fails with, `cause` its kind (a word from
    a short list: raised, timeout, worker_died, stopping; counted in the metrics)."""

    def __init__(self, message: str, cause: str = "raised") -> None:
        super().__init__(message)
        self.cause = cause


def _serve(conn: Connection, verifiers: dict[str, str]) -> None:
    """A worker: a batch of requests in, one reply per request out as each is done, until
    the pool closes its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the service decides
    table = {name: load_plugin(path) for name, path in verifiers.items()}
    try:  # sympy's parser builds its tables on first use: not on a sample's budget
        VERIFIERS["math"](r"\boxed{\frac{1}{2}}", "0.5", {})
    except Exception:
        log.warning("verifier worker warm-up failed", exc_info=True)
    conn.send_bytes(b"ready")
    while True:
        try:
            batch = json.loads(conn.recv_bytes())
        except EOFError:  # the pool closed, or the service is gone
            return
        for name, response, label, metadata in batch:
            try:
                reply = json.dumps({"value": table[name](response, label, metadata)})
            except Exception as e:
                reply = json.dumps({"error": f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]})
            conn.send_bytes(reply.encode())


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection

    def kill(self) -> None:
        # The fork server, the worker's parent, reaps it.
        self.process.kill()
        self.conn.close()


@dataclass(eq=False)
class _Call:
    request: bytes  # JSON: [name, response, label, metadata]
    name: str
    future: asyncio.Future
    queued_at: float


def _kill_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.kill()
    workers.clear()


def _result(name: str, reply: dict[str, Any]) -> Any:
    return VerifierError(f"{name} raised {reply['error']}") if "error" in reply else reply["value"]


def _resolve(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if not future.done():  # the caller may have gone (cancelled)
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


class VerifierPool:
    """`workers` processes that run verifiers by name, each call within `timeout_seconds`.

    Calls queue in order; a free worker takes a few at once (one message out, one reply per
    call back, each call with its own deadline). `overloaded()` is true while a call has
    waited longer than `overload_seconds` for a worker; `on_overload(overloaded)` is awaited
    when that changes (the service sets its gRPC health with it). The workers start with
    `start()` (or the first call) in the running event loop, which the pool then belongs
    to; they end with `close()`, or when the pool is garbage. While idle the pool runs no
    task at all."""

    def __init__(
        self,
        workers: int,
        timeout_seconds: float,
        overload_seconds: float,
        verifiers: dict[str, str] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"a verifier pool needs at least one worker, got {workers}")
        self.size = workers
        self.timeout_seconds = timeout_seconds
        self.overload_seconds = overload_seconds
        self.verifiers = dict(BUILTIN_VERIFIERS if verifiers is None else verifiers)
        self._started = False
        self._closed = False
        self._pending: deque[_Call] = deque()
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._tasks: set[asyncio.Task] = set()  # running batches and starting workers; none while idle
        self.on_overload: Callable[[bool], Coroutine[Any, Any, None]] | None = None
        self._reported_overload = False
        self._watch_timer: asyncio.TimerHandle | None = None
        weakref.finalize(self, _kill_all, self._live)

    def start(self) -> None:
        """Start the workers in the background; calls made meanwhile wait for them."""
        if self._closed:
            raise RuntimeError("the verifier pool is closed")
        if not self._started:
            self._started = True
            for _ in range(self.size):
                self._spawn(self._add_worker())

    def close(self) -> None:
        self._closed = True
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        _kill_all(self._live)
        self._idle.clear()
        while self._pending:
            call = self._pending.popleft()
            _resolve(call.future, error=VerifierError(f"{call.name}: the reward service is stopping", "stopping"))

    def overloaded(self) -> bool:
        """True while a call has waited longer than overload_seconds for a free worker."""
        oldest = next((c.queued_at for c in self._pending if not c.future.done()), None)
        return oldest is not None and time.monotonic() - oldest > self.overload_seconds

    async def verify(self, name: str, response: str, label: str, metadata: dict[str, Any]) -> Any:
        """The verifier's result for one sample; raises VerifierError when there is none."""
        (result,) = await self.verify_many([(name, response, label, metadata)])
        if isinstance(result, VerifierError):
            raise result
        return result

    async def verify_many(self, calls: list[tuple[str, str, str, dict[str, Any]]]) -> list[Any]:
        """The result of each (verifier name, response, label, metadata), in order: a
        verifier's value, or a VerifierError saying why there is none. One await for a
        whole request: no task per sample."""
        if self._closed:
            error = VerifierError("the reward service is stopping; its verifier workers are closed", "stopping")
            return [error for _ in calls]
        self.start()
        loop, now = asyncio.get_running_loop(), time.monotonic()
        queued = [_Call(json.dumps(c).encode(), c[0], loop.create_future(), now) for c in calls]
        self._pending.extend(queued)
        self._dispatch()
        if self._pending:
            self._arm_watch()
        replies = await asyncio.gather(*(c.future for c in queued), return_exceptions=True)
        return [r if isinstance(r, BaseException) else _result(c.name, r) for c, r in zip(queued, replies)]

    def _arm_watch(self) -> None:
        if self._watch_timer is None and self.on_overload is not None and not self._closed:
            interval = min(0.5, self.overload_seconds / 4)
            self._watch_timer = asyncio.get_running_loop().call_later(interval, self._watch)

    def _watch(self) -> None:
        """A timer, armed while calls wait or overload is reported: report changes of overloaded()."""
        self._watch_timer = None
        overloaded = self.overloaded()
        if overloaded != self._reported_overload and self.on_overload is not None:
            self._reported_overload = overloaded
            self._spawn(self.on_overload(overloaded))
        if self._pending or self._reported_overload:
            self._arm_watch()

    # ------------------------------------------------------------ dispatch

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _dispatch(self) -> None:
        while self._pending and self._idle:
            self._spawn(self._drain(self._idle.pop()))

    def _take(self) -> list[_Call]:
        """The next calls for one worker: a share of the queue, at most _MAX_BATCH."""
        size = max(1, min(_MAX_BATCH, len(self._pending) // self.size))
        batch: list[_Call] = []
        while self._pending and len(batch) < size:
            call = self._pending.popleft()
            if not call.future.done():
                batch.append(call)
        return batch

    async def _drain(self, worker: _Worker) -> None:
        """Run batches on `worker` while calls are queued, then leave it idle."""
        while batch := self._take():
            if not await self._run_batch(worker, batch):
                return  # killed; a replacement is starting
        self._idle.append(worker)

    async def _run_batch(self, worker: _Worker, batch: list[_Call]) -> bool:
        """Send the batch, collect one reply per call. A call past its deadline fails, its
        worker is killed and replaced, and the calls after it go back to the queue's head.
        False when the worker was killed."""
        done = 0
        try:
            worker.conn.send_bytes(b"[" + b",".join(c.request for c in batch) + b"]")
            for call in batch:  # each call's deadline runs from the reply before it
                _resolve(call.future, json.loads(await self._receive(worker, self.timeout_seconds)))
                done += 1
            return True
        except asyncio.TimeoutError:
            error = VerifierError(
                f"{batch[done].name}: verifier timeout: no result within {self.timeout_seconds:g} s "
                "(verifier_timeout_seconds); the sample is too costly to check, its worker was stopped",
                "timeout",
            )
        except (EOFError, OSError):
            error = VerifierError(
                f"{batch[done].name}: the verifier's worker process died on this sample", "worker_died"
            )
        except BaseException:  # cancelled: the pool closes
            for call in batch[done:]:
                _resolve(call.future, error=VerifierError(f"{call.name}: the reward service is stopping", "stopping"))
            self._retire(worker)
            raise
        _resolve(batch[done].future, error=error)
        self._pending.extendleft(reversed(batch[done + 1 :]))
        self._retire(worker)
        self._dispatch()
        return False

    @staticmethod
    async def _receive(worker: _Worker, timeout: float) -> bytes:
        """The worker's next message, waiting without a thread; EOFError when it died."""
        if not readable_now(worker.conn.fileno()):
            loop = asyncio.get_running_loop()
            readable = loop.create_future()
            fd = worker.conn.fileno()
            loop.add_reader(fd, _resolve, readable)
            timer = loop.call_later(timeout, _resolve, readable, None, asyncio.TimeoutError())
            try:
                await readable
            finally:
                loop.remove_reader(fd)
                timer.cancel()
        return worker.conn.recv_bytes()

    # ------------------------------------------------------------ workers

    def _retire(self, worker: _Worker) -> None:
        self._live.discard(worker)
        worker.kill()
        if not self._closed:
            self._spawn(self._add_worker())

    def _start_process(self) -> _Worker:
        _CONTEXT.set_forkserver_preload(_PRELOAD)  # takes effect when the fork server first starts
        ours, theirs = _CONTEXT.Pipe()
        process = _CONTEXT.Process(target=_serve, args=(theirs, self.verifiers), name="rlmesh-verifier", daemon=True)
        process.start()
        theirs.close()
        return _Worker(process, ours)

    async def _add_worker(self) -> None:
        while not self._closed:
            worker = None
            try:
                worker = await asyncio.to_thread(self._start_process)  # the first start waits for the fork server
                if self._closed:  # closed while it started
                    worker.kill()
                    return
                self._live.add(worker)
                if await self._receive(worker, _READY_TIMEOUT_SECONDS) != b"ready":
                    raise RuntimeError("the worker did not report ready")
                self._idle.append(worker)
                self._dispatch()
                return
            except Exception:
                log.exception("could not start a verifier worker; trying again in %g s", _RESTART_DELAY_SECONDS)
                if worker is not None:
                    self._live.discard(worker)
                    worker.kill()
                await asyncio.sleep(_RESTART_DELAY_SECONDS)


def readable_now(fd: int) -> bool:
    """Whether `fd` has data, without waiting. poll(), not select(): select() refuses
    descriptors above 1023, which a busy service (or a long test run) reaches; and
    conn.poll() would build a selector per call."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
