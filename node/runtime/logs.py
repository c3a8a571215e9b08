"""Logging set-up for every command: human-readable by default, one JSON object per line with --log-json."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time, not the object it was when logging was set up.

    A command run in-process (tests, embedding) may configure logging while sys.stderr is a temporary
    capture; binding that object would make every later log line fail once the capture is closed.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def configure_logging(level: str = "INFO", json_lines: bool = False) -> None:
    handler = _CurrentStderrHandler()
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Third-party libraries are chatty at INFO; keep the operator's log about prime-node.
    for noisy in ("hivemind", "transformers", "urllib3", "aiohttp.access", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
    # transformers draws a bar for every model it loads or saves ("Loading weights", a few milliseconds for
    # these models), even into a log file, where each becomes a line of carriage-return frames per
    # checkpoint. Our own bars (node/runtime/progress.py) cover the steps that take long. Read when
    # huggingface_hub is first imported, which the commands do only after this (torch-heavy imports are lazy).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
