"""The update rule of a run: the optimizer, the learning-rate schedule, gradient clipping and the
EMA of the trained parameters, each from the library made for it (torch, bitsandbytes,
prodigyopt, transformers; diffusers' `get_scheduler` and `EMAModel`), never written here.

`check_update_rule` is the launcher's check (a missing package, an argument the optimizer does
not take, EMA where it cannot run): one line before any process starts.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from splitstage.config.job import ConfigError, TrainConfig
from splitstage.config.update_rule import SCHEDULE_ARGUMENTS
from splitstage.tasks.stage2.checkpoint import CheckpointError
from splitstage.tasks.stage2.resume import average_start

# name -> (package to import, pip name, "module:Class")
OPTIMIZERS = {
    "adamw": ("torch", "torch", "torch.optim:AdamW"),
    "adamw8bit": ("bitsandbytes", "bitsandbytes", "bitsandbytes.optim:AdamW8bit"),
    "prodigy": ("prodigyopt", "prodigyopt", "prodigyopt:Prodigy"),
    "adafactor": ("transformers", "transformers", "transformers.optimization:Adafactor"),
}
# Arguments splitstage sets itself from [train] (the config has a field for each).
OWN_ARGUMENTS = ("params", "lr", "weight_decay")
EMA_PARALLELISM = ("ddp", "pp")  # plain tensors on every rank; FSDP/TP shards are not averaged
# Optimizers whose state works on plain tensors only (bitsandbytes' kernels take no DTensor).
PLAIN_TENSOR_OPTIMIZERS = {"adamw8bit": ("ddp", "pp")}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class `train.optimizer` names (imported now)."""
    module, _, attribute = OPTIMIZERS[name][2].partition(":")
    return getattr(importlib.import_module(module), attribute)


def optimizer_arguments(train: TrainConfig) -> dict[str, Any]:
    """Keyword arguments of the optimizer: the [train] fields, then `train.optimizer_args`."""
    arguments: dict[str, Any] = {"lr": train.learning_rate, "weight_decay": train.weight_decay}
    if train.optimizer == "adafactor":  # transformers' Adafactor: a given lr, no own schedule
        arguments.update(scale_parameter=False, relative_step=False, warmup_init=False)
    extra = {k: tuple(v) if isinstance(v, list) else v for k, v in train.optimizer_args.items()}
    return {**arguments, **extra}


def check_update_rule(train: TrainConfig, *, optimizer_package: bool = True) -> None:
    """Everything about the optimizer, schedule and EMA that is knowable before launch (the
    values of their arguments: when the config loads, `config.update_rule`).
    `optimizer_package=False` (preprocess, which may run where training does not): neither
    require nor import the optimizer's package (bitsandbytes talks when imported)."""
    package, pip_name, _ = OPTIMIZERS[train.optimizer]
    if optimizer_package and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"train.optimizer={train.optimizer!r} needs the {pip_name} package, which is not "
            f"installed; `pip install {pip_name}` or choose another train.optimizer"
        )
    own = sorted(set(train.optimizer_args) & set(OWN_ARGUMENTS))
    if own:
        raise ConfigError(
            f"train.optimizer_args: {', '.join(own)} come from [train] (learning_rate, "
            "weight_decay); set them there"
        )
    if optimizer_package:
        accepted = inspect.signature(optimizer_class(train.optimizer).__init__).parameters
        unknown = sorted(set(train.optimizer_args) - set(accepted))
        if unknown:
            known = ", ".join(p for p in accepted if p not in ("self", *OWN_ARGUMENTS))
            raise ConfigError(
                f"train.optimizer_args: {', '.join(unknown)} is not an argument of the "
                f"{train.optimizer} optimizer; it takes {known}"
            )
    plain_only = PLAIN_TENSOR_OPTIMIZERS.get(train.optimizer)
    if plain_only and train.parallelism not in plain_only:
        raise ConfigError(
            f"train.optimizer={train.optimizer!r} with train.parallelism="
            f"{train.parallelism!r}: its 8-bit states need whole (unsharded) parameters; use "
            f"{' or '.join(plain_only)}, or train.optimizer='adamw'"
        )
    if train.ema is not None and train.parallelism not in EMA_PARALLELISM:
        raise ConfigError(
            f"[train.ema] with train.parallelism={train.parallelism!r}: the average is kept for "
            f"{' and '.join(EMA_PARALLELISM)} runs so far; remove [train.ema] or use ddp"
        )


def build_optimizer(params: Sequence[torch.nn.Parameter], train: TrainConfig):
    """The optimizer over the trained parameters."""
    try:
        optimizer = optimizer_class(train.optimizer)(list(params), **optimizer_arguments(train))
    except (TypeError, ValueError) as error:  # a value the optimizer refuses (checked late)
        raise ConfigError(f"train.optimizer_args: {train.optimizer}: {error}") from None
    quant_key = getattr(optimizer, "_FSDP_WRAPPED_QUANT_STATE_KEY", None)
    if quant_key:
        optimizer.state_dict = _unwrapped_state_dict(optimizer, quant_key)
    return optimizer


def _unwrapped_state_dict(optimizer: torch.optim.Optimizer, quant_key: str) -> Callable:
    """bitsandbytes nests its 8-bit states under `quant_key` (for FSDP1); torch's DCP state dict
    restores a parameter's state by the live state's names (state1, qmap1, ...), so the save
    must use those names too: the state dict with the nesting undone (its load accepts both)."""
    wrapped = type(optimizer).state_dict

    def state_dict() -> dict[str, Any]:
        saved = wrapped(optimizer)
        for state in saved["state"].values():
            if isinstance(state, dict) and quant_key in state:
                state.update(state.pop(quant_key))
        return saved

    return state_dict


def build_scheduler(
    optimizer: torch.optim.Optimizer, train: TrainConfig, total_updates: int, done: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """diffusers' schedule `train.lr_scheduler` after `train.warmup_steps` of linear warmup,
    positioned after `done` updates (a resume: the optimizer's groups carry `initial_lr`)."""
    from diffusers.optimization import get_scheduler

    name = train.lr_scheduler
    if name == "constant" and train.warmup_steps:
        name = "constant_with_warmup"  # diffusers' "constant" ignores warmup
    if done:
        for group in optimizer.param_groups:
            group["initial_lr"] = train.learning_rate  # the config's, also on a resume
    arguments = {k: v for k, v in train.lr_scheduler_args.items() if k in SCHEDULE_ARGUMENTS}
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=train.warmup_steps,
        num_training_steps=max(total_updates, 1),
        last_epoch=done - 1,
        **arguments,
    )


def apply_config_to_groups(optimizer: torch.optim.Optimizer, train: TrainConfig) -> None:
    """After a resume, the config's weight decay and `train.optimizer_args` (betas, eps, ...)
    hold from here on (the checkpoint's would otherwise stay silently; preflight says what
    changed); the learning rate comes back through `build_scheduler`."""
    arguments = {k: v for k, v in optimizer_arguments(train).items() if k != "lr"}
    for group in optimizer.param_groups:
        for name, value in arguments.items():
            if name in group:  # a setting the group holds, not the optimizer's running state
                group[name] = value


def total_norm(
    params: Sequence[torch.nn.Parameter], across: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The global L2 norm of the parameters' gradients: DTensor shards (FSDP2, TP) reduced per
    mesh by torch, plain (replicated) gradients as they are, and over `across` (the stages of a
    pipeline, each holding other parameters)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            grad = param.grad
            key = (id(grad.device_mesh), grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(grad)
    squared = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = squared + norm.detach().to("cpu", torch.float64) ** 2
    if across is not None:
        device = _grad_device(params) if dist.get_backend(across) == "nccl" else "cpu"
        squared = squared.to(device)
        dist.all_reduce(squared, group=across)
    return squared.sqrt().cpu()


def clip_gradients(
    params: Sequence[torch.nn.Parameter],
    max_norm: float | None,
    across: dist.ProcessGroup | None = None,
) -> float:
    """Clip the gradients to `max_norm` (None: measure only); returns the pre-clip norm."""
    norm = float(total_norm(params, across))
    if max_norm is not None and math.isfinite(norm):
        scale = min(1.0, max_norm / (norm + 1e-6))  # torch's clip_grad_norm_ coefficient
        if scale < 1.0:
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(scale)
    return norm


def _grad_device(params: Sequence[torch.nn.Parameter]) -> torch.device:
    """The device the gradients are on (CPU when there are none)."""
    for param in params:
        if param.grad is not None:
            return param.grad.device
    return torch.device("cpu")


class TrainedAverage:
    """The EMA of the trained parameters (diffusers' `EMAModel`: decay min(decay, (1+n)/(10+n))
    after `start_update` updates), with `swapped_in()` to use it for sampling or export."""

    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float, start_update: int):
        from diffusers.training_utils import EMAModel

        self.params = list(params)
        self.decay, self.start_update = decay, start_update  # the config's
        self.ema = EMAModel(self.params, decay=decay, update_after_step=start_update)
        self.loaded = False  # whether a checkpoint's average was restored

    def resume_at(self, update: int) -> None:
        """After a resume from checkpoint `update`: the config's decay holds from here on (the
        checkpoint's would otherwise win); an average the checkpoint did not hold starts from
        the resumed weights at `update` (`resume.average_start`), counting updates as the run
        does."""
        saved_start = self.ema.update_after_step if self.loaded else None
        if not self.loaded:
            self.ema.shadow_params = [p.detach().clone() for p in self.params]
            self.ema.optimization_step = update
        self.ema.decay = self.decay
        self.ema.update_after_step = average_start(saved_start, self.start_update, update)

    def step(self) -> None:
        """After an update: fold the new parameters into the average."""
        self.ema.step(self.params)

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and numbers (the checkpoint's extra state holds them, no pickle)."""
        return self.ema.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's average onto the parameters' devices; refuse one of another
        parameter list (EMAModel would pair the lists by position and silently truncate)."""
        shadow = state["shadow_params"]
        if not isinstance(shadow, list):
            raise CheckpointError(
                "the checkpoint's EMA is keyed by parameter name (a train.parallelism='pp' "
                "checkpoint); resume it with the parallelism it was saved with"
            )
        shapes = [tuple(t.shape) for t in shadow]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise CheckpointError(
                f"the checkpoint's EMA holds {len(shadow)} tensors that do not match the "
                f"{len(self.params)} trained parameters; resume with the config it was saved "
                "with, or delete the checkpoints to start over"
            )
        moved = [t.to(p.device) for t, p in zip(shadow, self.params, strict=True)]
        self.ema.load_state_dict({**state, "shadow_params": moved})
        self.loaded = True

    def state_by_name(self, names: Sequence[str]) -> dict[str, Any]:
        """The state with the averaged tensors keyed by parameter name, on CPU: ranks holding
        other parameters (pipeline stages) merge theirs into one state any layout can load."""
        state = self.ema.state_dict()
        shadow = [t.detach().cpu().contiguous() for t in state["shadow_params"]]
        return {**state, "shadow_params": dict(zip(names, shadow, strict=True))}

    def load_state_by_name(self, state: dict[str, Any], names: Sequence[str]) -> None:
        """Restore this rank's parameters' averages from a state `state_by_name` merged."""
        shadow = state["shadow_params"]
        missing = [name for name in names if name not in shadow]
        if missing:
            raise CheckpointError(
                f"the checkpoint's EMA lacks {len(missing)} trained parameters (first: "
                f"{missing[0]}); resume with the config it was saved with, or delete the "
                "checkpoints to start over"
            )
        self.load_state_dict({**state, "shadow_params": [shadow[name] for name in names]})

    def swapped_in(self, use: Callable[[], Any]) -> Any:
        """Run `use()` with the averaged values in the parameters, then put the trained back."""
        self.ema.store(self.params)
        self.ema.copy_to(self.params)
        try:
            return use()
        finally:
            self.ema.restore(self.params)
