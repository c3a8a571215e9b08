"""Every sub-package on disk is listed in pyproject.toml, so a non-editable install (the Dockerfile's) is complete."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"node": "prime_node.node", "p2p": "prime_node.p2p", "proofs": "prime_node.proofs", "trainer": "prime_node.trainer"}


def test_all_subpackages_are_declared():
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = set()
    for folder, dotted in PACKAGE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((dotted, *rel)))
    assert on_disk == declared, f"missing from pyproject: {on_disk - declared}; stale: {declared - on_disk}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "bash scripts/setup.sh && .venv/bin/python -m pytest"
    assert command in readme and command in ci
