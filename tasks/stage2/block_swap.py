"""`train.offload = N`: the frozen weights of the trained model's last N blocks live in host
memory; each layer that uses one copies it to the device for its own forward only.

What musubi-tuner's `--blocks_to_swap N` does for a LoRA on a 24 GB GPU, in a form that is right
under training by construction. A layer of a swapped block (peft's `base_layer`, a norm, a torchao
quantized Linear or convolution) gets a forward pre-hook that puts a device copy of its frozen
parameters in place of the host ones and a forward hook that puts the host ones back. The copy is
an ordinary tensor: autograd keeps it exactly as long as backward needs it and frees it after,
whatever the order of the graph. With gradient checkpointing (required: `check_memory_levers`)
a block's forward keeps nothing, and its recompute in backward runs the layers again, so their
hooks copy the weights again just before autograd uses them. Hooks sit on the layers, not the
blocks, because a family may checkpoint finer than a block (the SD UNet checkpoints each resnet
and attention inside its down and up blocks): a layer's forward is always inside the region
that is recomputed. LoRA parameters, their gradients and the optimizer stay on the device.

Why not diffusers' group offloading (`apply_group_offloading`, block_level): it is built for
inference. It moves whole modules, so LoRA parameters (and their gradients) would go to the host
after each forward, and it swaps the `.data` of the parameters after the forward, so the weights
autograd saved for backward (or recomputes) are host tensors when backward runs.

Which blocks: the last N of `find_blocks`, as musubi-tuner starts with the last N in host memory
(the first blocks run first, so forward starts without waiting on a copy).
Copies are made on the compute stream (non_blocking from pinned memory: the host runs ahead, the
copy waits for nothing but its stream); no prefetch, so the device holds one swapped layer's
weights beyond what autograd keeps for the block in backward: one block's frozen weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from splitstage.tasks.stage2.parallelize import find_blocks, logical_name

HOST = torch.device("cpu")


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (`find_blocks`), less the per-adapter dicts peft adds (a LoRA
    layer's `lora_A` / `lora_B` are ModuleDicts too, but no blocks)."""
    adapters = {
        id(module)
        for name, module in model.named_modules()
        if any(part.startswith("lora_") for part in name.split("."))
    }
    return [block for block in find_blocks(model) if id(block) not in adapters]


def swapped_blocks(model: nn.Module, count: int) -> list[nn.Module]:
    """The last `count` repeated blocks: those whose frozen weights live in host memory."""
    blocks = repeated_blocks(model)
    if count > len(blocks):
        raise ValueError(
            f"train.offload = {count} blocks, but the model has {len(blocks)} repeated blocks"
        )
    return blocks[len(blocks) - count :]


def frozen_owners(blocks: list[nn.Module]) -> dict[nn.Module, list[str]]:
    """Each module inside `blocks` that directly holds frozen parameters and holds no trained
    ones below it -> those names. A module with a trained parameter below it (a block's own
    modulation table beside its LoRA layers) is one DDP keeps whole on the device, so its
    frozen parameters (small) stay there; the others are those DDP ignores (`_apply_ddp`)."""
    owners: dict[nn.Module, list[str]] = {}
    for block in blocks:
        for module in block.modules():
            if any(param.requires_grad for param in module.parameters()):
                continue
            names = [
                name
                for name, param in module._parameters.items()
                if param is not None and not param.requires_grad
            ]
            if names:
                owners[module] = names
    return owners


def swapped_frozen(blocks: list[nn.Module]) -> list[torch.Tensor]:
    """The frozen parameters `blocks` hold (what offload = N keeps in host memory)."""
    return [m._parameters[n] for m, names in frozen_owners(blocks).items() for n in names]


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in page-locked host memory (what makes a host-to-GPU copy asynchronous); a
    tensor type that cannot be pinned stays pageable (its copies then wait for the host)."""
    try:
        return tensor.pin_memory()
    except (RuntimeError, NotImplementedError):
        return tensor


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    """A frozen parameter holding `tensor` (a torchao tensor stays one)."""
    return nn.Parameter(tensor, requires_grad=False)


@dataclass
class BlockSwap:
    """The hooks of one model's swapped blocks; `copies` counts the weights copied to the device
    (what the tests read: on a CPU the device is the host, so a move cannot be seen otherwise)."""

    device: torch.device
    blocks: list[nn.Module]
    handles: list[RemovableHandle] = field(default_factory=list)
    copies: int = 0
    _held: dict[int, list[dict[str, nn.Parameter]]] = field(default_factory=dict)

    def onload(self, module: nn.Module, names: list[str]) -> None:
        """Put a device copy of `module`'s frozen `names` in place of the host parameters."""
        host = {name: module._parameters[name] for name in names}
        self._held.setdefault(id(module), []).append(host)
        for name, param in host.items():
            module._parameters[name] = param.to(self.device, non_blocking=True, copy=True)
            self.copies += 1

    def offload(self, module: nn.Module) -> None:
        """Put the host parameters back (the device copies live on only where autograd saved
        them)."""
        stack = self._held.get(id(module))
        if stack:
            module._parameters.update(stack.pop())

    def remove(self) -> None:
        """Take the hooks off (the host parameters stay where they are)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def place_for_swap(model: nn.Module, blocks: list[nn.Module], device: torch.device) -> None:
    """Every tensor of `model` on `device` except the frozen parameters of `blocks`, which go to
    host memory (pinned when the device is a GPU)."""
    owners = frozen_owners(blocks)
    pin = device.type == "cuda"
    for module in model.modules():
        swapped = set(owners.get(module, ()))
        for name, param in module._parameters.items():
            if param is None:
                continue
            if name in swapped:
                host = param.detach().to(HOST)
                module._parameters[name] = _frozen(_pinned(host) if pin else host)
            elif param.device != device:
                if param.requires_grad:  # the optimizer and DDP hold this object
                    param.data = param.data.to(device)
                else:
                    module._parameters[name] = _frozen(param.detach().to(device))
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def install_block_swap(model: nn.Module, count: int, device: torch.device) -> BlockSwap:
    """Keep the frozen weights of `model`'s last `count` blocks in host memory and copy each to
    `device` only while its layer runs (module docstring); everything else goes to `device`.
    The hooks' record is `model.block_swap`."""
    blocks = swapped_blocks(model, count)
    place_for_swap(model, blocks, device)
    swap = BlockSwap(device, blocks)
    model.block_swap = swap
    for module, names in frozen_owners(blocks).items():
        swap.handles.append(
            module.register_forward_pre_hook(lambda m, args, names=names: swap.onload(m, names))
        )
        swap.handles.append(
            module.register_forward_hook(lambda m, args, out: swap.offload(m), always_call=True)
        )
    return swap


def to_host_after(
    loaders: Mapping[str, Callable[[torch.Tensor], None]], model: nn.Module, count: int
) -> dict[str, Callable[[torch.Tensor], None]]:
    """`loaders` (a quantized base's installers, by logical weight key) where those of the last
    `count` blocks' weights then move what they installed to host memory at once, so the
    device never holds the swapped blocks' weights while the base loads."""
    wrapped = dict(loaders)
    owners = frozen_owners(swapped_blocks(model, count))
    for fqn, module in model.named_modules():
        for name in owners.get(module, ()):
            key = logical_name(f"{fqn}.{name}")
            if key in wrapped:
                wrapped[key] = _then_to_host(wrapped[key], module, name)
    return wrapped


def _then_to_host(
    install: Callable[[torch.Tensor], None], module: nn.Module, name: str
) -> Callable[[torch.Tensor], None]:
    """`install`, then `module.<name>` moved to host memory."""

    def installed_then_moved(source: torch.Tensor) -> None:
        install(source)
        module._parameters[name] = _frozen(module._parameters[name].detach().to(HOST))

    return installed_then_moved
