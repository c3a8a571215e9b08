"""The devnet's synthetic run (`prime-node devnet --synthetic`): when to stop, and the dataset it ends with.

A synthetic run has no policy steps to count: it is done once the validator has accepted `target_files`
files and every adversary is banned; it stalls when no file is accepted for the stall timeout. After every
process has stopped, the dataset is built from the validator's ledger and the trainer's accepted directory,
trusting the operator's key alone (the devnet's validator signs with it), exactly as `prime-node dataset
build` would be run by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...node.run.settings import RunSettings
from ..dataset.build import build_dataset
from ..dataset.settings import DatasetSection
from .layout import DevnetLayout


@dataclass(frozen=True)
class SyntheticOptions:
    target_files: int = 12  # accepted files (of every member) after which the run stops


def dataset_settings(layout: DevnetLayout) -> tuple[RunSettings, DatasetSection]:
    """The run and the dataset inputs of the devnet's run directory."""
    run = RunSettings(run_id=layout.run_id, env=layout.env_spec, run_kind="synthetic")
    section = DatasetSection(
        ledgers=[layout.ledger_path],
        accepted_dir=layout.accepted_dir,
        weights_dir=layout.weights_dir,
        validator_keys=[layout.operator.node_id],
        operator_key=layout.operator.node_id,
        model_label=layout.run_id,
    )
    return run, section


def build_devnet_dataset(layout: DevnetLayout) -> dict[str, Any]:
    """Build `<run dir>/dataset`; the report's `dataset` entry."""
    run, section = dataset_settings(layout)
    result = build_dataset(run, section, layout.dataset_dir, force=True)
    return {"path": str(result.out), "counts": result.meta["counts"], "skipped": result.meta["skipped"]}
