"""The folder tree is the architecture: each package imports only the layers docs/architecture.md allows.

Every import of every module (top-level or inside a function, relative or absolute) is resolved to the unit
it lands in, and each edge between units must be in ALLOWED. The table is the one docs/architecture.md opens
with; a test below checks the two agree, and another that a forbidden edge is caught.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "node": "prime_node.node",
    "p2p": "prime_node.p2p",
    "proofs": "prime_node.proofs",
    "trainer": "prime_node.trainer",
}

# Units, most specific first: a module belongs to the first unit its dotted name starts with.
SHARED = ("node.runtime", "node.engine", "node.environments", "node.models", "node.run", "node")
ROLES = ("node.contributor", "trainer.service", "trainer.validator", "trainer.devnet")
LIBRARIES = ("trainer.grpo", "trainer.ledger", "trainer.groups", "trainer.dataset")
UNITS = ("node.cli", *ROLES, *LIBRARIES, "trainer", *SHARED, "proofs", "p2p")

BASE = {"p2p", "proofs", *SHARED}
ALLOWED: dict[str, set[str]] = {
    "p2p": set(),
    "proofs": {"p2p"},
    **{unit: BASE for unit in SHARED},
    "trainer": set(),  # trainer/errors.py: the package's exception base
    "trainer.grpo": BASE | {"trainer"},
    "trainer.ledger": {"p2p", "proofs", "trainer"},
    "trainer.groups": BASE | {"trainer"},
    "trainer.dataset": BASE | {"trainer"},
    "node.contributor": BASE,
    "trainer.service": BASE | {"trainer", "trainer.grpo", "trainer.groups"},
    "trainer.validator": BASE | {"trainer", "trainer.ledger"},
    "trainer.devnet": BASE | {"trainer", "trainer.ledger", "trainer.dataset"},
    "node.cli": set(UNITS),
}


def unit_of(module: str) -> str | None:
    name = module.removeprefix("prime_node.")
    for unit in UNITS:
        if name == unit or name.startswith(unit + "."):
            return unit
    return None


def module_of(path: Path) -> tuple[str, str]:
    """(module, package it resolves relative imports against) of a source file."""
    rel = path.relative_to(ROOT).with_suffix("")
    dotted = ".".join([PACKAGES[rel.parts[0]], *rel.parts[1:]])
    if path.name == "__init__.py":
        dotted = dotted.removesuffix(".__init__")
        return dotted, dotted
    return dotted, dotted.rsplit(".", 1)[0]


def imports_of(source: str, package: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [name for name in found if name.startswith("prime_node.")]


def violations(files: dict[Path, str]) -> list[str]:
    bad = []
    for path, source in files.items():
        module, package = module_of(path)
        here = unit_of(module)
        for target in imports_of(source, package):
            there = unit_of(target)
            if there is not None and there != here and there not in ALLOWED[here]:
                bad.append(f"{path.relative_to(ROOT)} ({here}) imports {target} ({there})")
    return bad


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for top in PACKAGES for path in (ROOT / top).rglob("*.py")}


def test_every_import_follows_the_layer_table():
    assert not violations(_sources())


def test_a_forbidden_import_is_caught():
    # The validator reaching into the trainer service (one role importing another) must fail the test.
    fake = ROOT / "trainer" / "validator" / "example.py"
    source = "def f():\n    from ..service.batch_buffer import BatchBuffer\n    from prime_node.node.cli import main\n"
    assert violations({fake: source}) == [
        "trainer/validator/example.py (trainer.validator) imports prime_node.trainer.service.batch_buffer "
        "(trainer.service)",
        "trainer/validator/example.py (trainer.validator) imports prime_node.node.cli (node.cli)",
    ]


def test_every_module_belongs_to_a_unit():
    assert not [p for p in _sources() if unit_of(module_of(p)[0]) is None]


def test_the_architecture_doc_states_this_table():
    """docs/architecture.md's layer table names every unit with exactly the imports ALLOWED gives it."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`[\w./]+/`", cells[0]):
            unit = cells[0].strip("`/").replace("/", ".")
            allowed = set(re.findall(r"`([\w./]+)/`", cells[-1]))
            rows[unit] = {a.replace("/", ".") for a in allowed}
    expected = {u: (set(UNITS) if u == "node.cli" else ALLOWED[u]) - {u} for u in UNITS}
    assert rows == expected
