"""The engine in a process of its own (engine setting ``engine_process``), the way vLLM's V1 runs its EngineCore.

Triton's Python backend runs model.py inside its stub, which embeds the shared libpython: pure Python runs 1.2-1.5x
slower there than under a plain interpreter, and the stub's own work (parsing requests, sending responses, metrics)
takes the GIL from the engine thread. With ``engine_process`` the stub starts a child process with a plain interpreter
of the same Python version; the child loads the engine and runs the GenerationService as in process, and a pipe
carries requests in and responses, errors, metrics and log records out.

Parent (the stub): ``EngineProcess`` has the GenerationService's interface (submit, stop, shutdown, is_healthy); a
relay thread sends each response on through the request's real sink, asks the client about cancellation (every
request not asked within ddtree.cancellation's interval, as the outbox in process does, between the child's messages)
and tells the child. Child (``python -m ddtree.engine_process FD``): each request's sink is a ``_PipeSink``; its
cancellation is a flag the parent sets.

If the child dies, every request it held gets a final UNAVAILABLE error, later requests get one at once, and the
ddtree_engine_healthy gauge drops to 0, as after a fatal engine error in process; the server goes on serving its other
models. If the parent dies, the child sees its pipe close and exits (while loading: within a second of being
reparented).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

from ddtree import api
from ddtree.cancellation import CANCEL_CHECK_S, cancel_check_interval
from ddtree.config import EngineConfig

logger = logging.getLogger("ddtree.engine_process")   # also when run as __main__ (the child)

STOP_REPLY_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 15.0


class _Link:
    """One end of the pipe; sends from several threads (the engine's outbox, the reader, logging) go one at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self._lock:
            self.conn.send(message)


def wanted(config: EngineConfig) -> bool:
    """engine_process resolved: as set, or ("auto") on where the engine's device is CUDA."""
    return config.engine_process if config.engine_process is not None else config.device.startswith("cuda")


def find_python(explicit: str = "") -> str:
    """A plain interpreter of this Python's version: DDTREE_ENGINE_PYTHON, else pythonX.Y or python3 on PATH whose
    version is ours, else sys.executable (under Triton's stub that may be the stub itself: checked)."""
    want = f"{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [explicit or os.environ.get("DDTREE_ENGINE_PYTHON", ""),
                  shutil.which(f"python{want}") or "", shutil.which("python3") or "", sys.executable or ""]
    tried = []
    for path in dict.fromkeys(c for c in candidates if c):
        try:
            out = subprocess.run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            tried.append(f"{path}: {e}")
            continue
        if out.returncode == 0 and out.stdout.strip() == want:
            return path
        tried.append(f"{path}: Python {out.stdout.strip() or out.stderr.strip()[:80]}")
    raise RuntimeError(f"engine_process: no Python {want} interpreter found (set DDTREE_ENGINE_PYTHON); tried: "
                       + "; ".join(tried))


def child_pythonpath() -> str:
    """The child imports what this process imports: this search path (the project root, the site-packages Triton's
    PYTHONPATH named, the model's own directory), less this interpreter's standard library, which the child's own
    interpreter brings (another installation's would shadow it)."""
    stdlib = [sysconfig.get_path(name) for name in ("stdlib", "platstdlib")]

    def is_stdlib(path: str) -> bool:
        if path.endswith(".zip"):
            return True
        if "site-packages" in path or "dist-packages" in path:
            return False
        return any(path == root or path.startswith(root + os.sep) for root in stdlib if root)

    return os.pathsep.join(dict.fromkeys(os.path.abspath(p) for p in sys.path if p and not is_stdlib(p)))


@dataclass
class _Entry:
    request_id: str
    sink: Any
    checked_s: float
    cancelled: bool = False


def stats_fields(stats) -> dict:
    """A stats snapshot's fields as they are (dataclasses.asdict's deep copy took ~125 us of the GIL on the 2-core
    CPU): the snapshot is its publisher's own (GenerationService._report copies its dicts and hands its lists over)."""
    return {field.name: getattr(stats, field.name) for field in dataclasses.fields(stats)}


class MetricsPublisher:
    """The engine's stats handed to on_stats (the Triton metrics) on a thread of their own: from the relay thread here,
    and in process (the model's engine on its stub) from the outbox. An update is tens of Triton IPC calls (one per
    changed counter and per histogram sample: each round's acceptance length; 1.2 ms median, up to 6.8 ms, on the
    2-core CPU): on the relay thread or the outbox every response queued behind one waited for all of it, and the
    update published once a request finishes ran into the next request's first token. Snapshots that arrive
    while one is being published are merged: the newest values, and the samples (list fields) of all of them."""

    def __init__(self, on_stats) -> None:
        self.on_stats = on_stats
        self._cond = threading.Condition()
        self._pending: dict | None = None
        self._closed = False
        self.seconds, self.count = 0.0, 0   # the updates' own time, published with the next one (ServiceStats)
        self._thread = threading.Thread(target=self._run, name="ddtree-metrics", daemon=True)
        self._thread.start()

    def put(self, stats: dict) -> None:
        with self._cond:
            if self._pending is not None:   # not published yet: its samples go with the newer snapshot
                stats = {**stats, **{name: value + stats.get(name, []) for name, value in self._pending.items()
                                     if isinstance(value, list)}}
            self._pending = stats
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                stats, self._pending = self._pending, None
            start = time.perf_counter()
            try:
                self.on_stats(SimpleNamespace(**{**stats, "metrics_publish_seconds": self.seconds,
                                                 "num_metrics_publishes": self.count}))
            except Exception:
                logger.exception("could not publish the engine's metrics")
            self.seconds += time.perf_counter() - start
            self.count += 1

    def close(self, timeout_s: float) -> None:
        """Publish what is pending, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)


class EngineProcess:
    """Parent side: start the child, wait until its engine is loaded and warmed up (``arm_names`` then holds auto's
    arms, for the metrics), then ``start(on_stats)`` and serve."""

    stop_registry = None   # the child keeps the registry of stops relayed between instances

    def __init__(self, config: EngineConfig, *, tokenizer_path: str, max_queue_size: int, fault_injection: str = "",
                 stop_directory: str | None = None, python: str = "") -> None:
        self.fatal_error: str | None = None
        self.on_stats = None
        self._publisher: MetricsPublisher | None = None
        self._live: dict[int, _Entry] = {}
        self._ids = itertools.count(1)
        self._stop_replies: dict[int, tuple[threading.Event, list]] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._last_stats = None
        # the relay thread's own sending: these replace the child's fields of the same names (its pipe sends) in the
        # published stats, what ServiceStats counts on the outbox thread when the engine runs in this process
        self._sender = {"send_seconds": 0.0, "cancel_check_seconds": 0.0, "num_cancel_checks": 0}
        parent_end, child_end = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = child_pythonpath()
        executable = find_python(python)
        self._child = subprocess.Popen([executable, "-m", "ddtree.engine_process", str(child_end.fileno()), str(os.getpid())],
                                       pass_fds=[child_end.fileno()], env=env, stdin=subprocess.DEVNULL)
        child_end.close()
        self._link = _Link(Connection(parent_end.detach()))
        logger.info("engine process %d started (%s)", self._child.pid, executable)
        self._link.send(("init", {"config": config, "tokenizer_path": tokenizer_path, "max_queue_size": max_queue_size,
                                  "fault_injection": fault_injection, "stop_directory": stop_directory}))
        while True:   # the load's log records, then ready or failed
            try:
                message = self._link.conn.recv()
            except (EOFError, OSError):
                code = self._child.wait()
                raise RuntimeError(f"engine process {self._child.pid} exited (code {code}) while loading") from None
            if message[0] == "log":
                self._log(*message[1:])
            elif message[0] == "failed":
                self._child.wait(SHUTDOWN_TIMEOUT_S)
                raise RuntimeError(f"engine process failed to load the engine:\n{message[1]}")
            elif message[0] == "ready":
                self.arm_names: list[str] = message[1]
                break
        self._reader = threading.Thread(target=self._relay, name="ddtree-engine-relay", daemon=True)

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def is_healthy(self) -> bool:
        return self.fatal_error is None

    def start(self, on_stats=None) -> None:
        self.on_stats = on_stats
        # DDTREE_METRICS_THREAD=0 (a diagnostic): each update on the relay thread, between responses, as before
        threaded = os.environ.get("DDTREE_METRICS_THREAD", "1") != "0"
        self._publisher = MetricsPublisher(on_stats) if on_stats is not None and threaded else None
        self._reader.start()
        self._link.send(("start",))

    def submit(self, request_id: str, request: api.GenerateRequest, sink) -> None:
        arrival_s = time.perf_counter()   # CLOCK_MONOTONIC: the child's clock too
        with self._lock:
            unavailable = self.fatal_error
            if unavailable is None:
                pid = next(self._ids)
                self._live[pid] = _Entry(request_id, sink, time.monotonic())
        if unavailable is not None:
            logger.warning("[%s] rejected: engine process unavailable (%s)", request_id, unavailable)
            sink.send_error(f"model unavailable: {unavailable}; this instance no longer serves, restart the server",
                            "unavailable")
            return
        try:
            self._link.send(("submit", pid, request_id, request, arrival_s))
        except OSError as e:   # the child is gone: the relay fails the request with the others
            logger.warning("[%s] could not reach the engine process: %s", request_id, e)

    def stop(self, key: str) -> bool:
        """As GenerationService.stop, answered by the child."""
        token = next(self._ids)
        event, reply = threading.Event(), []
        self._stop_replies[token] = (event, reply)
        try:
            self._link.send(("stop", token, key))
            event.wait(STOP_REPLY_TIMEOUT_S)
        except OSError:
            pass
        finally:
            self._stop_replies.pop(token, None)
        return bool(reply and reply[0])

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        self._stopping = True
        try:
            self._link.send(("shutdown",))
        except OSError:
            pass
        try:
            self._child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not exit in %.0f s: killed", self._child.pid, timeout_s)
            self._child.kill()
            self._child.wait()
        if self._reader.is_alive():
            self._reader.join(timeout_s)
        if self._publisher is not None:
            self._publisher.close(timeout_s)
        self._link.conn.close()

    @staticmethod
    def _log(level: int, name: str, text: str) -> None:
        logging.getLogger(name).log(level, "%s", text)

    def _relay(self) -> None:
        conn = self._link.conn
        swept_s = time.monotonic()
        while True:
            try:
                message = conn.recv() if conn.poll(CANCEL_CHECK_S) else None
            except (EOFError, OSError):
                self._child_gone()
                return
            try:
                if message is not None:
                    self._handle(message)
                now = time.monotonic()
                if now - swept_s >= CANCEL_CHECK_S:
                    swept_s = now
                    live = list(self._live.items())
                    interval = cancel_check_interval(len(live))
                    for pid, entry in live:
                        if now - entry.checked_s >= interval:
                            self._check(pid, entry, now)
            except Exception:   # one message's failure; the relay goes on
                logger.exception("engine relay: could not handle %s", message[0] if message else "a cancellation sweep")

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "out":
            _, pid, outputs, final = message
            entry = self._live.pop(pid, None) if final else self._live.get(pid)
            if entry is None:
                return
            start = time.monotonic()
            try:
                entry.sink.send(outputs, final=final)
            except Exception:
                logger.exception("[%s] could not send a response; dropping the request", entry.request_id)
                self._live.pop(pid, None)
                self._cancel(pid, entry)
            finally:
                self._sender["send_seconds"] += time.monotonic() - start
        elif kind == "error":
            _, pid, text, error_kind, final = message
            entry = self._live.pop(pid, None) if final else self._live.get(pid)
            if entry is not None:
                start = time.monotonic()
                try:
                    entry.sink.send_error(text, error_kind, final=final)
                finally:
                    self._sender["send_seconds"] += time.monotonic() - start
        elif kind == "stats":   # a ServiceStats as a dict: this process need not import ddtree.serving (and torch)
            self._last_stats = {**message[1], **self._sender}
            self._publish(self._last_stats)
        elif kind == "log":
            self._log(*message[1:])
        elif kind == "stopped":
            waiter = self._stop_replies.get(message[1])
            if waiter is not None:
                waiter[1].append(message[2])
                waiter[0].set()

    def _publish(self, stats: dict) -> None:
        if self._publisher is not None:
            self._publisher.put(stats)
        elif self.on_stats is not None:
            try:
                self.on_stats(SimpleNamespace(**stats))
            except Exception:
                logger.exception("could not publish the engine's metrics")

    def _check(self, pid: int, entry: _Entry, now: float) -> None:
        entry.checked_s = now
        if entry.cancelled:
            return
        start = time.monotonic()
        try:
            cancelled = entry.sink.is_cancelled()
        finally:
            self._sender["cancel_check_seconds"] += time.monotonic() - start
            self._sender["num_cancel_checks"] += 1
        if cancelled:
            self._cancel(pid, entry)

    def _cancel(self, pid: int, entry: _Entry) -> None:
        entry.cancelled = True
        try:
            self._link.send(("cancel", pid))
        except OSError:
            pass

    def _child_gone(self) -> None:
        code = self._child.poll()
        with self._lock:
            if self._stopping and not self._live:
                return
            self.fatal_error = f"the engine process {self._child.pid} exited (code {code})"
            entries = list(self._live.values())
            self._live.clear()
        logger.error("%s; this instance no longer serves; failing %d requests: %s", self.fatal_error, len(entries),
                     ", ".join(entry.request_id for entry in entries) or "none")
        for entry in entries:
            try:
                entry.sink.send_error(f"engine failed: {self.fatal_error}; this instance no longer serves",
                                      "unavailable")
            except Exception:
                logger.exception("[%s] could not send its final error", entry.request_id)
        if self._last_stats is not None:
            # the gauges fall: nothing active, nothing held, unhealthy (the counters keep their last values)
            self._publish({**self._last_stats, **self._sender, "num_active": 0, "num_waiting": 0, "num_held_slots": 0,
                           "engine_healthy": 0, "ttft_seconds": [], "latency_seconds": [], "queue_seconds": [],
                           "prefill_seconds": [], "take_seconds": []})


# ---------------------------------------------------------------------------------------------------- child side


class _PipeSink:
    """A request's ResponseSink in the child: responses go to the parent, which sends them on."""

    def __init__(self, link: _Link, pid: int, sinks: dict) -> None:
        self.link, self.pid, self.sinks = link, pid, sinks
        self.cancelled = False

    def is_cancelled(self) -> bool:
        return self.cancelled

    def send(self, outputs: dict[str, Any], final: bool) -> None:
        if final:
            self.sinks.pop(self.pid, None)
        self.link.send(("out", self.pid, outputs, final))

    def send_error(self, message: str, kind: str, final: bool = True) -> None:
        if final:
            self.sinks.pop(self.pid, None)
        self.link.send(("error", self.pid, message, kind, final))


class _PipeLogHandler(logging.Handler):
    def __init__(self, link: _Link) -> None:
        super().__init__()
        self.link = link

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + "".join(traceback.format_exception(*record.exc_info))
            self.link.send(("log", record.levelno, record.name, text))
        except Exception:   # the parent is gone: nothing to log to
            pass


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """A stub killed while this child loads (a 27B warm-up takes minutes) leaves no reader of the pipe until the load
    ends: exit as soon as the parent is gone (this process reparented; `parent` is the pid it was started by, so a
    parent gone before this runs counts too), whatever the main thread is doing."""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(1)


def _child_main(fd: int, parent: int) -> int:
    threading.Thread(target=_exit_with_parent, args=(parent,), name="ddtree-parent-watch", daemon=True).start()
    link = _Link(Connection(fd))
    package_logger = logging.getLogger("ddtree")
    package_logger.setLevel(logging.INFO)
    package_logger.addHandler(_PipeLogHandler(link))
    package_logger.propagate = False
    try:
        message = link.conn.recv()
    except (EOFError, OSError):
        return 1
    settings = message[1]
    try:
        from ddtree.engine import Engine
        from ddtree.serving import GenerationService, freeze_heap
        from ddtree.stop_registry import StopRegistry
        from ddtree.triton_common import load_tokenizer

        config: EngineConfig = settings["config"]
        engine = Engine(config)
        engine.warm_up()
        tokenizer = load_tokenizer(config.target_path)
        registry = StopRegistry(settings["stop_directory"]) if settings["stop_directory"] else None
        freeze_heap()
    except BaseException:
        link.send(("failed", traceback.format_exc()))
        return 1
    link.send(("ready", [arm.name for arm in engine.arm_selector.arms]))
    try:
        if link.conn.recv()[0] != "start":
            return 0
    except (EOFError, OSError):
        return 0
    sinks: dict[int, _PipeSink] = {}

    def publish(stats) -> None:
        link.send(("stats", stats_fields(stats)))

    service = GenerationService(engine, tokenizer, publish, max_queue_size=settings["max_queue_size"],
                                fault_injection=settings["fault_injection"], stop_registry=registry)
    logger.info("engine process %d serving", os.getpid())
    try:
        while True:
            try:
                message = link.conn.recv()
            except (EOFError, OSError):
                logger.warning("engine process %d: the model's process closed the pipe; stopping", os.getpid())
                break
            kind = message[0]
            if kind == "submit":
                _, pid, request_id, request, arrival_s = message
                sink = sinks[pid] = _PipeSink(link, pid, sinks)
                service.submit(request_id, request, sink, arrival_s=arrival_s)
            elif kind == "cancel":
                sink = sinks.get(message[1])
                if sink is not None:
                    sink.cancelled = True
            elif kind == "stop":
                link.send(("stopped", message[1], service.stop(message[2])))
            elif kind == "shutdown":
                break
    finally:
        service.shutdown()
        if registry is not None:
            registry.close()
    return 0


if __name__ == "__main__":
    code = _child_main(int(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(code)   # no interpreter teardown: the engine's threads and device state go with the process
