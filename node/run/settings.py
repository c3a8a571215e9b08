"""Typed settings of `prime-node rollout` and `prime-node verify`, and the run's task rules they load.

The command line builds its flags from these models, so this module imports neither torch nor transformers at
load time: the tokenizer and the task rules load when `load_run_tasks` runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, field_validator, model_validator

from ...p2p.names import MAX_ANNOTATORS, MAX_LENGTH_TARGET, MODEL_LABEL_PATTERN, RUN_ID_PATTERN, RUN_ID_RULE
from ...p2p.pipeline.layout import StageLayout
from ...proofs.bounds import Precision
from ...proofs.verifier_settings import VerifierSettings
from ..config import CommonSettings, Section
from ..engine import EngineSettings
from ..environments import Environment, open_environment, parse_spec, spec_of_tasks
from ..environments.registry import MAX_SPEC_CHARS
from ..errors import NodeError, TaskError
from .prompts import MAX_SYSTEM_PROMPT_CHARS

if TYPE_CHECKING:
    from .validation import RunTasks

# A pipelined group batch's output tokens (prompts x samples x max_new_tokens) travel in every end frame as int64
# (8 bytes each) and every stage holds them as Python lists (about 40 bytes each): 2^22 keeps the end frame at
# 32 MiB and the lists near 170 MB, far under the wire bound (256 MiB) at which they would pass 1 GB.
MAX_PIPELINE_COMPLETION_ENTRIES = 1 << 22


class RunSettings(Section):
    """The run's parameters that both the contributor and the validator must agree on."""

    # The DHT keys and the checkpoint manifests of the run carry it (one rule: p2p/names.py), and nodes take
    # their swarm's run id from it.
    run_id: str = Field("local", pattern=RUN_ID_PATTERN, description=f"Name of the RL run: {RUN_ID_RULE}.")
    run_seed: int = Field(0, ge=0, lt=2**64, description="Seed of the deterministic work assignment.")
    # A synthetic run (docs/synthetic.md) produces a verified dataset instead of a trained policy: the trainer
    # publishes its model once and never updates it (the policy record says `frozen`), and everything else
    # (assignment, proofs, rewards, verification, credit) is the same as in an RL run.
    run_kind: Literal["rl", "synthetic"] = Field(
        "rl", description="rl: train the policy; synthetic: frozen model, the output is a verified dataset."
    )
    annotators: list[Annotated[str, Field(pattern=MODEL_LABEL_PATTERN)]] = Field(
        default_factory=list,
        max_length=MAX_ANNOTATORS,
        description="Synthetic runs: labels of the models whose verified rollouts annotate task difficulty "
        "(pass@k per task and model, prime-node dataset build); empty: the run's own model only.",
    )
    env: str | None = Field(
        None,
        max_length=MAX_SPEC_CHARS,
        description="Task environment NAME[:ARGS] (prime-node tasks list; docs/environments.md); default "
        "arithmetic, or run.tasks.",
    )
    tasks: str | None = Field(
        None, description="Task file (Parquet/JSONL) or builtin:arithmetic: shorthand of env file:PATH."
    )
    task_seed: int = Field(
        0,
        ge=0,
        lt=2**63,
        description="Seed of generated environments (arithmetic) unless env's ARGS give one.",
    )
    samples: int = Field(4, ge=1, le=1024, description="Completions per prompt (G).")
    length_targets: list[Annotated[int, Field(ge=1, le=MAX_LENGTH_TARGET)]] = Field(
        default_factory=list, max_length=32, description="Thinking-length targets in tokens; empty: off."
    )
    length_alpha: float = Field(
        0.001, ge=0, le=1, description="Length penalty per token of distance to target."
    )
    system_prompt: str = Field(
        "",
        max_length=MAX_SYSTEM_PROMPT_CHARS,
        description="System message before every prompt; needs a chat model (docs/model.md). Empty: none.",
    )
    # Sampling is the run's, not each node's: a node free to pick them would sample cooler (higher rewards,
    # proofs still honest) or shorter (cheaper work), and the trainer's log-probabilities assume one temperature.
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature every rollout must use.")
    max_new_tokens: int = Field(
        64, ge=1, le=8192, description="Most tokens per sample; every rollout must use it."
    )
    compute_dtype: Precision = Field(
        "float32",
        description="Dtype every contributor generates in; it picks the calibrated proof bounds (validators "
        "prefill in float32 either way; docs/proofs.md). float32 catches far subtler cheats; bfloat16 suits GPU "
        "fleets.",
    )
    # Pinned like every other run parameter: members of a pipelined group and their validator must cut the
    # model at the same layers and encode activations alike (docs/pipeline.md).
    pipeline: StageLayout | None = Field(
        None,
        description="Pipeline stage layout: layer boundaries (e.g. [0, 2, 4]) and activation dtype; none: "
        "no pipelined groups (set in the config file or PRIME_NODE_RUN__PIPELINE as JSON).",
    )

    @field_validator("system_prompt")
    @classmethod
    def _utf8(cls, text: str) -> str:
        try:  # an environment variable can smuggle undecodable bytes in as lone surrogates
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"not valid UTF-8 text at character {exc.start}") from None
        return text

    @field_validator("env")
    @classmethod
    def _spec(cls, env: str | None) -> str | None:
        if env is not None:
            try:  # its syntax now, at load; the environment itself is opened by the roles
                parse_spec(env)
            except TaskError as exc:
                raise ValueError(str(exc)) from None
        return env

    @model_validator(mode="after")
    def _one_source(self) -> RunSettings:
        if self.env is not None and self.tasks is not None:
            raise ValueError("set run.env or run.tasks, not both (run.tasks PATH is run.env file:PATH)")
        if self.annotators and self.run_kind != "synthetic":
            raise ValueError("run.annotators needs run.run_kind = synthetic (an RL run annotates nothing)")
        if len(set(self.annotators)) != len(self.annotators):
            raise ValueError("run.annotators names a model twice")
        if self.pipeline is not None:
            entries = self.pipeline.prompts * self.samples * self.max_new_tokens
            if entries > MAX_PIPELINE_COMPLETION_ENTRIES:
                raise ValueError(
                    f"run.pipeline.prompts x run.samples x run.max_new_tokens is {entries} output tokens per "
                    f"group batch; at most {MAX_PIPELINE_COMPLETION_ENTRIES}: every end frame carries them all "
                    'and every stage holds them (docs/pipeline.md, "Wire format")'
                )
        return self

    @property
    def frozen(self) -> bool:
        """True when the trainer never updates the model (a synthetic run)."""
        return self.run_kind == "synthetic"

    @property
    def env_spec(self) -> str:
        """The run's environment spec: run.env, else run.tasks in environment form (arithmetic by default)."""
        return self.env if self.env is not None else spec_of_tasks(self.tasks)


def engine_for_run(engine: EngineSettings, run: RunSettings) -> EngineSettings:
    """The engine settings with the run's compute dtype: `auto` becomes it, anything else must equal it.

    The validator's TOPLOC and sampling bounds are calibrated per precision and the file does not say
    which one a node used (a cheater would claim the looser one), so the run fixes it for everyone: a
    node in another dtype would have every file rejected, and is stopped at start-up instead.
    """
    if engine.dtype == "auto":
        return engine.model_copy(update={"dtype": run.compute_dtype})
    if engine.dtype != run.compute_dtype:
        raise NodeError(
            f"engine.dtype is {engine.dtype} but the run computes in {run.compute_dtype} "
            f"(run.compute_dtype): validators would reject every rollout; leave engine.dtype at auto"
        )
    return engine


def validator_engine(engine: EngineSettings) -> EngineSettings:
    """The validator's prefill engine: float32 whatever the run's dtype.

    Both sets of proof bounds were calibrated against a float32 prefill (bf16 nodes included: the bf16
    bounds measure how far a bf16 node strays from float32); a bf16 prefill would add its own rounding on
    top, which no bound was measured for.
    """
    if engine.dtype == "auto":
        return engine.model_copy(update={"dtype": "float32"})
    if engine.dtype != "float32":
        raise NodeError(
            f"engine.dtype is {engine.dtype}, but a validator prefills in float32: the proof bounds are "
            "calibrated against a float32 prefill (docs/proofs.md); leave engine.dtype at auto"
        )
    return engine


# The verifier's fields a command that loads a run takes from its [run] section (verifier field -> run field).
VERIFIER_FIELDS_FROM_RUN = {
    "run_id": "run_id",
    "run_seed": "run_seed",
    "samples_per_prompt": "samples",
    "temperature": "temperature",
    "max_new_tokens": "max_new_tokens",
    "node_precision": "compute_dtype",
}
# For those commands' MOVED tables: a `[verifier] temperature` would otherwise be accepted and then silently
# replaced by the run's, and the operator would believe their validator checks a value it does not.
VERIFIER_SETTINGS_SET_BY_RUN = {
    f"verifier.{mine}": f"run.{theirs}" for mine, theirs in VERIFIER_FIELDS_FROM_RUN.items()
}


def verifier_for_run(verifier: VerifierSettings, run: RunSettings) -> VerifierSettings:
    """The verifier settings bound to the run: its id, seed, group size, sampling and compute dtype."""
    return verifier.model_copy(
        update={mine: getattr(run, theirs) for mine, theirs in VERIFIER_FIELDS_FROM_RUN.items()}
    )


# Node-level before the run fixed them for everyone (see RunSettings).
MOVED_TO_RUN = {"temperature": "run.temperature", "max_new_tokens": "run.max_new_tokens"}


class RolloutSettings(CommonSettings):
    MOVED = MOVED_TO_RUN

    run: RunSettings = Field(default_factory=RunSettings, description="Run parameters.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="Inference engine.")
    prompts: int = Field(4, ge=1, le=4096, description="Prompts in the batch.")


class VerifySettings(CommonSettings):
    MOVED = VERIFIER_SETTINGS_SET_BY_RUN

    run: RunSettings = Field(default_factory=RunSettings, description="Run parameters.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="Inference engine.")
    verifier: VerifierSettings = Field(default_factory=VerifierSettings, description="Checks and thresholds.")


def open_run_environment(run: RunSettings) -> Environment:
    """The run's environment (a file is read, checked and hashed: call it off the event loop)."""
    return open_environment(run.env_spec, seed=run.task_seed)


def load_run_tasks(run: RunSettings, checkpoint: Path, environment: Environment | None = None) -> RunTasks:
    """The run's task rules with the checkpoint's own tokenizer and chat template (PromptError, at once, when
    the template cannot render the run's prompts). Long-running processes pass the environment they opened
    once at start (the one whose identity they compared with the run's), so that a task file edited in place
    later cannot change the tasks under them; None opens it now."""
    from transformers import AutoTokenizer

    from .validation import RunTasks

    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise NodeError(f"cannot load the tokenizer of {checkpoint}: {exc}") from None
    return RunTasks(
        environment if environment is not None else open_run_environment(run),
        tokenizer,
        length_targets=run.length_targets,
        length_alpha=run.length_alpha,
        system_prompt=run.system_prompt,
    )
