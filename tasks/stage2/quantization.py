"""A quantized frozen base: torchao's weight-only int8, float8 and NF4 tensors, made one weight at
a time while the base loads, under peft's LoRA layers.

Which library and why (docs/job-config.md): torchao is PyTorch's own quantization library; its
weight-only tensors run forward and backward on CPUs and GPUs (bitsandbytes' 4-bit and 8-bit
layers need a GPU to quantize, and diffusers' `BitsAndBytesConfig` refuses a CPU), they are
quantized from one plain tensor (so the base never exists whole in bf16), and peft's LoRA layers
wrap the quantized layer untouched. Linear weights use torchao's own `F.linear`; a convolution's
weight (two thirds of an SD UNet) is held quantized too and dequantized one layer at a time in
forward and again in backward (`_QuantizedConv`), so autograd never keeps a dequantized copy.

Under FSDP2 (NF4 only: torchao's `NF4Tensor` implements FSDP2's `fsdp_pre_all_gather` /
`fsdp_post_all_gather`; its int8 and float8 tensors do not), torchtune's QLoRA order: each Linear
weight of the base becomes an NF4 tensor on the meta device before `fully_shard`, so FSDP2 shards
it with torchao's all-gather extension; at load each rank gathers the weight whole (its slice from
the file, the rest from its peers), quantizes it as one rank would (the same block scales and the
same mean of scales, which every rank's all-gather reuses), and keeps its own rows. Convolutions
stay plain there (torchao's NF4 all-gather is for 2-D weights whose state-dict shape it keeps).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

KINDS = ("int8", "fp8", "nf4")
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
NF4_BLOCK = 64  # QLoRA's block of weights per scale
NF4_SCALER_BLOCK = 256  # QLoRA's block of scales per second-level scale
SCALER_BLOCKS = (NF4_SCALER_BLOCK, 128, 64, 32, 16, 8)
NF4_RANKS = 8  # FSDP ranks a small layer's scaler blocks split over evenly (real widths: any)


def import_torchao():
    """torchao, or one line naming the extra that installs it; its import-time log lines (kernels
    built for other Pythons and GPUs) are not ours to show."""
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    except ImportError as error:
        from splitstage.config.job import ConfigError

        raise ConfigError(
            "train.base_quantization needs torchao: pip install 'splitstage[quantization]' "
            f"({error})"
        ) from None
    finally:
        quiet.setLevel(level)
    import torchao

    return torchao


def quantized_weights(model: nn.Module, keep_fp32: set[str] | None = None) -> dict[str, nn.Module]:
    """Module FQN -> module whose frozen `weight` is quantized: every Linear and convolution of
    the model that is not a LoRA adapter, not kept in fp32 by its class, not quantized yet and
    not sharded (FSDP2's NF4 weights are made before sharding, `nf4_before_sharding`)."""
    keep = set(keep_fp32 or ()) | set(getattr(model, "_keep_in_fp32_modules", None) or ())
    found = {}
    for fqn, module in model.named_modules():
        parts = set(fqn.split("."))
        if keep & parts or any(part.startswith("lora_") for part in parts):
            continue
        weight = getattr(module, "weight", None)
        frozen = weight is not None and not weight.requires_grad
        if frozen and isinstance(weight, DTensor):  # sharded: quantized before, or never
            continue
        if frozen and isinstance(module, (nn.Linear, *CONVS)) and not is_quantized(weight):
            found[fqn] = module
    return found


def nf4_shardable(shape: torch.Size, world: int) -> tuple[int, int] | None:
    """NF4 (block, scaler block) sizes for a Linear weight FSDP2 can shard evenly over `world`
    ranks (torchao's NF4 all-gather needs equal row chunks of whole scaler blocks), else None:
    one process's sizes (`nf4_blocks`) where a rank's rows hold whole scaler blocks, else a
    smaller scaler block that fits (beyond `NF4_RANKS` ranks on small layers: the scales' 8-bit
    grouping, so the NF4 weights, then differ slightly from one process's)."""
    blocks = nf4_blocks(shape.numel())
    if blocks is None or shape[0] % world:
        return None
    per_rank = shape.numel() // blocks[0] // world
    sizes = (blocks[1], *(s for s in SCALER_BLOCKS if s < blocks[1]))
    scaler = next((s for s in sizes if per_rank % s == 0), None)
    return None if scaler is None else (blocks[0], scaler)


def nf4_before_sharding(model: nn.Module, world: int) -> int:
    """Hold each frozen Linear weight FSDP2 can shard as NF4 (`nf4_shardable`) as an NF4 tensor
    on the meta device (in the dtype the base is held in), before `fully_shard`, so FSDP2 shards
    it with torchao's all-gather; the count of weights made NF4."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    import_torchao()
    count = 0
    for module in quantized_weights(model).values():
        weight = module.weight
        blocks = nf4_shardable(weight.shape, world)
        if isinstance(module, nn.Linear) and weight.is_meta and blocks is not None:
            dtype = weight.dtype
            nf4 = to_nf4(torch.empty(weight.shape, dtype=dtype, device="meta"), *blocks)
            # Its two constants held real (to_empty allocates only the sharded parts): the
            # memory plan's fake step all-gathers them; a load replaces the whole tensor.
            levels = to_nf4(torch.zeros(NF4_BLOCK * 8, dtype=dtype), NF4_BLOCK, 8).nf4
            nf4.scaler_mean, nf4.nf4 = torch.zeros((), dtype=dtype), levels
            module.weight = nn.Parameter(nf4, requires_grad=False)
            count += 1
    return count


def sharded_nf4_load(model: nn.Module, dtype: torch.dtype, device: torch.device) -> QuantizingLoad:
    """Logical weight key -> what fills this rank's NF4 shard (after `fully_shard` and
    `to_empty`) from its file slice: the weight gathered whole from the ranks' slices (one
    weight's transient copy), quantized as one rank quantizes it, this rank's rows kept."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from splitstage.tasks.stage2.parallelize import logical_name

    def loader(module: nn.Module) -> Callable[[torch.Tensor], None]:
        def install(source: torch.Tensor) -> None:
            weight = module.weight  # the sharded DTensor FSDP2 registered (to_empty replaced it)
            mesh, local = weight.device_mesh, weight.to_local()

            def sharded_like_weight(part: torch.Tensor) -> DTensor:
                return DTensor.from_local(
                    part,
                    mesh,
                    weight.placements,
                    run_check=False,
                    shape=weight.shape,
                    stride=weight.stride(),
                )

            part = source.to(device=device, dtype=dtype, copy=True)
            full = sharded_like_weight(part).full_tensor()
            nf4 = to_nf4(full, local.block_size, local.scaler_block_size)
            shard = sharded_like_weight(torch.chunk(nf4, mesh.size())[mesh.get_local_rank()])
            # assign: FSDP2's load hook re-registers the shard (its mean of scales included)
            module.load_state_dict({"weight": shard}, strict=False, assign=True)

        return install

    load = QuantizingLoad(loaders={})
    for fqn, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, DTensor) and quantized_kind(weight) == "nf4":
            load.loaders[logical_name(f"{fqn}.weight")] = loader(module)
    return load


def nf4_blocks(numel: int) -> tuple[int, int] | None:
    """(block, scaler block) sizes that divide a weight of `numel` elements for NF4: QLoRA's 64
    and 256 where they divide, smaller powers of two for small layers; the scaler block also
    splits evenly over up to `NF4_RANKS` FSDP ranks where it can, so a base quantizes the same
    on one process as sharded (`nf4_shardable`). None: leave unquantized."""
    block = next((b for b in (NF4_BLOCK, 32, 16) if numel % b == 0), None)
    if block is None:
        return None
    blocks = numel // block
    for ranks in (r for r in (NF4_RANKS, 4, 2, 1) if blocks % r == 0):
        scaler = next((s for s in SCALER_BLOCKS if blocks // ranks % s == 0), None)
        if scaler is not None:
            return block, scaler
    return None


def quantize_tensor(weight: torch.Tensor, kind: str) -> torch.Tensor | None:
    """torchao's quantized tensor for a plain weight (int8 and fp8 per output channel, NF4 by
    blocks), or None when the weight's shape does not allow `kind`."""
    if kind == "nf4":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        blocks = nf4_blocks(weight.numel())
        flat = weight.reshape(weight.shape[0], -1).contiguous()
        return None if blocks is None else to_nf4(flat, *blocks)
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    holder = nn.Linear(1, 1, bias=False, device="meta")  # torchao quantizes a module's weight
    holder.weight = nn.Parameter(weight.reshape(weight.shape[0], -1), requires_grad=False)
    config = Int8WeightOnlyConfig() if kind == "int8" else Float8WeightOnlyConfig()
    quantize_(holder, config, filter_fn=lambda module, fqn: module is holder)
    return holder.weight.data


def dequantize(weight: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A quantized weight as a plain tensor of `shape` and `dtype`."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    plain = weight.get_original_weight() if isinstance(weight, NF4Tensor) else weight.dequantize()
    return plain.reshape(shape).to(dtype)


class _QuantizedConv(torch.autograd.Function):
    """A convolution with a frozen quantized weight: dequantized for forward and again for the
    input's gradient, so only the quantized weight is saved for backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv):
        ctx.conv, ctx.input_shape = conv, x.shape
        ctx.save_for_backward(weight)
        plain = dequantize(weight, conv.weight_shape, x.dtype)
        return conv._plain_conv_forward(x, plain, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        (weight,) = ctx.saved_tensors
        conv = ctx.conv
        plain = dequantize(weight, conv.weight_shape, grad_out.dtype)
        grad_in = _conv_input_grad(conv, ctx.input_shape, plain, grad_out)
        return grad_in, None, None, None


def _conv_input_grad(conv, input_shape, weight, grad_out):
    """The gradient of a convolution's input (torch.nn.grad's functions, by dimension)."""
    functions = {1: nn.grad.conv1d_input, 2: nn.grad.conv2d_input, 3: nn.grad.conv3d_input}
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        with torch.enable_grad():  # rare layouts: let autograd derive it
            x = torch.zeros(input_shape, dtype=grad_out.dtype, device=grad_out.device)
            x.requires_grad_(True)
            out = conv._plain_conv_forward(x, weight, None)
            return torch.autograd.grad(out, x, grad_out)[0]
    dims = len(input_shape) - 2
    return functions[dims](
        input_shape, weight, grad_out, conv.stride, conv.padding, conv.dilation, conv.groups
    )


@functools.cache
def _quantized_conv_class(base: type) -> type:
    """A subclass of a convolution class whose forward runs `_QuantizedConv` (one class per base,
    so isinstance checks and state-dict keys stay those of the base class)."""

    def _conv_forward(self, x, weight, bias):
        return _QuantizedConv.apply(x, weight, bias, self)

    def _plain_conv_forward(self, x, weight, bias):
        return base._conv_forward(self, x, weight, bias)

    return type(
        f"Quantized{base.__name__}",
        (base,),
        {"_conv_forward": _conv_forward, "_plain_conv_forward": _plain_conv_forward},
    )


def install_quantized(module: nn.Module, weight: torch.Tensor, kind: str) -> bool:
    """Quantize `weight` (the loaded plain tensor) into `module.weight`; False when its shape
    does not allow `kind` (the plain weight is installed then)."""
    quantized = quantize_tensor(weight, kind)
    if quantized is None:
        module.weight = nn.Parameter(weight, requires_grad=False)
        return False
    if isinstance(module, CONVS):
        module.weight_shape = weight.shape
        module.__class__ = _quantized_conv_class(type(module))
    module.weight = nn.Parameter(quantized, requires_grad=False)
    return True


@dataclass
class QuantizingLoad:
    """What installs each quantized weight as it loads, and which weights stayed plain."""

    loaders: dict[str, Callable[[torch.Tensor], None]]
    skipped: list[str] = field(default_factory=list)


def quantizing_load(
    model: nn.Module, kind: str, dtype: torch.dtype, device: torch.device
) -> QuantizingLoad:
    """Logical weight key -> what installs its file tensor quantized: converted to `dtype` on
    `device` (one weight's transient copy), then quantized (the base never exists whole)."""
    from splitstage.tasks.stage2.parallelize import logical_name

    import_torchao()
    load = QuantizingLoad(loaders={})

    def loader(module: nn.Module, key: str) -> Callable[[torch.Tensor], None]:
        def install(source: torch.Tensor) -> None:
            plain = source.to(device=device, dtype=dtype, copy=True)
            if not install_quantized(module, plain, kind):
                load.skipped.append(key)

        return install

    for fqn, module in quantized_weights(model).items():
        key = logical_name(f"{fqn}.weight")
        load.loaders[key] = loader(module, key)
    return load


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds, a quantized tensor's parts (data and scales) included."""
    if isinstance(tensor, DTensor):  # this rank's shard (its flatten names a mesh too)
        return tensor_nbytes(tensor.to_local())
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        parts = [getattr(tensor, name) for name in names]
        return sum(tensor_nbytes(part) for part in parts if isinstance(part, torch.Tensor))
    return tensor.numel() * tensor.element_size()


def frozen_nbytes(model: nn.Module) -> int:
    """Bytes of a model's frozen parameters and buffers, as held."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return sum(tensor_nbytes(t) for t in [*frozen, *model.buffers()])


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether a parameter is held as one of torchao's quantized tensors (an FSDP2 shard too)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return type(tensor).__module__.startswith("torchao.")


def quantized_kind(tensor: torch.Tensor) -> str:
    """The `base_quantization` name of a quantized tensor (or its FSDP2 shard), from its class."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    name = type(tensor).__name__
    return {"Int8Tensor": "int8", "Float8Tensor": "fp8", "NF4Tensor": "nf4"}.get(name, name)
