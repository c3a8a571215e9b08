"""A third party's environment package, installed the way importlib.metadata finds one: a module and a
dist-info directory on sys.path (no pip, nothing mocked: the registry reads the real entry points)."""

from __future__ import annotations

import textwrap
from pathlib import Path

PLUGIN_MODULE = "toy_words_plugin"
PLUGIN = textwrap.dedent(
    '''
    """A third party's environment: every task asks for the length of a word."""
    import hashlib

    from prime_node.node.environments import EnvironmentIdentity, ScoringLimits, Task

    WORDS = ("a", "bb", "ccc", "dddd", "eeeee", "ff", "g", "hhh", "iiii", "jj", "kkkkk", "l")


    class WordLength:
        """ARGS `parity` makes the scorer pass every completion of even length: an untrained model then
        passes some samples and fails others, which is what a difficulty filter needs to cut."""

        def __init__(self, args):
            self.args = args or "plain"

        @property
        def spec(self):
            return "toy_words:" + self.args

        @property
        def identity(self):
            digest = hashlib.sha256(self.args.encode()).hexdigest()
            return EnvironmentIdentity(
                name="toy_words", package="toy-words", version="1.2.3", content_hash="sha256:" + digest
            )

        @property
        def scoring(self):
            return ScoringLimits(isolation="inline")

        def __len__(self):
            return len(WORDS)

        def get(self, index):
            word = WORDS[index]
            return Task(prompt=f"len({word})=", answer=str(len(word)), task_type="toy")

        def score(self, completion, task):
            if self.args == "parity":
                return 1.0 if len(completion) % 2 == 0 else 0.0
            return 1.0 if completion.strip() == task.answer else 0.0


    def open_words(args, *, seed=0):
        """Lengths of words (a toy)."""
        if args not in ("", "plain", "hard", "parity"):
            raise ValueError(f"unknown mode {args!r}")
        return WordLength(args)


    def not_an_environment(args, *, seed=0):
        return {"tasks": WORDS}


    def refuses(args, *, seed=0):
        raise ValueError("no ARGS allowed")
    '''
)


def distribution(site: Path, name: str, version: str, entry_points: dict[str, str]) -> None:
    """An installed distribution as importlib.metadata finds it on sys.path: its dist-info directory."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[prime_node.environments]\n{lines}")


def install_toy_words(site: Path, **extra_entry_points: str) -> Path:
    """The toy-words 1.2.3 package in `site` (add it to sys.path): environment `toy_words`, and any extra
    entry points (name -> module:object)."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{PLUGIN_MODULE}.py").write_text(PLUGIN)
    distribution(
        site, "toy-words", "1.2.3", {"toy_words": f"{PLUGIN_MODULE}:open_words", **extra_entry_points}
    )
    return site
