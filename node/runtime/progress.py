"""Progress bars for the long steps (task filtering, the warm start, checkpoint downloads), for a person only.

Every bar is tqdm on stderr, so stdout keeps the command's result (a summary, a JSON document). A bar shows
only where someone watches: the caller turns it off under --json or --log-json (`enabled=False`), and tqdm
turns it off by itself when stderr is not a terminal (a log file, a pipe, a service manager), so logs never
fill with carriage-return frames.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

from ...p2p.weights.manifest import SignedManifest


def progress_bar(
    total: float | None, desc: str, unit: str = "it", *, enabled: bool = True, **options: Any
) -> tqdm:
    """A tqdm bar on the current stderr; off when not `enabled`, and when stderr is not a terminal."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=None if enabled else True,  # None: tqdm disables it itself when its file is not a TTY
        dynamic_ncols=True,
        **options,
    )


class DownloadProgress:
    """A bytes bar for one checkpoint download, fed by a Fetcher's callbacks: `on_manifest` sizes it (with
    what a resumed download already held), `on_bytes` advances it. Used by `prime-node weights fetch` and
    by the contributor for each checkpoint it downloads."""

    def __init__(self, *, enabled: bool = True, delay_s: float = 0.0, leave: bool = True) -> None:
        # delay_s: a download faster than this never draws a bar (a tiny model's checkpoint takes
        # milliseconds; a daemon's terminal need not flash one per step).
        self.bar = progress_bar(
            0,
            "checkpoint",
            "B",
            enabled=enabled,
            unit_scale=True,
            unit_divisor=1024,
            delay=delay_s,
            leave=leave,
        )

    def on_manifest(self, manifest: SignedManifest, resumed: int) -> None:
        self.bar.reset(total=manifest.body.total_size)
        self.bar.update(resumed)
        self.bar.set_description(f"checkpoint step {manifest.step}")

    def on_bytes(self, count: int) -> None:
        self.bar.update(count)

    def close(self) -> None:
        self.bar.close()
