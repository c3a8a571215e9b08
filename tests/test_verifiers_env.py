"""Single-turn tasksets of the `verifiers` library (node/environments/verifiers_env.py, the optional extra):
real tasksets written as verifiers packages in a temporary directory, loaded by verifiers' own loader,
scored through its own `Task.score` in the bounded scorer's worker; the kinds that cannot work offline in
one turn are refused naming why."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prime_node.node.environments.scoring import BoundedScorer
from prime_node.node.environments.verifiers_env import open_verifiers
from prime_node.node.errors import TaskError

HEADER = """
import verifiers.v1 as vf

class Data(vf.TaskData):
    answer: str

class Config(vf.TasksetConfig):
    num_tasks: int = 4
"""
TASKSETS = {
    "vf_g2_arith": """
class ArithTask(vf.Task[Data]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply == self.data.answer else 0.0

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.isdigit() else 0.0

class ArithTaskset(vf.Taskset[ArithTask, Config]):
    def load(self):
        rows = [Data(prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(self.config.num_tasks)]
        return [ArithTask(row, self.config.task) for row in rows]

__all__ = ["ArithTaskset"]
""",
    "vf_g2_container": """
class BoxTask(vf.Task[Data]):
    NEEDS_CONTAINER = True

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0

class BoxTaskset(vf.Taskset[BoxTask, Config]):
    def load(self):
        return [BoxTask(Data(prompt="p", answer="a"), self.config.task)]

__all__ = ["BoxTaskset"]
""",
    "vf_g2_runtime": """
class RunTask(vf.Task[Data]):
    @vf.reward
    async def tests_pass(self, trace: vf.Trace, runtime) -> float:
        return 1.0

class RunTaskset(vf.Taskset[RunTask, Config]):
    def load(self):
        return [RunTask(Data(prompt="p", answer="a"), self.config.task)]

__all__ = ["RunTaskset"]
""",
    "vf_g2_tools": """
class ToolTask(vf.Task[Data]):
    @classmethod
    def toolsets(cls, config):
        return ["a tool server"]

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0

class ToolTaskset(vf.Taskset[ToolTask, Config]):
    def load(self):
        return [ToolTask(Data(prompt="p", answer="a"), self.config.task)]

__all__ = ["ToolTaskset"]
""",
    "vf_g2_endless": """
class EndlessTask(vf.Task[Data]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply == self.data.answer else 0.0

class EndlessTaskset(vf.Taskset[EndlessTask, Config]):
    INFINITE = True

    def load(self):
        i = 0
        while True:
            yield EndlessTask(Data(prompt=f"echo {i}", answer=str(i)), self.config.task)
            i += 1

__all__ = ["EndlessTaskset"]
""",
}


@pytest.fixture
def tasksets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pytest.importorskip(
        "verifiers.v1",
        reason="the optional extra `verifiers` is not installed: pip install -e '.[verifiers]'",
    )
    for name, body in TASKSETS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(HEADER + textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))  # the scoring worker inherits sys.path
    return tmp_path


def test_a_single_turn_taskset_is_scored_by_its_own_rewards_in_the_bounded_worker(tasksets: Path) -> None:
    env = open_verifiers("taskset=vf_g2_arith,num_tasks=3")
    assert len(env) == 3
    task = env.get(2)
    assert (task.prompt, task.answer) == ("2+2=", "4")
    assert (
        env.identity.package == "verifiers" and env.identity.version == "0.4.0"
    )  # a module, not a distribution
    with BoundedScorer(env.scoring) as scorer:
        # Weighted mean of `correct` (1.0) and `digits` (0.5): right 1, a wrong number 1/3, text 0.
        completions = ["4", " 4\n", "5", "four", ""]
        bounded = [scorer.score(env, c, task) for c in completions]
        assert bounded == [env.score(c, task) for c in completions] == [1.0, 1.0, 0.5 / 1.5, 0.0, 0.0]
        assert not scorer.breaches
    # The configuration and the reward code are in the identity.
    assert open_verifiers("taskset=vf_g2_arith,num_tasks=3").identity == env.identity
    assert open_verifiers("taskset=vf_g2_arith,num_tasks=4").identity != env.identity
    source = tasksets / "vf_g2_arith" / "__init__.py"
    source.write_text(source.read_text().replace("weight=0.5", "weight=0.25"))
    for name in [n for n in sys.modules if n.startswith("vf_g2_arith")]:
        del sys.modules[name]
    assert open_verifiers("taskset=vf_g2_arith,num_tasks=3").identity != env.identity


def test_an_endless_taskset_needs_a_size(tasksets: Path) -> None:
    with pytest.raises(TaskError, match="never ends; give size=N"):
        open_verifiers("taskset=vf_g2_endless")
    env = open_verifiers("taskset=vf_g2_endless,size=5")
    assert len(env) == 5 and env.get(4).prompt == "echo 4"
    assert env.score("4", env.get(4)) == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("taskset=vf_g2_container", "needs a container"),
        ("taskset=vf_g2_runtime", "tests_pass need a runtime"),
        ("taskset=vf_g2_tools", "uses tool servers"),
        ("taskset=vf_g2_no_such_module", "cannot be loaded"),
        ("taskset=owner/vf_g2_arith@1.0", "hub ids are not fetched"),
        ("taskset=vf_g2_arith,num_tasks=many", "cannot be loaded"),
        ("num_tasks=3", "name the taskset"),
        ("taskset=vf_g2_endless,size=0", "size must be an integer"),
    ],
)
def test_unsupported_tasksets_are_refused_naming_why(tasksets: Path, args: str, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        open_verifiers(args)


def test_without_the_extra_the_environment_says_what_to_install() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["verifiers"] = None  # as if the extra were not installed
        from prime_node.node.environments.verifiers_env import open_verifiers
        from prime_node.node.errors import TaskError
        try:
            open_verifiers("taskset=anything")
        except TaskError as exc:
            print(exc)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert "pip install -e '.[verifiers]'" in out.stdout
