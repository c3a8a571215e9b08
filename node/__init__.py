"""The contributor side: config, CLI, inference engines, the embedded model and tasks, the daemon."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("prime-node")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
