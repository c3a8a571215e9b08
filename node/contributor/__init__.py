"""The contributor daemon: supervised asyncio tasks, preflight checks, the local status API and metrics."""
