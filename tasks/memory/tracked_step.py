"""One stage-1 batch and one stage-2 micro-step under torch's memory tracker, by part.

The same calls the ranks make (the V2 units under no_grad; the V1 units, the family's training
loss, backward, the optimizer's step, the EMA's), on fake tensors for an estimate or on real ones
for a measurement. `MemTracker` counts every tensor storage by category; the parts named here
split its parameters into frozen and trained and its "other" tensors into the EMA and inputs.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from splitstage.config.job import TrainConfig
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import RunnableUnit, StepContext, run_units
from splitstage.tasks.memory.sharded_step import (
    ShardedTracker,
    hold_accumulated_gradients,
    sharded_peak_parts,
)
from splitstage.tasks.stage2.optimization import TrainedAverage, build_optimizer

CATEGORY_PARTS = {  # MemTracker's categories -> this plan's parts
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "activations",
}


class Tracker(MemTracker):
    """torch's MemTracker with the whole process's peak alone (not every module's: that walk
    per op costs O(ops x modules)), its gradient hooks only on parameters that get gradients
    (torch 2.13 hooks every parameter a module holds; a frozen one refuses a hook), and a
    module called twice in one forward allowed."""

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        """A top-level module called again in the same forward (a text encoder on the prompt,
        then on ''; torch refuses it as a second iteration) is tracked afresh."""
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        """The per-device peak and its snapshot (torch's, without the per-module peaks)."""
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        """As torch's, with the hooks on trained parameters alone."""
        counts = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if not install_grad_hooks:
            return counts
        for param in module.parameters():
            if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(self._count_gradient),
                    param.register_post_accumulate_grad_hook(
                        lambda p: self._count_gradient(p.grad)
                    ),
                )
        return counts

    def _count_gradient(self, grad: torch.Tensor) -> None:
        """Count a gradient as one (torch's own hook's body)."""
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (a view shares its base's)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        for storage in _storages(tensor):
            seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages under a tensor: its own, or a quantized tensor's parts' (data, scales)."""
    if isinstance(tensor, DTensor):  # a sharded parameter: this rank's shard
        return _storages(tensor.to_local())
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        parts = [getattr(tensor, name) for name in names]
        return [s for part in parts if isinstance(part, torch.Tensor) for s in _storages(part)]
    return [tensor.untyped_storage()]


def weight_parts(models: Mapping[str, nn.Module]) -> dict[str, int]:
    """Frozen weights (frozen parameters and buffers) and trained parameters, in bytes, from the
    built models' own tensors (their dtypes, and their quantized layouts where a base has one)."""
    frozen: list[torch.Tensor] = []
    trained: list[torch.Tensor] = []
    for model in models.values():
        for param in model.parameters():
            (trained if param.requires_grad else frozen).append(param)
        frozen += list(model.buffers())
    return {"frozen_weights": storage_bytes(frozen), "trained_params": storage_bytes(trained)}


def peak_parts(tracker: MemTracker, weights: Mapping[str, int], ema: int) -> dict[str, int]:
    """The tracker's peak snapshot as this plan's parts (inputs and the EMA are 'Other')."""
    snapshots = tracker.get_tracker_snapshot("peak")
    snapshot = next(iter(snapshots.values()), {})
    parts = {**weights, "gradients": 0, "optimizer_state": 0, "ema": ema, "activations": 0}
    for category, part in CATEGORY_PARTS.items():
        parts[part] += int(snapshot.get(category, 0))
    # Tensors no module owns (the batch's inputs, what a unit made outside any module) and the
    # EMA: the tracker's "Other"; what the parts above do not explain is counted as inputs.
    total = int(snapshot.get(_TOTAL_KEY, 0))
    parts["inputs"] = max(0, total - sum(parts.values()))
    return parts


@contextlib.contextmanager
def autocast_as_ranks(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """The rank's autocast (accelerate's for `train.mixed_precision`): none in fp32."""
    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


def stage1_peak(
    units: Sequence[RunnableUnit],
    models: Mapping[str, nn.Module],
    batch: dict[str, Any],
    device: torch.device,
    settings: Mapping[str, Any],
) -> tuple[dict[str, int], dict[str, Any]]:
    """(parts at the peak, the batch after the V2 units) of one stage-1 batch under no_grad."""
    tracker = Tracker()
    tracker.track_external(*models.values(), *_tensors(batch))
    size = len(batch["prompt"]) if isinstance(batch.get("prompt"), list) else 1
    ctx = StepContext(models, device, Draws.per_sample(0, step_keys(size), 0), settings)
    with tracker, torch.no_grad():
        run_units(units, ctx, batch)
    return peak_parts(tracker, weight_parts(models), 0), batch


def stage2_peak(
    family: Any,
    units: Sequence[RunnableUnit],
    models: Mapping[str, nn.Module],
    inputs: dict[str, Any],
    train: TrainConfig,
    device: torch.device,
    compute_dtype: torch.dtype,
    seed: int,
    *,
    sharded: nn.Module | None = None,
) -> dict[str, int]:
    """Parts at the peak of one steady-state micro-step: the optimizer's state (and the EMA)
    already made by an update before it, then V1 units, loss, backward and the update. With
    gradient accumulation, the last micro-batch of an update, after an untracked one that left
    its gradients in place (the next forward runs beside them: a full fine-tune's whole
    gradient); with `sharded` (the trained model as `fully_shard` wrapped it) under
    FSDPMemTracker, the earlier one leaves them unreduced, as FSDP2 holds them."""
    params = [p for model in models.values() for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, train)
    for param in params:  # the state exists from the first update on: make it first
        param.grad = torch.zeros_like(param)
    probed = 0
    try:
        optimizer.step()
    except DataDependentOutputException:  # a step that reads values (Prodigy: p.any())
        optimizer, probed = None, probed_state_bytes(params, train)
    for param in params:
        param.grad = None
    average = TrainedAverage(params, train.ema.decay, 0) if train.ema else None
    ema = storage_bytes(average.ema.shadow_params) if average is not None else 0
    weights = weight_parts(models)  # this rank's shards where `sharded`

    def forward_backward(batch: dict[str, Any]) -> None:
        """V1 units, the family's loss and backward on `batch` (the ranks' micro-batch)."""
        draws = Draws.per_sample(seed, step_keys(_batch_size(batch)), 0)
        ctx = StepContext(models, device, draws, family.settings())
        with autocast_as_ranks(compute_dtype, device):
            run_units(units, ctx, batch)
            loss = family.training_loss(ctx, batch)
        loss.backward()

    if train.gradient_accumulation_steps > 1:
        if sharded is not None:
            hold_accumulated_gradients(sharded, lambda: forward_backward(dict(inputs)))
        else:
            forward_backward(dict(inputs))  # its gradients stay for the tracked micro-batch
    tracker = Tracker() if sharded is None else ShardedTracker(sharded, optimizer)
    tracker.track_external(*models.values(), optimizer, *_tensors(inputs))
    if average is not None:
        tracker.track_external(*average.ema.shadow_params)
    with tracker:
        forward_backward(inputs)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if average is not None:
            average.step()
    if sharded is None:
        parts = peak_parts(tracker, weights, ema)
    else:
        parts = sharded_peak_parts(tracker, weights, ema)
    parts["optimizer_state"] += probed  # held through the whole step (its update's own
    return parts  # temporaries are not counted then)


def probed_state_bytes(params: Sequence[torch.Tensor], train: TrainConfig) -> int:
    """The optimizer's state bytes for `params`, from its real class stepped on a real random
    tensor of each distinct shape and dtype, one at a time (for optimizers whose step reads
    values, which fake tensors do not have)."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]  # a rank's shards
    shapes = Counter((tuple(p.shape), p.dtype) for p in local)
    total = 0
    for (shape, dtype), count in shapes.items():
        probe = nn.Parameter(torch.randn(shape).to(dtype))
        probe.grad = torch.randn_like(probe)
        optimizer = build_optimizer([probe], train)
        optimizer.step()
        state = [t for t in optimizer.state[probe].values() if isinstance(t, torch.Tensor)]
        total += count * storage_bytes([t for t in state if t.dim()])
    return total


def step_keys(size: int) -> list[str]:
    """Sample keys for a step's draws (any hex names: the values drawn do not matter here)."""
    return [f"{index:064x}" for index in range(size)]


def _tensors(values: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors among a batch's values."""
    return [value for value in values.values() if isinstance(value, torch.Tensor)]


def _batch_size(inputs: Mapping[str, Any]) -> int:
    """Samples in a batch: the first tensor's leading dimension."""
    return next((len(t) for t in _tensors(inputs) if t.dim()), 1)
