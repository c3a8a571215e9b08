"""The trainer's blocking half: resume or start from genesis, train one batch, save, publish.

Everything here touches torch or the disk, so the service (trainer/service/service.py) calls it from a worker thread.
Order of durable writes per rollout step N -> N + 1 (docs/trainer.md, "Crash safety"):
reserve batch (ledger) -> train -> save_train_state(N + 1) -> publish(N + 1) -> commit batch (ledger).
A crash anywhere resumes from the newest complete state; `resume` publishes it if the crash came between
saving and publishing, and `ConsumedLedger.recover` decides which reservations the state contains.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel

from ...node.engine.hf import load_hf_model
from ...node.errors import NodeError
from ...p2p.identity import Identity
from ...p2p.weights.manifest import SignedManifest
from ...p2p.weights.publish import publish
from ...p2p.weights.store import Store
from ..errors import TrainerError
from ..grpo.config import TrainerSettings
from ..grpo.packing import check_packing_isolation
from ..grpo.schedule import build_optimizer, build_scheduler
from ..grpo.step import RolloutStepReport, train_rollout_step
from .batch_buffer import Batch
from .consumed import ConsumedLedger
from .train_state import (
    latest_train_state,
    load_optimizer_state,
    prune_train_states,
    save_train_state,
    step_dir,
)

logger = logging.getLogger(__name__)

# Trainer-only files of a state directory: never published (optimizer moments are the operator's own data).
PRIVATE_FILES = frozenset({"optimizer.pt", "trainer_state.json"})


def _load(model_dir: Path) -> PreTrainedModel:
    try:
        return load_hf_model(model_dir, "cpu", torch.float32)
    except NodeError as exc:
        raise TrainerError(str(exc)) from None


class Learner:
    """Model, optimizer, schedule and reference of a trainer, plus its state root and weights store."""

    def __init__(
        self,
        settings: TrainerSettings,
        model_dir: Path,
        state_root: Path,
        store: Store,
        ledger: ConsumedLedger,
        identity: Identity,
        run_id: str,
    ) -> None:
        self.settings = settings
        self.model_dir = Path(model_dir)
        self.state_root = Path(state_root)
        self.store = store
        self.ledger = ledger
        self.identity = identity
        self.run_id = run_id
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TrainerError(f"cannot load the tokenizer of {self.model_dir}: {exc}") from None
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.step = 0
        self.model: PreTrainedModel | None = None
        self.reference: PreTrainedModel | None = None
        self.optimizer: torch.optim.AdamW | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.manifest: SignedManifest | None = None

    def resume(self) -> int:
        """Load the newest state (or make step 0 from --model), settle the ledger, publish if needed."""
        latest = latest_train_state(self.state_root)
        source = latest[1] if latest else self.model_dir
        model = _load(source)
        check_packing_isolation(model)
        model.train()
        self.optimizer = build_optimizer(model, self.settings)
        self.scheduler = build_scheduler(self.optimizer, self.settings)
        self.model = model
        if latest is None:
            self.step = 0
            save_train_state(self.state_root, 0, model, self.optimizer, self.scheduler, self.tokenizer)
            logger.info("genesis: step 0 is %s", self.model_dir)
        else:
            self.step = load_optimizer_state(latest[1], self.optimizer, self.scheduler)
            if self.step != latest[0]:
                raise TrainerError(
                    f"{latest[1]} records step {self.step}; delete it to resume from the previous one"
                )
        if self.settings.kl_coef > 0.0:
            # The frozen reference is the warm-start (the --model weights), as in INTELLECT-2.
            self.reference = _load(self.model_dir)
            self.reference.requires_grad_(False)
        committed, released = self.ledger.recover(self.step)
        logger.info(
            "resuming at policy step %d (reservations: %d committed, %d released)",
            self.step,
            committed,
            released,
        )
        self.manifest = self._publish_current()
        return self.step

    def _publish_current(self) -> SignedManifest:
        """Publish the current state unless the store already holds it (a crash after publishing)."""
        if self.store.high_water() >= self.step:
            return self.store.load_manifest(self.step, self.identity.node_id)
        source = step_dir(self.state_root, self.step)
        staging = self.state_root / f".publish-{self.step:08d}-{os.getpid()}"
        # Hard links of the HF files only: no copy, and the optimizer state never leaves this machine.
        staging.mkdir(parents=True, exist_ok=True)
        try:
            for path in source.iterdir():
                if path.is_file() and path.name not in PRIVATE_FILES and not path.name.startswith("."):
                    target = staging / path.name
                    if not target.exists():
                        os.link(path, target)
            manifest, _ = publish(
                staging, step=self.step, identity=self.identity, out_dir=self.store.root, run_id=self.run_id
            )
        finally:
            for path in staging.glob("*"):
                path.unlink()
            staging.rmdir()
        return manifest

    def train(self, batch: Batch) -> RolloutStepReport:
        """One rollout step on `batch` (reserved for the current step); weights change in place."""
        if self.model is None or self.optimizer is None or self.scheduler is None:
            raise TrainerError("resume() must run before train()")
        if batch.step != self.step:
            raise TrainerError(f"batch reserved for step {batch.step}, the trainer holds step {self.step}")
        return train_rollout_step(
            self.model,
            self.optimizer,
            self.scheduler,
            batch.train_samples(),
            self.settings,
            self.pad_id,
            self.reference,
        )

    def save_and_publish(self, keep_states: int, keep_versions: int) -> SignedManifest:
        """Checkpoint step + 1 durably, publish it, and move the step counter forward."""
        new_step = self.step + 1
        self._save_state(new_step)
        self.step = new_step
        self.manifest = self._publish_current()
        prune_train_states(self.state_root, keep_states)
        self.store.prune(keep_versions)
        return self.manifest

    def _save_state(self, step: int) -> None:
        """Write the durable train state `step` (trainer/service/fsdp_learner.py gathers the shards first)."""
        assert self.model is not None and self.optimizer is not None and self.scheduler is not None
        save_train_state(self.state_root, step, self.model, self.optimizer, self.scheduler, self.tokenizer)
