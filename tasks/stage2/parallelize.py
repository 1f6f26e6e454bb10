"""Apply data/tensor parallelism to any model in one call, in a fixed order: TP, then FSDP2 or DDP.

`parallelize` is model-agnostic: the caller gives a tensor-parallel plan as FQN patterns
(`"blocks.*.attn.qkv": "colwise"`), and FSDP2 wraps every repeated block (each child of an
`nn.ModuleList`) and then the root. Patterns are written against the plain model: peft's
`base_model.model.` prefix is ignored, and a pattern that names a LoRA layer shards its base layer
and the matching adapter matrix (colwise: `lora_B`, rowwise: `lora_A`) so adapter gradients stay
exact. Works on meta-device models, so weights are loaded afterwards (see `tasks.weights`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

MODES = ("none", "ddp", "fsdp", "tp", "fsdp+tp")
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Wrapper segments torch inserts into FQNs (torch.compile, activation checkpointing, FSDP1).
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
PEFT_PREFIX = "base_model.model."


def logical_name(fqn: str) -> str:
    """The FQN a plain (un-wrapped, non-peft) model would use: drops wrappers and peft segments."""
    if fqn.startswith(PEFT_PREFIX):
        fqn = fqn[len(PEFT_PREFIX) :]
    parts = [p for p in fqn.split(".") if p and p not in WRAPPER_SEGMENTS and p != "base_layer"]
    return ".".join(parts)


def _mesh_dim(mesh: DeviceMesh | None, name: str) -> DeviceMesh | None:
    """The named sub-mesh, the mesh itself when it is 1-D without names, or None when absent."""
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    if name in names:
        return mesh[name] if mesh.ndim > 1 else mesh
    if not names and mesh.ndim == 1 and name == "dp":
        return mesh
    return None


def _size(mesh: DeviceMesh | None) -> int:
    """Number of ranks along a (sub-)mesh; 1 when absent."""
    return 1 if mesh is None else mesh.size()


def _check_mode(mode: str, mesh: DeviceMesh | None, tp_plan) -> tuple:
    """Validate mode against the mesh and plan; return the (dp, tp) sub-meshes to use."""
    if mode not in MODES:
        raise ValueError(
            f"train.parallelism={mode!r} is unknown; allowed values: {', '.join(MODES)}"
        )
    dp_mesh, tp_mesh = _mesh_dim(mesh, "dp"), _mesh_dim(mesh, "tp")
    if mesh is not None and dp_mesh is None and tp_mesh is None:
        raise ValueError(
            f"mesh dims {mesh.mesh_dim_names} must be named 'dp' and/or 'tp'; build it with "
            "splitstage.tasks.stage2.distributed.build_mesh"
        )
    if mode == "none" and mesh is not None and mesh.size() > 1:
        raise ValueError(
            f"train.parallelism='none' on {mesh.size()} ranks would train {mesh.size()} unsynced "
            "copies; set train.parallelism to 'ddp' or 'fsdp'"
        )
    if mode in ("ddp", "fsdp", "tp", "fsdp+tp") and mesh is None:
        raise ValueError(
            f"train.parallelism={mode!r} needs a device mesh (splitstage.tasks.stage2.distributed)"
        )
    if mode in ("ddp", "fsdp") and _size(tp_mesh) > 1:
        raise ValueError(
            f"train.tp_degree={_size(tp_mesh)} but train.parallelism={mode!r} has no tensor "
            "parallelism; set train.parallelism='fsdp+tp' or train.tp_degree=1"
        )
    if mode == "tp" and _size(dp_mesh) > 1:
        raise ValueError(
            f"{_size(dp_mesh)} data-parallel replicas but train.parallelism='tp' keeps no data "
            "parallelism; set train.parallelism='fsdp+tp' or train.tp_degree = world size"
        )
    if mode in ("tp", "fsdp+tp"):
        if tp_mesh is None:
            raise ValueError(
                f"train.parallelism={mode!r} needs a 'tp' mesh dim; set train.tp_degree >= 2"
            )
        if not tp_plan:
            raise ValueError(
                f"train.parallelism={mode!r} needs a tp_plan (FQN pattern -> 'colwise'/'rowwise')"
            )
    if mode == "fsdp+tp" and dp_mesh is None:
        raise ValueError("train.parallelism='fsdp+tp' needs a ('dp', 'tp') mesh from build_mesh")
    return dp_mesh, tp_mesh


def _style(pattern: str, style) -> ParallelStyle:
    """A ParallelStyle from an instance or a name ('colwise', 'rowwise', 'sequence')."""
    if isinstance(style, ParallelStyle):
        return style
    if isinstance(style, str) and style.lower() in STYLES:
        return STYLES[style.lower()]()
    raise ValueError(
        f"tp_plan[{pattern!r}] = {style!r} is not a ParallelStyle or one of {sorted(STYLES)}"
    )


def _matches(pattern: str, name: str) -> bool:
    """Segment-wise glob match, so '*' never spans a '.' (as parallelize_module does)."""
    pat, parts = pattern.split("."), name.split(".")
    return len(pat) == len(parts) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(pat, parts))


def _is_lora_layer(module: nn.Module) -> bool:
    """True for a peft LoRA layer: a `base_layer` plus `lora_A`/`lora_B` adapter dicts."""
    return all(hasattr(module, a) for a in ("base_layer", "lora_A", "lora_B"))


def resolve_tp_plan(model: nn.Module, tp_plan: Mapping[str, object]) -> dict[str, ParallelStyle]:
    """Expand FQN patterns to the model's real module FQNs, splitting LoRA layers into parts."""
    modules = [(fqn, logical_name(fqn), m) for fqn, m in model.named_modules() if fqn]
    resolved: dict[str, ParallelStyle] = {}
    for pattern, raw_style in tp_plan.items():
        style = _style(pattern, raw_style)
        hits = [(fqn, m) for fqn, name, m in modules if _matches(pattern, name)]
        # A LoRA layer and its base layer share a logical name: keep the outermost one.
        hits = [(f, m) for f, m in hits if not f.endswith(".base_layer")]
        if not hits:
            sample = ", ".join(name for _, name, _ in modules[:8])
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module; module names look like: {sample}"
            )
        for fqn, module in hits:
            if not _is_lora_layer(module):
                resolved[fqn] = style
                continue
            resolved[f"{fqn}.base_layer"] = style
            adapters = {ColwiseParallel: "lora_B", RowwiseParallel: "lora_A"}.get(type(style))
            if adapters is None:
                raise ValueError(
                    f"tp_plan[{pattern!r}]: LoRA layer {fqn} supports only colwise or rowwise"
                )
            for adapter in getattr(module, adapters):
                resolved[f"{fqn}.{adapters}.{adapter}"] = style
    return resolved


def _check_divisible(model: nn.Module, plan: dict[str, ParallelStyle], tp: int) -> None:
    """Colwise/rowwise need the sharded Linear dim divisible by tp (DTensor assumes even shards)."""
    for fqn, style in plan.items():
        module = model.get_submodule(fqn)
        if not isinstance(module, nn.Linear):
            continue
        dim = {ColwiseParallel: "out_features", RowwiseParallel: "in_features"}.get(type(style))
        if dim is not None and getattr(module, dim) % tp:
            raise ValueError(
                f"tp_plan: {logical_name(fqn)} ({type(style).__name__}) has {dim}="
                f"{getattr(module, dim)}, not divisible by train.tp_degree={tp}; choose a "
                "train.tp_degree that divides it or leave this module out of the plan"
            )


def _mp_policy(mixed_precision) -> MixedPrecisionPolicy | None:
    """A MixedPrecisionPolicy from an instance, a dtype or a name ('bf16', 'fp16', 'fp32')."""
    if mixed_precision is None or isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    dtype = mixed_precision
    if isinstance(dtype, str):
        if dtype.lower() not in PRECISIONS:
            raise ValueError(
                f"train.mixed_precision={dtype!r} is unknown; allowed: {sorted(PRECISIONS)}"
            )
        dtype = PRECISIONS[dtype.lower()]
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"train.mixed_precision={mixed_precision!r} is not a dtype")
    if dtype == torch.float32:
        return None
    # Compute in low precision, reduce gradients in fp32 (as torchtitan does).
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: children of the outermost `nn.ModuleList`/`ModuleDict`s, in order."""
    blocks: list[nn.Module] = []
    seen: set[int] = set()
    for _, module in model.named_modules():
        if id(module) in seen:
            continue
        if isinstance(module, nn.ModuleList | nn.ModuleDict):
            for child in module.children():
                blocks.append(child)
            for inner in module.modules():
                seen.add(id(inner))
    return blocks


def _apply_fsdp(model, dp_mesh, mp_policy, reshard_after_forward, offload: bool) -> None:
    """fully_shard each block, then the root (which takes the remaining parameters); with
    `offload`, FSDP2's CPUOffloadPolicy: the shards live in host memory and each block's weights
    come to the device only while the block runs (forward, and again in backward)."""
    kwargs = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda")
    for block in find_blocks(model):
        if any(True for _ in block.parameters()):
            fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Composable DDP: builds its reducer lazily at the first forward, so meta init still works.

    Modules with only frozen parameters (a LoRA's base: every rank loads it from the same file)
    are left out, so DDP neither broadcasts the whole base from rank 0 at its first forward nor
    meets a quantized weight it cannot copy."""
    from torch.distributed._composable.replicate import replicate

    device_type = dp_mesh.device_type
    kwargs = {}
    if device_type != "cpu":
        index = torch.get_device_module(device_type).current_device()
        kwargs["device_id"] = torch.device(device_type, index)
    frozen = [
        module
        for module in model.modules()
        if module is not model
        and any(True for _ in module.parameters())
        and not any(p.requires_grad for p in module.parameters())
    ]
    replicate(model, device_mesh=dp_mesh, ignored_modules=frozen or None, **kwargs)


def parallelize(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None,
    mode: str,
    tp_plan: Mapping[str, object] | None = None,
    mixed_precision: MixedPrecisionPolicy | torch.dtype | str | None = None,
    reshard_after_forward: bool = True,
    offload: bool = False,
) -> nn.Module:
    """Apply `mode` in place, in order 1. TP (tp_plan) 2. FSDP2 per block then root, or DDP.

    mode: "none" (one rank), "ddp", "fsdp", "tp" or "fsdp+tp" (config field `train.parallelism`).
    mesh: from `tasks.distributed.build_mesh`; dims "dp" and/or "tp".
    tp_plan: {FQN pattern: ParallelStyle | "colwise" | "rowwise" | "sequence"}; ignored
        without TP, so a model builder can always supply its plan.
    mixed_precision: FSDP param dtype (gradients reduce in fp32); FSDP modes only.
    reshard_after_forward: FSDP frees gathered weights after forward (less memory, more comms).
    offload: FSDP modes only: weights, gradients and the optimizer step in host memory.
    """
    dp_mesh, tp_mesh = _check_mode(mode, mesh, tp_plan)
    mp_policy = _mp_policy(mixed_precision)
    if mp_policy is not None and mode not in ("fsdp", "fsdp+tp"):
        raise ValueError(
            f"train.mixed_precision applies to FSDP only, but train.parallelism={mode!r}; "
            "use autocast in the training step or set train.parallelism='fsdp'"
        )
    if mode in ("tp", "fsdp+tp"):
        plan = resolve_tp_plan(model, tp_plan)
        _check_divisible(model, plan, tp_mesh.size())
        parallelize_module(model, tp_mesh, plan)
    if offload and mode not in ("fsdp", "fsdp+tp"):
        raise ValueError(f"offload runs through FSDP2, but train.parallelism={mode!r}")
    if mode in ("fsdp", "fsdp+tp"):
        _apply_fsdp(model, dp_mesh, mp_policy, reshard_after_forward, offload)
    elif mode == "ddp":
        _apply_ddp(model, dp_mesh)
    return model


def set_gradient_sync(models: Iterable[nn.Module], sync: bool) -> None:
    """Whether the next backward reduces the gradients across data-parallel replicas (FSDP2's
    reduce-scatter, composable DDP's all-reduce); set it before the forward (DDP reads it
    there). Off for all but the last micro-batch of an update, the gradients add up locally and
    are reduced once, with the last (FSDP2 holds them unsharded meanwhile). Neither wrapper has
    the `no_sync` accelerate's `accumulate` looks for. Models without data parallelism (one
    rank, TP only, pipeline stages) have nothing to skip."""
    for model in models:
        toggle = getattr(model, "set_requires_gradient_sync", None)
        if toggle is not None:
            toggle(sync)
