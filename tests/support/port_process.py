"""A test server in its own process that announces its port on stdout: started, found, and ended by its pid."""

from __future__ import annotations

import contextlib
import select
import subprocess
from collections.abc import Iterator


@contextlib.contextmanager
def port_process(argv: list[str], what: str, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Run `argv`, whose first line on stdout is `PORT <n>`; yields http://127.0.0.1:<n>. Ended by its pid
    (only the process this helper started), whatever the test did."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = select.select([proc.stdout], [], [], start_timeout_s)[0]
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("PORT "):
            raise RuntimeError(f"{what} did not start (said {line!r})")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.kill()
        proc.wait(10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
