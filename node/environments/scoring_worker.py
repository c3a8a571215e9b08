"""The worker process of the bounded scorer (scoring.py): started as `python -c BOOT MB` (see scoring.py).

It runs scorers on completions written by untrusted peers, so it is written to be killed: its address space
is capped (RLIMIT_AS, set by BOOT before this package is even imported, so imports count), each score gets a CPU-time
budget (RLIMIT_CPU: the kernel ends the process with SIGXCPU when it is spent), core dumps are off, and the
parent kills it outright at its wall-clock deadline. After any fault (an exception out of a scorer, a
MemoryError) it answers once and exits: a scorer's state after a fault is not trusted to be the same as a
fresh one's, and results must not depend on what was scored before.

Protocol on stdin/stdout, one frame each way per request, a frame being a 4-byte big-endian length and a
payload. Requests (parent -> worker) are pickles of ("load", key, pickled environment) or ("score", key, completion,
task, cpu seconds): the parent is this package, so unpickling its bytes is safe. Replies (worker -> parent) are compact
JSON, parsed strictly by the parent: {"ok": true}, {"score": x}, or {"fault": "what happened"}. The worker's
own stdout is pointed at stderr so that a scorer that prints cannot corrupt the stream.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import resource
import struct
import sys
import time
from typing import Any, BinaryIO

FRAME_HEADER = struct.Struct(">I")
MAX_REQUEST_BYTES = 512 * 1024 * 1024  # one pickled environment (a task file's environment drops its tasks)
MAX_REPLY_BYTES = 4096
# CPU time allowed for loading one environment (unpickling imports its library: seconds, not minutes).
LOAD_CPU_S = 300.0


def _read_exact(stream: BinaryIO, count: int) -> bytes | None:
    data = b""
    while len(data) < count:
        chunk = stream.read(count - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _reply(stream: BinaryIO, message: dict[str, Any]) -> None:
    payload = json.dumps(message, allow_nan=False, separators=(",", ":")).encode()
    stream.write(FRAME_HEADER.pack(len(payload)) + payload)
    stream.flush()


def _limit_cpu(seconds: float) -> None:
    """Let the next score use `seconds` more CPU time (whole seconds: the kernel's granularity)."""
    used = time.process_time()
    soft = math.ceil(used + seconds)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _score(environment: Any, completion: str, task: Any) -> dict[str, Any]:
    value = environment.score(completion, task)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return {"fault": f"the scorer returned {type(value).__name__}, not a number"}
    value = float(value)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        return {"fault": f"the scorer returned {value!r}, outside [0, 1]"}
    return {"score": value}


def main() -> int:
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    environments: dict[str, Any] = {}
    while True:
        header = _read_exact(requests, FRAME_HEADER.size)
        if header is None:
            return 0  # the parent closed the pipe (or died): nothing more to do
        (length,) = FRAME_HEADER.unpack(header)
        if length > MAX_REQUEST_BYTES:
            _reply(replies, {"fault": f"request of {length} bytes"})
            return 1
        payload = _read_exact(requests, length)
        if payload is None:
            return 0
        try:
            request = pickle.loads(payload)
            if request[0] == "load":
                _limit_cpu(LOAD_CPU_S)
                environment = pickle.loads(request[2])
                warm_up = getattr(environment, "warm_up", None)
                if callable(warm_up):  # imports and first-use caches, outside any score's wall clock
                    warm_up()
                environments[request[1]] = environment
                _reply(replies, {"ok": True})
                continue
            _, key, completion, task, cpu_s = request
            _limit_cpu(cpu_s)
            _reply(replies, _score(environments[key], completion, task))
        except BaseException as exc:  # noqa: BLE001 (a fault in a scorer ends this worker, never the parent)
            try:
                _reply(replies, {"fault": f"{type(exc).__name__}: {str(exc)[:200]}"})
            except BaseException:  # noqa: BLE001 (out of memory even for the reply: the parent sees EOF)
                pass
            return 1
