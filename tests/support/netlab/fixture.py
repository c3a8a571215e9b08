"""The `netlab` pytest fixture: a fresh Lab per test, skipped with the reason where one cannot be made."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .cleanup import remove_leftovers
from .commands import unavailable_reason
from .lab import Lab


def require_netlab() -> None:
    """Skip the calling test, naming why, where namespaces with caps and NAT cannot be made."""
    why = unavailable_reason()
    if why is not None:
        pytest.skip(why)


@pytest.fixture
def netlab(tmp_path: Path) -> Iterator[Lab]:
    """A Lab under tmp_path/netlab, removed after the test. Before making it, namespaces that a crashed
    earlier test left (their maker is gone) are removed, so a crash never leaves them for long."""
    require_netlab()
    remove_leftovers()
    with Lab(tmp_path / "netlab") as lab:
        yield lab
