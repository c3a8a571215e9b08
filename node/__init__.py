"""What every role shares (configuration, errors, the run, inference engines, tasks, the embedded model,
the process runtime), the contributor daemon (contributor/) and the `prime-node` command (cli/)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("prime-node")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
