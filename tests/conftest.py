"""Fixtures shared across test modules. Helpers and factories live in tests/support/ and are imported where
used; the fixtures below are registered here once, so no test module imports a fixture by name."""

from support.netlab.fixture import netlab
from support.trainer import one_torch_thread
from support.validator import world

__all__ = ["netlab", "one_torch_thread", "world"]
