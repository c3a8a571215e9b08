"""The bounded scorer: an environment's scorer run where a hang, a crash or a breach costs one zero.

Completions are written by untrusted peers and every validator scores them again, so a completion crafted
to be slow for a scorer (a huge number for a symbolic-math library, deep LaTeX nesting, input that makes a
regex backtrack) or to crash it must not stall or kill a node or a validator. `BoundedScorer` runs scores
of `process` (and `sandbox`) environments in a worker process (scoring_worker.py) limited in address space
(RLIMIT_AS, `memory_mb`), CPU time per score (RLIMIT_CPU, `cpu_s`: the kernel's SIGXCPU) and wall-clock time
per score (`wall_s`: the parent kills the worker's process group). Any breach, a crash of the interpreter
(os._exit, a segfault in a C extension) or an exception out of the scorer scores 0, the worker is replaced
by a fresh one, and the next score runs as if nothing had happened: a worker never outlives a fault, so a
result never depends on what was scored before it.

Results are deterministic in the way that matters: a score that finishes within the limits is exactly the
scorer's value (the float crosses the pipe as its shortest repr, which round-trips), and a score cut at a
limit is 0. The limits are far above what honest answers cost (docs/environments.md, "Scoring bounds",
measured by benchmarks/scorer_bounds.py), so only a completion built to sit near a limit could score
differently on a slower machine, and such a completion is one the scorer was already failing.

`inline` environments (integer or exact match: pure Python that bounds its own input) are called in the
calling thread, still wrapped so that an exception scores 0. The worker's start-up and the loading of an
environment into it (unpickling imports the environment's library) are bounded separately and generously;
an environment that cannot be loaded is a configuration error (ScoringError), not a zero.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from ..errors import TaskError
from .environment import Environment, ScoringLimits
from .scoring_worker import FRAME_HEADER, MAX_REPLY_BYTES
from .types import Task

logger = logging.getLogger(__name__)

# The worker's first lines: limits before any import of ours, so that imports count against the memory limit
# (this package imports pyarrow) and a limit too low to load an environment shows at load, not at a score.
_BOOT = (
    "import resource, sys\n"
    "limit = int(sys.argv[1]) * 1024 * 1024\n"
    "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "from prime_node.node.environments.scoring_worker import main\n"
    "sys.exit(main())\n"
)
# Start-up of a worker plus loading one environment into it: imports of sympy or reasoning-gym on a busy
# two-core machine take seconds; a minute and a half means something is wrong, not slow.
DEFAULT_START_TIMEOUT_S = 90.0
# A worker's native libraries each get one thread: CPU time is then one score's, and nothing idles.
_SINGLE_THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class ScoringError(TaskError):
    """An environment cannot be scored here at all (it cannot be pickled, or loaded into a worker within
    its memory limit); the message names the environment and what to change. Never raised for a completion."""


class _Breach(Exception):
    """One score ended by a limit or a fault; `kind` is wall, cpu, memory, crash or fault."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def _environment_key(environment: Environment) -> str:
    identity = environment.identity
    return f"{identity.name} {identity.package}=={identity.version} {identity.content_hash}"


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(_SINGLE_THREAD_ENV)
    # The worker unpickles the parent's environment objects, so it imports from the same places; a fixed
    # hash seed keeps any set or dict of strings inside a scorer in the same order on every machine.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env["PYTHONHASHSEED"] = "0"
    return env


class _Worker:
    """One worker process and its pipes; every read and write has a deadline."""

    def __init__(self, memory_mb: int) -> None:
        self.loaded: set[str] = set()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # a peer's completion must not reach our logs through a scorer
            env=_worker_env(),
            start_new_session=True,  # its own process group: killed whole, and spared the terminal's ^C
            close_fds=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._out = self.process.stdin.fileno()
        self._in = self.process.stdout.fileno()
        os.set_blocking(self._out, False)
        os.set_blocking(self._in, False)

    def request(self, message: tuple[Any, ...], deadline: float) -> dict[str, Any]:
        """Send one request and return the worker's reply; _Breach when it dies, faults or runs late."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._write(FRAME_HEADER.pack(len(payload)) + payload, deadline)
        (length,) = FRAME_HEADER.unpack(self._read(FRAME_HEADER.size, deadline))
        if length > MAX_REPLY_BYTES:
            raise _Breach("fault", f"reply of {length} bytes")
        try:
            reply = json.loads(self._read(length, deadline))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _Breach("fault", f"unreadable reply ({exc})") from None
        if not isinstance(reply, dict):
            raise _Breach("fault", "reply is not an object")
        if "fault" in reply:
            detail = str(reply["fault"])
            raise _Breach("memory" if detail.startswith("MemoryError") else "fault", detail)
        return reply

    def _wait(self, fd: int, event: int, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Breach("wall", "wall-clock limit")
        poller = select.poll()
        poller.register(fd, event)
        if not poller.poll(math.ceil(remaining * 1000)):
            raise _Breach("wall", "wall-clock limit")

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self._wait(self._out, select.POLLOUT, deadline)
            try:
                view = view[os.write(self._out, view) :]
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                raise self._died() from None

    def _read(self, count: int, deadline: float) -> bytes:
        data = b""
        while len(data) < count:
            self._wait(self._in, select.POLLIN, deadline)
            try:
                chunk = os.read(self._in, count - len(data))
            except BlockingIOError:
                continue
            if not chunk:
                raise self._died()
            data += chunk
        return data

    def _died(self) -> _Breach:
        try:
            status = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return _Breach("crash", "closed its pipe but did not exit")
        if status == -signal.SIGXCPU:
            return _Breach("cpu", "CPU-time limit")
        if status < 0:
            return _Breach("crash", f"killed by {signal.Signals(-status).name}")
        return _Breach("crash", f"exited with status {status}")

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the worker and anything a scorer started
        except (ProcessLookupError, PermissionError):
            pass
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()  # type: ignore[union-attr]
            except OSError:
                pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("scoring worker %d did not exit after SIGKILL", self.process.pid)


class BoundedScorer:
    """Scores completions with an environment's scorer under `limits` (see the module docstring).

    One worker serves any number of environments (each loaded into it once); calls are serialised by a
    lock, so one BoundedScorer may be shared by threads. Close it (or use it as a context manager) to end
    its worker; a worker whose parent dies exits when its pipe closes.
    """

    def __init__(self, limits: ScoringLimits, *, start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        self.limits = limits
        self.start_timeout_s = start_timeout_s
        self.breaches: collections.Counter[str] = collections.Counter()  # kind -> count, for logs and tests
        self.last_breach: str | None = None
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._pickled: dict[str, bytes] = {}

    def score(self, environment: Environment, completion: str, task: Task) -> float:
        """`environment.score(completion, task)` within the limits; 0.0 for anything that breaches them."""
        if self.limits.isolation == "inline":
            return self._score_inline(environment, completion, task)
        key = _environment_key(environment)
        with self._lock:
            worker = self._ready(environment, key)
            deadline = time.monotonic() + self.limits.wall_s
            try:
                reply = worker.request(("score", key, completion, task, self.limits.cpu_s), deadline)
            except _Breach as breach:
                self._record(environment, breach)
                return 0.0
            value = reply.get("score")
            if isinstance(value, bool) or not isinstance(value, float) or not 0.0 <= value <= 1.0:
                self._record(environment, _Breach("fault", f"bad score {value!r}"))
                return 0.0
            return value

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._worker.kill()
                self._worker = None

    def __enter__(self) -> BoundedScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _score_inline(self, environment: Environment, completion: str, task: Task) -> float:
        try:
            value = environment.score(completion, task)
        except Exception as exc:  # noqa: BLE001 (a scorer must be total; one that is not scores 0)
            self._record(environment, _Breach("fault", f"{type(exc).__name__}: {exc}"))
            return 0.0
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            self._record(environment, _Breach("fault", f"bad score {value!r}"))
            return 0.0
        return float(value)

    def _ready(self, environment: Environment, key: str) -> _Worker:
        """A live worker with `environment` loaded; ScoringError when that cannot be had."""
        if self._worker is None:
            self._worker = _Worker(self.limits.memory_mb)
        worker = self._worker
        if key in worker.loaded:
            return worker
        if key not in self._pickled:
            try:
                self._pickled[key] = pickle.dumps(environment, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 (pickling runs arbitrary __reduce__ code)
                raise ScoringError(
                    f"environment {environment.identity.describe()} cannot be sent to a scoring worker: "
                    f"{type(exc).__name__}: {exc}"
                ) from None
        try:
            worker.request(("load", key, self._pickled[key]), time.monotonic() + self.start_timeout_s)
        except _Breach as breach:
            worker.kill()
            self._worker = None
            raise ScoringError(
                f"environment {environment.identity.describe()} cannot be loaded into a scoring worker "
                f"limited to {self.limits.memory_mb} MiB within {self.start_timeout_s:.0f} s ({breach}); "
                "a memory breach here means its memory_mb is too low for its library"
            ) from None
        worker.loaded.add(key)
        return worker

    def _record(self, environment: Environment, breach: _Breach) -> None:
        self.breaches[breach.kind] += 1
        self.last_breach = breach.kind
        logger.info("score of %s cut (%s): 0", environment.identity.name, breach)
        if self._worker is not None and self.limits.isolation != "inline":
            self._worker.kill()
            # The replacement starts now, so its interpreter is up by the time the next score needs it.
            self._worker = _Worker(self.limits.memory_mb)
