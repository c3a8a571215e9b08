"""FSDP2 sharding of the trainer's policy: the same rollout step as trainer/grpo/step.py, split across ranks.

Every rank holds a shard of every parameter (`fully_shard` per decoder layer, then the root) and of the AdamW
moments. A batch is split into optimizer parts and packed exactly as in one process; each part's packed
micro-batches are then dealt round-robin to the ranks. Each rank's micro-batch losses keep the part's GLOBAL
completion-token count as normaliser and the reduce-scatter SUMS the ranks' gradients (divide factor 1, not
FSDP's default mean), so the sharded gradient is the single-process one, up to float summation order.
FSDP all-gathers in every forward, so every rank must run the same number of them: a rank with fewer
micro-batches runs padding ones whose loss mask is empty (zero loss, zero gradient).

The trainer's state directory keeps the single-process format: the full weights (an HF directory) and an
`optimizer.pt` keyed by parameter index, gathered on rank 0. So a state saved with --fsdp resumes without it
and the reverse, at any world size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..errors import TrainerError
from .config import TrainerSettings
from .distributed import World
from .loss import LossMetrics
from .packing import PackedRows, TrainSample
from .schedule import build_optimizer, build_scheduler
from .step import RolloutStepReport, train_rollout_step

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_model(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """Shard in place: each decoder layer is its own FSDP unit (so one layer at a time is gathered), then the
    root takes the rest (embeddings, tied head, final norm)."""
    mesh = init_device_mesh(world.device.type, (world.world_size,))
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TrainerError(
            f"--fsdp shards decoder layers at model.model.layers; {type(model).__name__} has none"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in (*layers, model):
        assert isinstance(unit, FSDPModule)
        # Sum, not FSDP's mean: each rank's loss is already divided by the whole part's token count. Forcing
        # plain SUM collectives also keeps gloo working (it has neither AVG nor PREMUL_SUM reduce-scatters).
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


def deal_rows(rows: list[PackedRows], world: World) -> list[PackedRows]:
    """This rank's micro-batches: every world_size-th one, padded to the same count on every rank."""
    mine = rows[world.rank :: world.world_size]
    per_rank = -(-len(rows) // world.world_size)
    while len(mine) < per_rank:
        mine.append(_padding_rows(rows[0]))
    return mine


def _padding_rows(like: PackedRows) -> PackedRows:
    """A micro-batch that runs the model (FSDP's collectives need the forward) but contributes no loss."""
    return dataclasses.replace(
        like,
        loss_mask=torch.zeros_like(like.loss_mask),
        advantages=torch.zeros_like(like.advantages),
        sample_index=torch.full_like(like.sample_index, -1),
    )


def _all_reduce_metrics(metrics: LossMetrics, world: World) -> LossMetrics:
    names = [f.name for f in dataclasses.fields(metrics)]
    # On the default group's device: NCCL reduces CUDA tensors only.
    sums = torch.tensor([getattr(metrics, n) for n in names], dtype=torch.float64, device=world.device)
    dist.all_reduce(sums)
    return LossMetrics(**{n: float(v) for n, v in zip(names, sums.tolist(), strict=True)})


def _param_names(model: torch.nn.Module) -> list[str]:
    # build_optimizer's order: model.parameters() (tied weights once) filtered by requires_grad.
    return [name for name, p in model.named_parameters() if p.requires_grad]


class ShardedPolicy:
    """One rank's shard of the model, its AdamW and schedule, and the (sharded) frozen reference."""

    def __init__(
        self,
        model: PreTrainedModel,
        settings: TrainerSettings,
        world: World,
        optimizer_state: dict[str, Any] | None,
        scheduler_state: dict[str, Any] | None,
        reference: PreTrainedModel | None = None,
    ) -> None:
        """`model` holds the full weights of the state (the same on every rank); `optimizer_state` is that
        state's single-process optimizer state dict (None at genesis)."""
        self.world = world
        self.settings = settings
        self.config = model.config
        self.names = _param_names(model)
        world.bind_device()
        self.model = shard_model(model, world)
        self.optimizer = build_optimizer(self.model, settings)
        self.scheduler = build_scheduler(self.optimizer, settings)
        if optimizer_state is not None and optimizer_state.get("state"):
            set_optimizer_state_dict(
                self.model,
                self.optimizer,
                _by_name(optimizer_state, self.names),
                options=StateDictOptions(full_state_dict=True),
            )
        elif optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)  # no moments yet: only hyper-parameters
        if scheduler_state is not None:
            self.scheduler.load_state_dict(scheduler_state)
        self.reference = None
        if reference is not None:
            reference.requires_grad_(False)
            self.reference = shard_model(reference, world)

    def train(self, samples: Sequence[TrainSample], pad_id: int) -> RolloutStepReport:
        """trainer/grpo/step.py's rollout step on this rank's share; every rank calls it with the same batch.
        apply_step's clip_grad_norm_ on DTensor gradients reduces the norm over every shard, so all ranks clip
        alike and all skip a non-finite step together. The loss metrics are summed over the ranks."""
        self.world.bind_device()
        report = train_rollout_step(
            self.model,
            self.optimizer,
            self.scheduler,
            samples,
            self.settings,
            pad_id,
            self.reference,
            select=lambda rows: deal_rows(rows, self.world),
        )
        return dataclasses.replace(report, loss=_all_reduce_metrics(report.loss, self.world))

    def gather(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """Collective: the full weights and the single-process optimizer state, on rank 0 only (CPU)."""
        self.world.bind_device()
        weights = get_model_state_dict(self.model, options=_FULL)
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)
        if not self.world.is_leader:
            return None
        # get_model_state_dict's declared value type also covers DTensors; with _FULL they are plain tensors.
        return cast("dict[str, torch.Tensor]", weights), _by_index(optim, self.names)

    def export(self, weights: dict[str, torch.Tensor]) -> PreTrainedModel:
        """An unsharded model object around gathered weights, for save_pretrained (no copy of the tensors)."""
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config)
        missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
        if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
            raise TrainerError(
                f"gathered weights do not fit the model: missing {missing}, unexpected {unexpected}"
            )
        model.tie_weights()
        return model


def _by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Single-process optimizer state (params by index) -> torch.distributed.checkpoint's (by name)."""
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [names[i] for i in group["params"]]})
    return {"state": {names[i]: value for i, value in state["state"].items()}, "param_groups": groups}


def _by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The reverse: the optimizer.pt format that load_optimizer_state reads in one process."""
    index = {name: i for i, name in enumerate(names)}
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [index[n] for n in group["params"]]})
    return {"state": {index[n]: value for n, value in state["state"].items()}, "param_groups": groups}


class SavedOptimizer:
    """The gathered optimizer state in the shape save_train_state expects of an optimizer."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state
