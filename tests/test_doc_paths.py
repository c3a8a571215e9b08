"""Every repository path named in docs/, README.md and the packages' docstrings and comments resolves.

A moved or renamed module leaves its old path behind in prose, where nothing else would notice: a
newcomer then follows a sign to a room that is gone. Paths are recognised by their first folder (one of
the repository's top-level folders) and checked against the working tree; `name.py:123` and `#anchor`
suffixes are dropped, and a path may name a file or a folder.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP_FOLDERS = ("node", "p2p", "proofs", "trainer", "tests", "docs", "benchmarks", "scripts", ".ci")
PROSE = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_FOLDERS = ("node", "p2p", "proofs", "trainer", "tests", "benchmarks", "scripts")
# A path: a top folder, then segments of name characters; an optional trailing slash names a folder.
_PATH = re.compile(
    r"(?<![\w./-])(?:" + "|".join(re.escape(t) for t in TOP_FOLDERS) + r")/[A-Za-z0-9_.*{}/-]*[A-Za-z0-9_/]"
)
# Paths that are examples of a layout rather than files of this repository (a data directory's contents).
_NOT_OURS = re.compile(r"\{|\*|<")


def _candidates(text: str) -> set[str]:
    found = set()
    for match in _PATH.finditer(text):
        path = match.group(0).rstrip("/.")
        if _NOT_OURS.search(path):
            continue
        found.add(path)
    return found


# A segment in capitals is a placeholder (`benchmarks/NAME.py`), not a file.
_PLACEHOLDER = re.compile(r"(^|/)[A-Z][A-Z_]*(\.|/|$)")
# Files that name paths on purpose that do not exist: the layer test writes a violating module there.
_EXEMPT = {"tests/test_layers.py"}


def _resolves(path: str) -> bool:
    """A file or folder, a module named without `.py`, or `module.attribute` (trainer/grpo/loss.grpo_loss)."""
    if _PLACEHOLDER.search(path) or (ROOT / path).exists() or (ROOT / f"{path}.py").exists():
        return True
    head, _, last = path.rpartition("/")
    module = last.split(".", 1)[0]
    return bool(module) and (ROOT / head / f"{module}.py").exists()


def _code_files() -> list[Path]:
    files = []
    for folder in CODE_FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh") and p.is_file()]
    return files


def test_every_path_in_the_docs_resolves():
    missing = {
        f"{doc.relative_to(ROOT)}: {path}"
        for doc in PROSE
        for path in _candidates(doc.read_text(encoding="utf-8"))
        if not _resolves(path)
    }
    assert not missing, "paths in docs that do not exist:\n" + "\n".join(sorted(missing))


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_in_the_docs_resolves():
    missing = set()
    for doc in PROSE:
        for target in _LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            if not (doc.parent / target.split("#", 1)[0]).exists():
                missing.add(f"{doc.relative_to(ROOT)}: {target}")
    assert not missing, "links in docs that lead nowhere:\n" + "\n".join(sorted(missing))


def test_every_path_in_docstrings_and_comments_resolves():
    missing = set()
    for source in _code_files():
        if source == Path(__file__).resolve() or str(source.relative_to(ROOT)) in _EXEMPT:
            continue
        for path in _candidates(source.read_text(encoding="utf-8")):
            if not _resolves(path):
                missing.add(f"{source.relative_to(ROOT)}: {path}")
    assert not missing, "paths in code that do not exist:\n" + "\n".join(sorted(missing))


def test_the_path_finder_sees_a_broken_path():
    """The check itself: a made-up path in prose is found and reported, an existing one is not."""
    text = (
        "see node/contributor/daemon.py and p2p/weights/nowhere.py:12, docs/architecture.md#layers, "
        "trainer/validator/verify_job.verify_spooled and trainer/verify_job.verify_spooled."
    )
    paths = _candidates(text)
    assert paths == {
        "node/contributor/daemon.py",
        "p2p/weights/nowhere.py",
        "docs/architecture.md",
        "trainer/validator/verify_job.verify_spooled",
        "trainer/verify_job.verify_spooled",
    }
    broken = [p for p in sorted(paths) if not _resolves(p)]
    assert broken == ["p2p/weights/nowhere.py", "trainer/verify_job.verify_spooled"]
