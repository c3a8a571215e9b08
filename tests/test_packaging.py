"""Every sub-package on disk is listed in pyproject.toml, so a non-editable install (the Dockerfile's) is complete."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {
    "node": "prime_node.node",
    "p2p": "prime_node.p2p",
    "proofs": "prime_node.proofs",
    "trainer": "prime_node.trainer",
}


def test_all_subpackages_are_declared():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(setuptools["packages"])
    on_disk = set()
    for folder, dotted in PACKAGE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((dotted, *rel)))
    # Data-only folders are declared too (setuptools warns about, and will drop, data in undeclared ones).
    data_only = {name for name in setuptools["package-data"] if name not in on_disk}
    for name in data_only:
        top, _, rest = name.partition(".")[2].partition(".")
        folder = ROOT / top / rest.replace(".", "/")
        assert folder.is_dir() and any(folder.iterdir()) and not (folder / "__init__.py").exists(), name
        # package-data's "*" does not recurse: a subfolder would be left out of the wheel without a word.
        assert not [f for f in folder.iterdir() if f.is_dir() and f.name != "__pycache__"], name
    assert on_disk | data_only == declared, (
        f"missing from pyproject: {(on_disk | data_only) - declared}; stale: {declared - on_disk - data_only}"
    )


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "bash scripts/setup.sh && .venv/bin/python -m pytest"
    assert command in readme and command in ci
