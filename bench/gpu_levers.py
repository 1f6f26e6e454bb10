"""The memory levers at real sizes, for bench/gpu_check.py: a LoRA step (1024 px, batch 1,
gradient checkpointing) of a FLUX.1-dev-size and a Qwen-Image-size transformer with a bf16 base,
each `train.base_quantization`, `train.offload = "cpu"`, and an int8 base with the frozen weights
of half its blocks in host memory (`train.offload = N`, musubi-tuner's blocks_to_swap): peak CUDA
memory allocated, median step time and the frozen bytes the model holds.

Every row goes through stage 2's own functions, in `build_stage2_models`' order: the family builds
the transformer on meta (`build_model(meta=True)`, from a tiny folder whose transformer
config.json is the real one), `adapt_trained` adds the family's LoRA, holds the base in bf16 and
turns on checkpointing; then either `quantizing_base`'s installers each get a random bf16 tensor
made on the device (standing in for the file's tensor: no file is written), or `parallelize(mode=
"fsdp", offload=True)` on a one-rank mesh with the weights made in host memory. What is left is
allocated with `to_empty` (the installers' weights left on meta, as `materialize_and_load` does),
random-initialized, and the family's `init_buffers` runs; with `offload = N` the model is made
in host memory and `install_block_swap` moves all but the swapped blocks' frozen weights to the
device (the installers move those blocks' quantized weights to the host as they make them, as
`build_stage2_models` does). The step is the family's own
`training_loss` under bf16 autocast, with stage 2's optimizer.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import statistics
import time
from pathlib import Path

import torch

# row label -> (train.base_quantization, train.offload)
LEVERS = {
    "bf16 base": ("none", "none"),
    "int8": ("int8", "none"),
    "fp8": ("fp8", "none"),
    "nf4": ("nf4", "none"),
    "offload cpu": ("none", "cpu"),
    "int8 + offload half the blocks": ("int8", "half"),
}
# Qwen-Image's transformer config (20.4B parameters); the smoke one tiny (RoPE 8+12+12 = 32)
QWEN_IMAGE = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}
QWEN_SMOKE = QWEN_IMAGE | {
    "num_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "joint_attention_dim": 64,
    "axes_dims_rope": (8, 12, 12),
}
NAMES = {"flux": "flux (FLUX.1-dev size)", "qwenimage": "qwenimage (Qwen-Image size)"}
# Seconds per row (bf16 base, int8, fp8, nf4, offload cpu, int8 + half the blocks swapped) on
# one H100 (estimates: not yet run there): Qwen-Image's LoRA injection alone takes ~9 s of CPU
# per row; an offloaded row also touches the host copy (to_empty on the CPU) and FSDP2 pins it
# again at its first forward; the swapped row pins half the int8 base and copies it to the GPU
# twice a step (forward and recompute).
BUDGETS = {
    "full": {"flux": (15, 18, 18, 20, 50, 40), "qwenimage": (25, 28, 28, 32, 90, 60)},
    "smoke": {"flux": (15, 15, 15, 15, 20, 15), "qwenimage": (15, 15, 15, 15, 20, 15)},
}
TIMED_STEPS = 3  # after one warm-up step, fewer when the row's budget runs low


def levers_budget(smoke: bool) -> float:
    """Seconds all the lever rows may take together."""
    return float(sum(map(sum, BUDGETS["smoke" if smoke else "full"].values())))


def real_folder(kind: str, arch: dict, work: Path) -> Path:
    """A tiny folder of `kind` (scheduler, settings) whose transformer config.json is `arch`:
    the family builds the real-size transformer from it on meta; its tiny weights are unread."""
    from tests.helpers.tiny_diffusers import write_tiny_folder

    folder = write_tiny_folder(kind, work / f"{kind}-levers")
    path = folder / "transformer" / "config.json"
    config = json.loads(path.read_text())
    config.update({key: list(v) if isinstance(v, tuple) else v for key, v in arch.items()})
    path.write_text(json.dumps(config, indent=2))
    return folder


def make_family(kind: str, folder: Path, work: Path, smoke: bool, lever: str):
    """The family of a LoRA job on the transformer with this row's lever, built by make_plan."""
    from splitstage.config.job import config_from_dict
    from splitstage.tasks.job_plan import make_plan

    quantization, offload = LEVERS[lever]
    pixels, tokens = (64, 16) if smoke else (1024, 512)
    config = config_from_dict(
        {
            "job": {"name": "gpu-check-levers", "seed": 0},
            "pipeline": {
                "name": kind,
                "pretrained": str(folder),
                "resolution": pixels,
                "max_prompt_length": tokens,
            },
            "trainable": {"lora_base_model": "transformer", "lora_rank": 8 if smoke else 16},
            "train": {
                "gradient_checkpointing": True,
                "weight_dtype": "bf16",
                "mixed_precision": "bf16",
                "base_quantization": quantization,
                "offload": "none" if offload == "half" else offload,
            },
            "data": {"base_path": str(work / "data")},
            "cache": {"url": str(work / "cache")},
            "output": {"url": str(work / "out")},
        }
    )
    plan = make_plan(config)
    if offload == "half":  # half the transformer's blocks, counted on meta
        from splitstage.tasks.stage2.block_swap import repeated_blocks

        config.train.offload = max(len(repeated_blocks(plan.meta_model("transformer"))) // 2, 1)
    return plan.family, pixels, tokens


POOL = 1 << 26  # random values a large host tensor is filled from (64M: 128 MB in bf16)


def fill_random(tensor: torch.Tensor, pools: dict) -> None:
    """Random values (std 0.02) into a plain or DTensor's local tensor: drawn in place, except
    a large host tensor (an offloaded weight), copied from a pool of random values (drawing
    20B normals on the host would take minutes; copying runs at memory speed)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    numel = local.numel()
    if local.device.type != "cpu" or numel < POOL // 64:
        local.normal_(0.0, 0.02)
        return
    if local.dtype not in pools:
        pools[local.dtype] = torch.empty(POOL, dtype=local.dtype).normal_(0.0, 0.02)
    flat, pool = local.view(-1), pools[local.dtype]
    offset = (numel * 7919) % POOL  # where a tensor starts in the pool varies
    for start in range(0, numel, POOL):
        size = min(POOL, numel - start)
        first = min(size, POOL - offset)
        flat[start : start + first].copy_(pool[offset : offset + first])
        flat[start + first : start + size].copy_(pool[: size - first])


def build_model(family, device: torch.device, mesh, stage: dict):
    """The transformer as stage 2 builds it for this row's lever, with random weights."""
    from splitstage.tasks.stage2.block_swap import install_block_swap, to_host_after
    from splitstage.tasks.stage2.models import adapt_trained, quantizing_base
    from splitstage.tasks.stage2.parallelize import parallelize
    from splitstage.tasks.stage2.pretrained_weights import left_on_meta, model_tensors

    name, config = "transformer", family.config
    offload = config.train.offload == "cpu"
    swap = config.train.offload if isinstance(config.train.offload, int) else 0
    stage["phase"] = "building on meta"
    model = family.build_model(name, device, meta=True)
    stage["params"] = sum(p.numel() for p in model.parameters())
    model = adapt_trained(model, name, family, device)
    if offload:  # build_stage2_models: FSDP2 on a one-rank mesh keeps the weights on the host
        parallelize(model, mesh=mesh, mode="fsdp", tp_plan=family.tp_plan(name), offload=True)
    quantized = quantizing_base(model, name, family, device)
    installers = quantized.loaders if quantized else {}
    if swap:
        installers = to_host_after(installers, model, swap)
    shapes = {key: tuple(t.shape) for key, (_, t) in model_tensors(model).items()}
    stage["phase"] = "allocating (to_empty)"
    with left_on_meta(model, installers):
        model.to_empty(device=torch.device("cpu") if offload or swap else device)
    stage["phase"] = "random init"
    with torch.no_grad():
        pools: dict = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            if not tensor.is_meta:
                fill_random(tensor, pools)
        pools.clear()
        if installers:
            stage["phase"] = f"quantizing ({config.train.base_quantization})"
        generator = torch.Generator(device).manual_seed(0)
        for key, install in installers.items():
            weight = torch.randn(
                shapes[key], generator=generator, device=device, dtype=torch.bfloat16
            )
            install(weight.mul_(0.02))  # the file's tensor, in bf16
            del weight
        family.init_buffers(model)
    if swap:
        stage["phase"] = f"placing (the last {swap} blocks' frozen weights in host memory)"
        install_block_swap(model, swap, device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} tensors left on meta, e.g. {left[0]}")
    stage["skipped"] = len(quantized.skipped) if quantized else 0
    return model


def step_inputs(kind: str, arch: dict, pixels: int, tokens: int, device: torch.device) -> dict:
    """A cached sample's tensors as stage 1 writes them for `kind` (16 latent channels, 8x)."""
    g = torch.Generator(device).manual_seed(0)
    latent = pixels // 8
    inputs = {
        "input_latents": torch.randn(1, 16, latent, latent, generator=g, device=device),
        "prompt_embeds": torch.randn(
            1, tokens, arch["joint_attention_dim"], generator=g, device=device
        ),
    }
    if kind == "flux":
        inputs["pooled_prompt_embeds"] = torch.randn(
            1, arch["pooled_projection_dim"], generator=g, device=device
        )
    else:
        inputs["prompt_embeds_mask"] = torch.ones(1, tokens, dtype=torch.long, device=device)
    return inputs


def lever_row(kind: str, arch: dict, lever: str, device, work: Path, smoke: bool, check, shared):
    """One row: build, one warm-up step, then timed steps; out of memory or time says where."""
    stage = {"phase": "planning", "params": 0, "steps": []}
    started = time.monotonic()
    try:
        return _lever_row(kind, arch, lever, device, work, smoke, check, shared, stage)
    except torch.OutOfMemoryError:
        peak = gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else "n/a"
        return f"out of memory while {stage['phase']} (peak {peak}){_so_far(stage)}"
    except TimeoutError:
        spent, peak = time.monotonic() - started, ""
        if device.type == "cuda":
            peak = f", peak so far {gib(torch.cuda.max_memory_allocated(device))}"
        return f"out of time while {stage['phase']} ({spent:.0f} s{peak}){_so_far(stage)}"


def _so_far(stage: dict) -> str:
    """The step times a row had when it stopped."""
    steps = stage["steps"]
    return f"; steps so far {', '.join(f'{s:.2f}' for s in steps)} s" if steps else ""


def _lever_row(kind, arch, lever, device, work, smoke, check, shared, stage) -> str:
    """The row's work (see lever_row)."""
    from splitstage.pipelines.draws import Draws
    from splitstage.pipelines.runtime import StepContext
    from splitstage.tasks.stage2.optimization import build_optimizer

    if kind not in shared["folders"]:
        shared["folders"][kind] = real_folder(kind, arch, work)
    family, pixels, tokens = make_family(kind, shared["folders"][kind], work, smoke, lever)
    offload = family.config.train.offload == "cpu"
    mesh = shared_mesh(shared, device) if offload else None
    started = time.perf_counter()
    model = build_model(family, device, mesh, stage)
    built = time.perf_counter() - started
    frozen = frozen_bytes(model)
    swapped = getattr(model, "block_swap", None)
    host = frozen_bytes(model, swapped.blocks) if swapped is not None else 0
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(trained, family.config.train)
    inputs = step_inputs(kind, arch, pixels, tokens, device)
    cuda = device.type == "cuda"

    def step(seed: int) -> float:
        begun = time.perf_counter()
        ctx = StepContext(
            {"transformer": model},
            device,
            Draws.shared(torch.Generator(device).manual_seed(seed)),
            family.settings(),
        )
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = family.training_loss(ctx, dict(inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stage["loss"] = loss.item()  # waits for the step, as a trainer's log line does
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - begun

    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    stage["phase"] = "the warm-up step"
    warmup = step(0)
    stage["phase"] = "the timed steps"
    for seed in range(1, TIMED_STEPS + 1):
        last = stage["steps"][-1] if stage["steps"] else warmup
        if check.row_left() < 1.5 * last + 1:
            break
        stage["steps"].append(step(seed))
    peak = gib(torch.cuda.max_memory_allocated(device)) if cuda else "n/a (CPU)"
    steps = stage["steps"]
    timing = (
        f"{statistics.median(steps):.2f} s/step (median of {len(steps)})"
        if steps
        else f"{warmup:.2f} s/step (the warm-up only)"
    )
    where = "in host memory" if offload else f"on {device.type}"
    if swapped is not None:  # the device's part, then the host's
        frozen -= host
        where += f", {gib(host)} in host memory (offload = {len(swapped.blocks)})"
    plain = f", {stage['skipped']} weights left plain" if stage["skipped"] else ""
    if not math.isfinite(stage["loss"]):
        plain += f", loss {stage['loss']} (random weights)"
    return (
        f"peak {peak}, {timing}, frozen {gib(frozen)} {where}{plain} "
        f"({count(stage['params'])} params, built in {built:.0f} s, warm-up {warmup:.1f} s)"
    )


def frozen_bytes(model, blocks=None) -> int:
    """Bytes of the frozen parameters and buffers as held (`quantization.tensor_nbytes`; a
    DTensor by its local shard: its flattening also names the device mesh in torch 2.13), or
    those of the swapped `blocks` only (`train.offload = N`)."""
    from torch.distributed.tensor import DTensor

    from splitstage.tasks.stage2.block_swap import swapped_frozen
    from splitstage.tasks.stage2.quantization import tensor_nbytes

    if blocks is not None:
        return sum(tensor_nbytes(t) for t in swapped_frozen(blocks))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in [*frozen, *model.buffers()]]
    return sum(tensor_nbytes(t) for t in tensors)


def shared_mesh(shared: dict, device: torch.device):
    """The one-rank mesh an offloaded row shards on (the process group opened once)."""
    if "mesh" not in shared:
        from splitstage.tasks.stage2.distributed import build_mesh, init_distributed

        init_distributed(device=device.type, host_collectives=True)
        shared["mesh"] = build_mesh(1, 1, 1)
    return shared["mesh"]


def free_memory(device: torch.device) -> None:
    """Give back what a row held: Python's cycles, the CUDA cache and the pinned host cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def run_levers(check, device, work: Path, smoke: bool, archs: dict) -> None:
    """Every lever row of every model of `archs` (kind -> transformer config), in order."""
    from splitstage.tasks.stage2.distributed import close_distributed
    from splitstage.tasks.stage2.quantization import import_torchao

    with contextlib.suppress(Exception):  # without it, each quantized row says why
        import_torchao()  # once, quietly, before any row's clock runs
    budgets = BUDGETS["smoke" if smoke else "full"]
    shared: dict = {"folders": {}}
    try:
        for kind, arch in archs.items():
            for lever, budget in zip(LEVERS, budgets[kind], strict=True):
                pixels = 64 if smoke else 1024
                name = f"{NAMES[kind]}: LoRA step {pixels} px, checkpointing, {lever}"
                row = (kind, arch, lever, device, work, smoke, check, shared)
                check.run(name, budget, lambda row=row: lever_row(*row), need=min(budget, 10))
                free_memory(device)
    finally:
        shared.clear()
        free_memory(device)
        close_distributed()


def gib(nbytes: float) -> str:
    """Bytes in GiB, two decimals (MiB below 0.1 GiB: a smoke model's show)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 / 10 else f"{nbytes / 2**20:.2f} MiB"


def count(number: int) -> str:
    """A parameter count: 11.90B, or 1.23M for a smoke model."""
    return f"{number / 1e9:.2f}B" if number >= 1e8 else f"{number / 1e6:.2f}M"
