"""Lint, format and type checks over the whole repository, so that the one test command (.ci/run) runs them.

The tools come from the `dev` extra the set-up installs (pinned in pyproject.toml); their settings live in
pyproject.toml. The type checker needs the packages under their installed name, prime_node.*, so it runs
over a scratch folder `prime_node/` whose sub-folders link to node/, p2p/, proofs/ and trainer/.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PACKAGES = ("node", "p2p", "proofs", "trainer")


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed; `pip install -e '.[dev]'` (scripts/setup.sh does) provides it")
    return found


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def test_ruff_finds_nothing():
    result = _run([_tool("ruff"), "check", "--no-cache", "."], ROOT, 300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_code_is_formatted():
    result = _run([_tool("ruff"), "format", "--no-cache", "--check", "."], ROOT, 300)
    assert result.returncode == 0, "run `.venv/bin/ruff format .`:\n" + result.stdout + result.stderr


@pytest.mark.slow
def test_the_type_checker_finds_nothing(tmp_path):
    package = tmp_path / "prime_node"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in PACKAGES:
        (package / name).symlink_to(ROOT / name, target_is_directory=True)
    result = _run(
        [
            _tool("mypy"),
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--python-executable",
            sys.executable,
            "--cache-dir",
            str(tmp_path / "cache"),
            "-p",
            "prime_node",
        ],
        tmp_path,
        900,
    )
    assert result.returncode == 0, result.stdout[-20_000:] + result.stderr[-5_000:]
