"""A quantized frozen base: torchao's weight-only int8, float8 and NF4 tensors, made one weight at
a time while the base loads, under peft's LoRA layers.

Which library and why (docs/job-config.md): torchao is PyTorch's own quantization library; its
weight-only tensors run forward and backward on CPUs and GPUs (bitsandbytes' 4-bit and 8-bit
layers need a GPU to quantize, and diffusers' `BitsAndBytesConfig` refuses a CPU), they are
quantized from one plain tensor (so the base never exists whole in bf16), and peft's LoRA layers
wrap the quantized layer untouched. Linear weights use torchao's own `F.linear`; a convolution's
weight (two thirds of an SD UNet) is held quantized too and dequantized one layer at a time in
forward and again in backward (`_QuantizedConv`), so autograd never keeps a dequantized copy.
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
    the model that is not a LoRA adapter and not kept in fp32 by its class."""
    keep = set(keep_fp32 or ()) | set(getattr(model, "_keep_in_fp32_modules", None) or ())
    found = {}
    for fqn, module in model.named_modules():
        parts = set(fqn.split("."))
        if keep & parts or any(part.startswith("lora_") for part in parts):
            continue
        weight = getattr(module, "weight", None)
        frozen = weight is not None and not weight.requires_grad
        if frozen and isinstance(module, (nn.Linear, *CONVS)):
            found[fqn] = module
    return found


def nf4_blocks(numel: int) -> tuple[int, int] | None:
    """(block, scaler block) sizes that divide a weight of `numel` elements for NF4: QLoRA's 64
    and 256 where they divide, smaller powers of two for small layers; None: leave unquantized."""
    block = next((b for b in (NF4_BLOCK, 32, 16) if numel % b == 0), None)
    if block is None:
        return None
    blocks = numel // block
    scaler = next((s for s in (NF4_SCALER_BLOCK, 128, 64, 32, 16, 8) if blocks % s == 0), None)
    return None if scaler is None else (block, scaler)


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
    """Whether a parameter is held as one of torchao's quantized tensors."""
    return type(tensor).__module__.startswith("torchao.")


def quantized_kind(tensor: torch.Tensor) -> str:
    """The `base_quantization` name of a quantized tensor, from its class."""
    name = type(tensor).__name__
    return {"Int8Tensor": "int8", "Float8Tensor": "fp8", "NF4Tensor": "nf4"}.get(name, name)
