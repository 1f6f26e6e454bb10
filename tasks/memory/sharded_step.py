"""Stage 2's trained model as FSDP2 shards it, for torch's FSDPMemTracker: the fake world it is
sharded over, the tracker, and its peak as the plan's parts.

As torchtitan's memory estimation does: a fake process group of the job's world size (this
process plays rank 0; no collective communicates), a device mesh on it, the ranks' own
`parallelize`, then one micro-step under `FSDPMemTracker`, which counts the rank's shards and the
blocks FSDP all-gathers in forward and backward (and their gradients before the reduce-scatter).
The same tracker on real tensors in a real group measures what a rank holds.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import _TOTAL_KEY
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from splitstage.config.job import SplitstageConfig
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.stage2.distributed import build_mesh
from splitstage.tasks.stage2.models import nf4_sharded, parallel_mode
from splitstage.tasks.stage2.parallelize import parallelize
from splitstage.tasks.stage2.quantization import nf4_before_sharding

FSDP_CATEGORY_PARTS = {  # FSDPMemTracker's categories -> this plan's parts
    "Sharded Grad": "gradients",
    "OptState": "optimizer_state",
    "Activation": "activations",
    "Temp": "activations",
    "Unsharded Param": "gathered_blocks",
    "All Gather": "gathered_blocks",
    "Unsharded Grad": "gathered_blocks",
    "Reduce Scatter": "gathered_blocks",
}


class FakeFactories(TorchDispatchMode):
    """While `active`, tensors made from nothing (no tensor argument) are made in `fake_mode`:
    run under the tracker around FSDP's own hooks, so on fake tensors the all-gather and
    reduce-scatter buffers it allocates are fake too, not real blocks of host memory."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.active = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """A factory op in fake mode while active; every other op as it is."""
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if self.active and not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            with self.fake_mode:
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class ShardedTracker(FSDPMemTracker):
    """torch's FSDPMemTracker with the whole process's peak alone (not every module's), the
    other models' weights counted as frozen buffers and other tensors as inputs (torch's
    `track_external` is a no-op here), a root called twice in one forward allowed, and on a
    fake model FSDP's buffers made fake (`FakeFactories`)."""

    def __init__(self, mod: nn.Module, optm: torch.optim.Optimizer | None = None) -> None:
        super().__init__(mod, optm)
        shard = next((p.to_local() for p in mod.parameters() if isinstance(p, DTensor)), None)
        fake = isinstance(shard, FakeTensor)
        self._factories = FakeFactories(shard.fake_mode) if fake else None

    def __enter__(self) -> ShardedTracker:
        """The fake factories beneath the tracker: it sees what they make."""
        if self._factories is not None and self._depth == 0:
            self._factories.__enter__()
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if self._factories is not None and self._depth == 0:
            self._factories.__exit__(*args)

    def _register_module_and_optimizer_hooks(self) -> None:
        """torch's, and the unreduced gradients earlier micro-batches left (FSDP2 holds them
        unsharded until the update's last backward) counted from the start."""
        super()._register_module_and_optimizer_hooks()
        for param in fsdp_params(self._root_mod):  # unsharded ones exist after a forward
            unsharded = getattr(param, "_unsharded_param", None)
            held = (getattr(unsharded, "grad", None), param.unsharded_accumulated_grad)
            for grad in held:
                if grad is not None:
                    self._update_and_maybe_create_winfos(grad, _FSDPRefType.UNSHARDED_GRAD)

    def _within_fsdp(self, hook: Any) -> Any:
        """`hook` (one of FSDP's) with the fake factories active while it runs."""
        factories = self._factories
        if factories is None:
            return hook

        @functools.wraps(hook)
        def run(*args: Any, **kwargs: Any) -> Any:
            before, factories.active = factories.active, True
            try:
                return hook(*args, **kwargs)
            finally:
                factories.active = before

        return run

    def _fsdp_state_post_forward(self, fsdp_mod: FSDPModule, orig_fsdp_state_post_fw: Any) -> Any:
        """torch's, around FSDP's hook with its buffers fake."""
        return super()._fsdp_state_post_forward(
            fsdp_mod, self._within_fsdp(orig_fsdp_state_post_fw)
        )

    def _fsdp_param_group_pre_backward(self, fsdp_mod: FSDPModule, orig: Any) -> Any:
        """torch's, around FSDP's hook with its buffers fake."""
        return super()._fsdp_param_group_pre_backward(fsdp_mod, self._within_fsdp(orig))

    def _fsdp_param_group_post_backward(self, fsdp_mod: FSDPModule, orig: Any) -> Any:
        """torch's, around FSDP's hook with its buffers fake."""
        return super()._fsdp_param_group_post_backward(fsdp_mod, self._within_fsdp(orig))

    def _update_peak_stats(self, peak_state: Any) -> None:
        """The per-device peak and its snapshot (torch's, without the per-module peaks)."""
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)

    def track_external(self, *external: nn.Module | torch.optim.Optimizer | torch.Tensor) -> None:
        """Models other than the sharded root: their parameters and buffers as frozen buffers;
        tensors: as inputs (the optimizer is the root's, tracked by torch's own hooks)."""
        for item in external:
            if isinstance(item, nn.Module) and item is not self._root_mod:
                for tensor in [*item.parameters(), *item.buffers()]:
                    self._update_and_maybe_create_winfos(tensor, _FSDPRefType.BUFFER)
            elif isinstance(item, torch.Tensor):
                self._update_and_maybe_create_winfos(item, _FSDPRefType.INP)

    def _fsdp_state_pre_forward(self, fsdp_mod: FSDPModule, orig_fsdp_state_pre_fw: Any) -> Any:
        """A sharded module called again in the same forward (a few-step loss calls the
        denoiser per step; torch refuses the root as a second iteration) is tracked afresh."""
        hook = self._within_fsdp(orig_fsdp_state_pre_fw)
        tracked = super()._fsdp_state_pre_forward(fsdp_mod, hook)

        def again(*args: Any, **kwargs: Any) -> Any:
            if fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw:
                del self.memory_tracking[fsdp_mod]
            return tracked(*args, **kwargs)

        return again


def fsdp_params(root: nn.Module) -> list[Any]:
    """FSDP2's per-parameter states (`FSDPParam`) of every sharded module under `root`."""
    sharded = [m for m in root.modules() if isinstance(m, FSDPModule)]
    groups = [m._get_fsdp_state()._fsdp_param_group for m in sharded]
    return [
        param
        for group in groups
        if isinstance(group, FSDPParamGroup)
        for param in group.fsdp_params
    ]


def hold_accumulated_gradients(root: FSDPModule, forward_backward: Callable[[], None]) -> None:
    """An earlier micro-batch of the update, untracked: its backward without the reduce-scatter
    (as the trainer's `set_gradient_sync(False)`), so every rank holds its trained parameters'
    unsharded gradients when the last micro-batch begins."""
    root.set_requires_gradient_sync(False)
    try:
        forward_backward()
    finally:
        root.set_requires_gradient_sync(True)


def sharded_peak_parts(
    tracker: ShardedTracker, weights: Mapping[str, int], ema: int
) -> dict[str, int]:
    """The tracker's peak snapshot as this plan's parts: the rank's shards as frozen and
    trained weights, the all-gathered blocks (and their unsharded gradients) apart."""
    snapshots = tracker.get_tracker_snapshot("peak")
    snapshot = next(iter(snapshots.values()), {})
    parts = {**weights, "gradients": 0, "optimizer_state": 0, "ema": ema, "activations": 0}
    parts["gathered_blocks"] = 0
    for category, part in FSDP_CATEGORY_PARTS.items():
        parts[part] += int(snapshot.get(category, 0))
    total = int(snapshot.get(_TOTAL_KEY, 0))
    parts["inputs"] = max(0, total - sum(parts.values()))
    return parts


def fsdp_world(config: SplitstageConfig) -> tuple[int, int] | None:
    """(data-parallel, tensor-parallel) degrees when FSDPMemTracker estimates stage 2:
    `fsdp` (and `fsdp+tp`) on several ranks, one trained model, not offloaded; else None."""
    train = config.train
    if train.parallelism not in ("fsdp", "fsdp+tp") or train.offload != "none":
        return None
    if len(config.trainable.models()) != 1:
        return None
    mode, dp, tp = parallel_mode(config, train.nnodes * train.nproc_per_node)
    return (dp, tp) if mode in ("fsdp", "fsdp+tp") else None


@contextlib.contextmanager
def fake_world(dp: int, tp: int) -> Iterator[DeviceMesh]:
    """A mesh of dp x tp ranks on a fake process group, this process as rank 0 (nothing is
    sent); the group is gone on exit. Refused where a process group is already open."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError("a process group is open: the fake one would replace it")
    world = dp * tp
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield build_mesh(dp, tp, world, device_type="cpu")
    finally:
        dist.destroy_process_group()


def shard_trained(plan: JobPlan, models: Mapping[str, nn.Module], mesh: DeviceMesh) -> nn.Module:
    """The trained model (built on meta) sharded on `mesh` as `build_stage2_models` shards it:
    TP by the family's plan then FSDP2 per block and root; one the family builds loaded, by
    FSDP alone. Returns it (the root FSDPMemTracker tracks)."""
    config, family = plan.config, plan.family
    (name,) = config.trainable.models()
    model = models[name]
    mode, _, tp = parallel_mode(config, config.train.nnodes * config.train.nproc_per_node)
    if family.weights_file(name) is None:
        return parallelize(model, mesh=mesh, mode="fsdp")
    if nf4_sharded(config, name, mode):  # NF4 before sharding, as stage 2 holds it
        nf4_before_sharding(model, mesh.size())
    parallelize(model, mesh=mesh, mode=mode, tp_plan=family.tp_plan(name))
    if mode == "fsdp+tp":
        family.tp_prepare(model, tp)
    return model
