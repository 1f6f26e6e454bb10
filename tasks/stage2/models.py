"""Stage 2 models: only those of the offload plan, built on meta, adapted, parallelized, loaded."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from splitstage.config.job import ConfigError, SplitstageConfig
from splitstage.pipelines.family import Family
from splitstage.tasks.device import pick_dtype
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.stage2.block_swap import install_block_swap, to_host_after
from splitstage.tasks.stage2.distributed import DistInfo, build_mesh
from splitstage.tasks.stage2.parallelize import parallelize
from splitstage.tasks.stage2.pretrained_weights import materialize_and_load
from splitstage.tasks.stage2.quantization import (
    QuantizingLoad,
    frozen_nbytes,
    is_quantized,
    nf4_before_sharding,
    quantized_kind,
    quantizing_load,
    sharded_nf4_load,
)

LORA_ADAPTER = "default"
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in WEIGHT_DTYPES.items()}


@dataclass
class Stage2Models:
    """The loaded models by name, which of them train, and the mesh they are sharded on."""

    models: dict[str, nn.Module]
    trained: list[str]
    lora: bool
    mode: str
    dp_rank: int = 0  # which data-parallel replica this rank belongs to (TP ranks share data)
    dp_size: int = 1

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter that receives gradients."""
        models = [self.models[name] for name in self.trained]
        return [p for model in models for p in model.parameters() if p.requires_grad]


def parallel_mode(config: SplitstageConfig, world_size: int) -> tuple[str, int, int]:
    """(mode, dp, tp) for this world size; errors name `train.parallelism` / `train.tp_degree`."""
    mode = config.train.parallelism
    tp = config.train.tp_degree if mode in ("tp", "fsdp+tp") else 1
    if mode == "pp":
        raise ConfigError(
            "train.parallelism: 'pp' runs through the pipeline-parallel schedule, not this path"
        )
    if world_size % tp:
        raise ConfigError(
            f"train.tp_degree={tp} does not divide the world size {world_size} "
            "(train.nnodes * train.nproc_per_node); pick a divisor"
        )
    if mode == "tp" and tp != world_size:
        raise ConfigError(
            f"train.parallelism='tp' needs train.tp_degree == world size ({world_size}), got {tp}; "
            "use 'fsdp+tp' to combine"
        )
    if world_size == 1:
        return "none", 1, 1
    return mode, world_size // tp, tp


def _target_matches(target: str, module_name: str) -> bool:
    """peft's rule: a target names a module by its full name or a dotted suffix of it."""
    return module_name == target or module_name.endswith(f".{target}")


def check_lora_targets(
    model: nn.Module, base: str, targets: list[str], rank: int, *, named: bool = True
) -> list[str]:
    """The targets to adapt: refuse targets the user `named` that match no module, and a rank
    above a targeted layer's width. The family's defaults (named=False) adapt to the model:
    those it lacks (an SD3 whose only joint block is context_pre_only has no to_add_out) are
    dropped; none matching at all is refused, naming the field that sets them."""
    modules = list(model.named_modules())
    matched = {t: [m for name, m in modules if _target_matches(t, name)] for t in targets}
    unknown = [t for t, found in matched.items() if not found]
    if unknown and not named and len(unknown) < len(targets):
        targets = [t for t in targets if t not in unknown]
        matched = {t: matched[t] for t in targets}
        unknown = []
    if unknown:
        leaves = Counter(name.rsplit(".", 1)[-1] for name, m in modules if _width(m))
        known = [leaf for leaf, _ in leaves.most_common(12)]  # the most repeated: to_q, ...
        what = "" if named else "the family's default LoRA targets "
        fix = "" if named else "; set trainable.lora_target_modules to modules it has"
        raise ConfigError(
            f"trainable.lora_target_modules: {what}{', '.join(unknown)} name no module of "
            f"'{base}'; its adaptable modules include {', '.join(known)} (a target is a module "
            f"name or a dotted suffix of one, e.g. attn.to_q){fix}"
        )
    narrow = [(t, width) for t, found in matched.items() for m in found if (width := _width(m))]
    narrow = [(t, width) for t, width in narrow if width < rank]
    if narrow:
        target, width = min(narrow, key=lambda item: item[1])
        raise ConfigError(
            f"trainable.lora_rank={rank} exceeds the width of '{target}' in '{base}' ({width}): "
            f"a LoRA of that rank cannot be more than full rank; set lora_rank <= {width}"
        )
    return targets


def _width(module: nn.Module) -> int:
    """min(in, out) features of a layer LoRA can adapt (0 for others)."""
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Embedding) and weight is not None:
        return min(weight.shape[0], weight.shape[1])
    return 0


def add_lora(model: nn.Module, family: Family) -> nn.Module:
    """Inject LoRA adapters (peft) into the target modules; only the adapters train."""
    from peft import LoraConfig, inject_adapter_in_model  # 2-4 s of imports (transformers)

    trainable = family.config.trainable
    targets = check_lora_targets(
        model,
        trainable.lora_base_model,
        family.lora_targets(trainable.lora_base_model),
        trainable.lora_rank,
        named=bool(trainable.lora_target_modules),
    )
    lora = LoraConfig(
        r=trainable.lora_rank,
        lora_alpha=trainable.lora_alpha or trainable.lora_rank,
        target_modules=list(targets),
        init_lora_weights=True,
    )
    model = inject_adapter_in_model(lora, model, adapter_name=LORA_ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return model


def frozen_base_dtype(
    config: SplitstageConfig, family: Family, name: str, device: torch.device
) -> torch.dtype:
    """The dtype a LoRA-trained model's frozen base is held in: `train.weight_dtype`; 'auto' is
    the family's own (diffsynth: pipeline.torch_dtype), else the compute dtype of
    `train.mixed_precision` on this device (fp32 on a CPU unless bf16 is asked for)."""
    choice = config.train.weight_dtype
    if choice != "auto":
        return WEIGHT_DTYPES[choice]
    native = family.native_weight_dtype(name)
    return native if native is not None else pick_dtype(config.train.mixed_precision, device)


def planned_precision(family: Family, device: torch.device) -> list[str]:
    """What each trained model will be held in on `device`, for the plan (the rank logs what it
    actually holds): 'dit: frozen base bf16 (train.weight_dtype = auto), LoRA params fp32'."""
    config = family.config
    lines = []
    for name in config.trainable.models():
        if name == config.trainable.lora_base_model:
            dtype = DTYPE_NAMES.get(frozen_base_dtype(config, family, name, device), "?")
            choice = config.train.weight_dtype
            lines.append(
                f"{name}: frozen base {dtype} (train.weight_dtype = {choice}), LoRA params fp32"
            )
        else:
            lines.append(f"{name}: trained params fp32 (full fine-tuning: fp32 master weights)")
    compute = DTYPE_NAMES.get(pick_dtype(config.train.mixed_precision, device), "fp32")
    return [*lines, f"compute: {compute} (train.mixed_precision = {config.train.mixed_precision})"]


def hold_base_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Frozen floating parameters and buffers to `dtype`; trainable parameters stay fp32
    (diffusers' `cast_training_params`) and so do the modules a diffusers / transformers class
    keeps in fp32 (`_keep_in_fp32_modules`). On a meta model this only changes what `to_empty`
    allocates, so the base is loaded straight into `dtype` and no fp32 copy of it is made."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for prefix, module in model.named_modules():
        if keep & set(prefix.split(".")):
            continue
        for param in module._parameters.values():
            if param is None or not param.is_floating_point():
                continue
            target = torch.float32 if param.requires_grad else dtype
            if param.dtype != target:
                param.data = param.data.to(target)
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                module._buffers[key] = buffer.to(dtype)
    return model


def adapt_trained(model: nn.Module, name: str, family: Family, device: torch.device) -> nn.Module:
    """The trained model before sharding: LoRA (frozen base in its dtype, adapters fp32) or all
    parameters trained (fp32 master weights, as built), then gradient checkpointing."""
    config = family.config
    if name == config.trainable.lora_base_model:
        model = add_lora(model, family)
        hold_base_in(model, frozen_base_dtype(config, family, name, device))
    else:
        model.requires_grad_(True)
    if config.train.gradient_checkpointing:
        family.enable_gradient_checkpointing(name, model)
    return model


def quantizing_base(
    model: nn.Module, name: str, family: Family, device: torch.device, sharded: bool = False
) -> QuantizingLoad | None:
    """How the LoRA base's weights are quantized while they load (`train.base_quantization`),
    or None when it is held plain; `sharded`: FSDP2's NF4 shards, made on the meta device before
    `fully_shard` (`nf4_before_sharding`), filled from the whole weight each (torchtune's order)."""
    config = family.config
    kind = config.train.base_quantization
    if kind == "none" or name != config.trainable.lora_base_model:
        return None
    dtype = frozen_base_dtype(config, family, name, device)
    if sharded:
        return sharded_nf4_load(model, dtype, device)
    return quantizing_load(model, kind, dtype, device)


def nf4_sharded(config: SplitstageConfig, name: str, mode: str) -> bool:
    """Whether model `name` is the LoRA base held as NF4 shards under FSDP2."""
    return (
        mode == "fsdp"
        and config.train.base_quantization == "nf4"
        and name == config.trainable.lora_base_model
    )


def held_dtypes(name: str, model: nn.Module) -> str:
    """What a model is held in, for the log: 'dit: frozen base bf16, trained params fp32'."""

    def names(tensors) -> str:
        found = {DTYPE_NAMES.get(t.dtype, str(t.dtype)) for t in tensors if t.is_floating_point()}
        return "/".join(sorted(found)) or "none"

    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad] + list(model.buffers())
    quantized = [p for p in frozen if is_quantized(p)]
    if quantized:
        kinds = "/".join(sorted({quantized_kind(p) for p in quantized}))
        plain = [t for t in frozen if not is_quantized(t)]
        base = f"{kinds} ({len(quantized)} weights, torchao) + {names(plain)}"
        if any(isinstance(p, DTensor) for p in quantized):  # FSDP2's NF4 shards
            base += f" ({frozen_nbytes(model)} frozen bytes on this rank)"
    else:
        base = names(frozen)
    if not trained:
        return f"{name}: frozen {base}"
    if not any(not p.requires_grad for p in params):
        return f"{name}: trained params {names(trained)} (full fine-tuning)"
    return f"{name}: frozen base {base}, trained params {names(trained)}"


def where_held(config: SplitstageConfig, name: str, trained_names: list[str]) -> str:
    """What `train.offload` keeps of model `name` in host memory, for its log line ('' if
    nothing)."""
    offload = config.train.offload
    if offload == "cpu" and name in trained_names:
        return " (in host memory: train.offload = 'cpu')"
    if isinstance(offload, int) and name == config.trainable.lora_base_model:
        return (
            f" (the frozen weights of its last {offload} blocks in host memory: "
            f"train.offload = {offload})"
        )
    return ""


def print_line(line: str) -> None:
    """A line the launcher streams (rank 0's stdout)."""
    print(line, flush=True)


def build_stage2_models(
    plan: JobPlan,
    dist_info: DistInfo,
    *,
    names: list[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> Stage2Models:
    """Build the stage-2 models (or `names`): frozen ones loaded plainly, trained ones sharded.

    Logs (`log`, default: print on rank 0) the dtype each model is held in."""
    config = plan.config
    names = list(names or plan.split.models["stage2"])
    trained_names = [n for n in config.trainable.models() if n in names]
    mode, dp, tp = parallel_mode(config, dist_info.world_size)
    offload = config.train.offload == "cpu"
    swap = config.train.offload if isinstance(config.train.offload, int) else 0
    if offload and mode == "none":  # one process: FSDP2 on a one-rank mesh keeps it on the host
        mode = "fsdp"
    mesh = build_mesh(dp, tp, dist_info.world_size) if mode != "none" else None
    load_device = torch.device("cpu") if offload else dist_info.device
    family = plan.family
    models: dict[str, nn.Module] = {}
    for name in names:
        weights = family.weights_file(name) if name in trained_names else None
        if weights is None:  # frozen, or a trained model its family builds loaded
            if swap and name == config.trainable.lora_base_model:
                raise ConfigError(
                    f"train.offload = {swap}: '{name}' is built loaded, not read from a weights "
                    "file, so its blocks cannot be placed as they load; set train.offload = 'none'"
                )
            model = family.build_model(name, dist_info.device)
            if name in trained_names:
                model.requires_grad_(True)
                if config.train.gradient_checkpointing:
                    family.enable_gradient_checkpointing(name, model)
                if mode != "none":
                    mode_here = "ddp" if mode == "ddp" else "fsdp"
                    parallelize(model, mesh=mesh, mode=mode_here, offload=offload)
            models[name] = model
            continue
        model = family.build_model(name, dist_info.device, meta=True)
        model = adapt_trained(model, name, family, dist_info.device)
        sharded_nf4 = nf4_sharded(config, name, mode)
        if sharded_nf4:  # NF4 on meta first, so FSDP2 shards it with torchao's all-gather
            nf4_before_sharding(model, dp)
        parallelize(model, mesh=mesh, mode=mode, tp_plan=family.tp_plan(name), offload=offload)
        if mode in ("tp", "fsdp+tp"):
            family.tp_prepare(model, tp)
        path, key_prefix = weights
        if sharded_nf4:  # this rank's NF4 shards allocated, then filled by their installers
            model.to_empty(device=load_device)
        quantized = quantizing_base(model, name, family, dist_info.device, sharded_nf4)
        installers = quantized.loaders if quantized else None
        swapped = swap if name == config.trainable.lora_base_model else 0
        if swapped and installers:  # the swapped blocks' weights go to the host as they load
            installers = to_host_after(installers, model, swapped)
        materialize_and_load(
            model,
            path,
            strategy=config.train.weights_loading,
            key_prefix=key_prefix,
            buffers_init=family.init_buffers,
            device=torch.device("cpu") if swapped else load_device,
            adapter_seed=config.job.seed,
            installers=installers,
        )
        if swapped:
            install_block_swap(model, swapped, dist_info.device)
        models[name] = model
    for name, model in models.items():
        if name not in trained_names:
            model.eval().requires_grad_(False)
    if log is not None or dist_info.is_main:
        for name, model in models.items():
            (log or print_line)(held_dtypes(name, model) + where_held(config, name, trained_names))
    return Stage2Models(
        models=models,
        trained=trained_names,
        lora=config.trainable.lora_base_model is not None,
        mode=mode,
        dp_rank=dist_info.rank // tp,  # the mesh is (dp, tp), row-major
        dp_size=dp,
    )
