"""train.offload = N: the frozen weights of the trained model's last N blocks in host memory,
copied to the device by each layer's hooks while it runs (tasks/stage2/block_swap.py).

On this CPU the device is the host, so a move between them cannot be seen directly. What is
checked is what can be: the step (loss and every LoRA gradient) equals the step without offload
to the bit, on the real stage-2 build (demo DiT and a tiny FLUX, plain and int8 bases, with
gradient checkpointing); with the meta device standing in for the GPU (a host weight meeting a
meta activation raises), forward, recompute and backward of the demo DiT, a tiny FLUX and a tiny
SD UNet find every swapped weight on the device, and fail without the hooks; the hooks run
(`BlockSwap.copies`, a counter the hooks themselves increment, and a spy hook that sees a copy,
not the host parameter, inside each swapped layer's forward and its recompute); outside them the
model holds the host parameters; the refusals; the memory plan's parts; fit's choice; a resumed
run; DDP on 2 gloo ranks through the launcher. What it saves on a GPU is
bench/gpu_levers.py's row.
Run: .venv/bin/pytest -m slow tests/integration/test_block_swap.py
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.memory.fit import choose_fit
from splitstage.tasks.memory.memory_plan import estimate_memory
from splitstage.tasks.memory.tracked_step import storage_bytes
from splitstage.tasks.stage2.block_swap import frozen_owners, repeated_blocks, swapped_frozen
from splitstage.tasks.stage2.distributed import close_distributed
from splitstage.tasks.stage2.preflight import check_job
from splitstage.tasks.stage2.trainer import Trainer
from tests.helpers.stage2_step import (
    demo_config,
    demo_files,
    flux_config,
    seed_adapters,
    step_inputs,
    step_loss,
    trained_model,
)
from tests.helpers.tiny_diffusers import write_tiny_folder
from tests.helpers.tiny_job import make_workspace, one_rank_setup, tiny_config

pytestmark = pytest.mark.slow
CHECKPOINTING = {"gradient_checkpointing": True}
META = torch.device("meta")
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return demo_files(tmp_path_factory.mktemp("block-swap"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """Digits, the demo's default-size weights and a filled cache (for whole runs)."""
    return make_workspace(tmp_path_factory.mktemp("block-swap-runs"), samples=16, seed=0)


def step(config):
    """(log line, model, loss, {LoRA parameter: gradient}) of one step of the stage-2 build."""
    lines: list[str] = []
    plan, model = trained_model(config, lines)
    seed_adapters(model)
    loss = step_loss(plan, model)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return lines[0], model, loss.item(), grads


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("family", ["demo", "flux"])
def test_swapped_blocks_train_as_resident_ones(root, family, quantization):
    make = demo_config if family == "demo" else flux_config
    settings = CHECKPOINTING | {"base_quantization": quantization}
    line, _, loss, grads = step(make(root, **settings))
    count = 2
    line_off, model, loss_off, grads_off = step(make(root, offload=count, **settings))
    assert line_off == (
        f"{line} (the frozen weights of its last {count} blocks in host memory: "
        f"train.offload = {count})"
    )
    assert loss_off == loss and set(grads_off) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_off[name], grad, rtol=0, atol=0, msg=name)
    swap = model.block_swap
    assert swap.blocks == repeated_blocks(model)[-count:]
    held = swapped_frozen(swap.blocks)
    if quantization == "int8":
        assert any(type(p).__module__.startswith("torchao.") for p in held)
    # each swapped weight copied for its forward and again for its recompute in backward
    assert swap.copies == 2 * len(held)
    assert all(p.device.type == "cpu" and isinstance(p, torch.nn.Parameter) for p in held)
    assert not any(p.requires_grad for p in held)


def test_a_swapped_layer_runs_on_a_copy_and_keeps_its_host_weights(root):
    config = demo_config(root, offload=1, **CHECKPOINTING)
    plan, model = trained_model(config)
    seed_adapters(model)
    swap = model.block_swap
    owners = frozen_owners(swap.blocks)
    host = {id(m): {n: m._parameters[n] for n in names} for m, names in owners.items()}
    seen: list[bool] = []

    def spy(module, args):  # registered after the swap's hook: runs after it
        for name, param in host[id(module)].items():
            inside = module._parameters[name]
            seen.append(inside is not param and inside.data_ptr() != param.data_ptr())

    for module in owners:
        module.register_forward_pre_hook(spy)
    step_loss(plan, model).backward()
    assert len(seen) == 2 * sum(len(n) for n in owners.values())  # forward and recompute
    assert all(seen)
    for module, names in owners.items():
        for name in names:
            assert module._parameters[name] is host[id(module)][name]


def sd_config(root: Path, **train):
    """LoRA (rank 4) on a tiny SD 1.5 UNet written under `root / 'sd'`."""
    if not (root / "sd" / "model_index.json").is_file():
        write_tiny_folder("sd", root / "sd")
    pipeline = {"name": "sd", "pretrained": str(root / "sd"), "resolution": 64}
    return config_from_dict(
        {
            "pipeline": pipeline | {"precision": "fp32"},
            "trainable": {"lora_base_model": "unet", "lora_rank": 4},
            "data": {"base_path": str(root / "data")},
            "cache": {"url": str(root / "cache")},
            "train": train,
            "output": {"url": str(root / "out")},
        }
    )


def on_device_but_the_swapped(model, device: torch.device) -> None:
    """Every tensor of `model` to `device` except the swapped blocks' host weights, and the
    swap's copies to `device` (what `install_block_swap` does for a GPU)."""
    swap = model.block_swap
    host = {id(p) for p in swapped_frozen(swap.blocks)}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in host:
                moved = param.detach().to(device).requires_grad_(param.requires_grad)
                module._parameters[name] = torch.nn.Parameter(moved, param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    swap.device = device


def loss_on(plan, model, device: torch.device) -> torch.Tensor:
    """The family's training loss with its inputs on `device` (the SD UNet: its output's)."""
    if plan.family.name == "sd":
        config = model.config
        latents = torch.randn(2, config.in_channels, 8, 8, device=device)
        text = torch.randn(2, 7, config.cross_attention_dim, device=device)
        timesteps = torch.tensor([10, 500], device=device)
        return model(latents, timesteps, text).sample.square().mean()
    draws = Draws.shared(torch.Generator().manual_seed(1))
    ctx = StepContext({plan.family.denoiser: model}, device, draws, plan.family.settings())
    inputs = {key: value.to(device) for key, value in step_inputs(plan).items()}
    return plan.family.training_loss(ctx, inputs)


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("family", ["demo", "flux", "sd"])
def test_on_a_device_that_is_not_the_host_every_use_finds_the_copy(root, family, quantization):
    """The meta device stands in for a GPU: a meta tensor has no data, so a host weight meeting
    a meta activation raises, as a host weight meeting a CUDA activation does. Forward, the
    checkpoints' recompute and backward all run on meta (the SD UNet checkpoints each resnet
    inside its blocks, and runs its mid-block's first resnet unchecked), and only with the
    hooks; the swapped weights stay on the host."""
    make = {"demo": demo_config, "flux": flux_config, "sd": sd_config}[family]
    settings = CHECKPOINTING | {"offload": 2, "base_quantization": quantization}
    for hooks in (True, False):
        plan, model = trained_model(make(root, **settings))
        swap = model.block_swap
        on_device_but_the_swapped(model, META)
        if not hooks:
            swap.remove()
        model.train()
        if not hooks:
            with pytest.raises(RuntimeError, match="meta"):
                loss_on(plan, model, META).backward()
            continue
        loss_on(plan, model, META).backward()
        trained = [p for p in model.parameters() if p.requires_grad]
        assert trained and all(p.grad is not None and p.grad.is_meta for p in trained)
        assert {p.device.type for p in swapped_frozen(swap.blocks)} == {"cpu"}
        assert swap.copies >= len(swapped_frozen(swap.blocks))


def test_block_offload_refusals_are_one_line(root):
    lora = {"lora_base_model": "dit", "lora_rank": 4}
    cases = {
        "train.parallelism = 'ddp'": {"parallelism": "fsdp", "nproc_per_node": 2},
        "needs train.gradient_checkpointing = true": {"gradient_checkpointing": False},
        "use train.offload = 'cpu' for full fine-tuning": {"trainable": {"full": ["dit"]}},
        "train.weights_loading = 'slices'": {"weights_loading": "broadcast"},
    }
    for words, settings in cases.items():
        trainable = settings.pop("trainable", lora)
        with pytest.raises(ConfigError) as error:
            demo_config(root, trainable, offload=2, **(CHECKPOINTING | settings))
        assert words in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError) as error:
        demo_config(root, offload="cpu", base_quantization="int8")
    assert "train.offload = N" in str(error.value)
    plan = make_plan(demo_config(root, offload=4, **CHECKPOINTING))
    with pytest.raises(ConfigError) as error:
        check_job(plan)
    message = str(error.value)
    assert "train.offload = 4" in message and "3 repeated blocks" in message
    assert "\n" not in message
    check_job(make_plan(demo_config(root, offload=3, **CHECKPOINTING)))


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_memory_plan_moves_the_swapped_blocks_off_the_device(workspace, quantization):
    settings = CHECKPOINTING | {"base_quantization": quantization}

    def estimate(**train_settings):
        config = tiny_config(workspace, "estimate", 0, **settings, **train_settings)
        return estimate_memory(make_plan(config), torch.device("cpu"))

    plain, swapped = estimate(), estimate(offload=2)
    _, model = trained_model(tiny_config(workspace, "held", 0, **settings))  # as stage 2 holds it
    blocks = repeated_blocks(model)[-2:]
    block_bytes = [storage_bytes(swapped_frozen([block])) for block in blocks]
    parts, parts_off = plain.stage2.parts, swapped.stage2.parts
    assert parts["frozen_weights"] - parts_off["frozen_weights"] == sum(block_bytes)
    assert parts_off["offload_window"] == max(block_bytes)
    for part in ("trained_params", "gradients", "optimizer_state", "activations"):
        assert parts_off[part] == parts[part], part
    assert any("offload = 2" in note for note in swapped.notes)


def test_two_ddp_ranks_with_swapped_int8_blocks_train_as_without(workspace):
    losses = {}
    for offload in ("none", 2):
        settings = {"parallelism": "ddp", "nproc_per_node": 2, "max_steps": 2}
        settings |= CHECKPOINTING | {"base_quantization": "int8", "offload": offload}
        config = tiny_config(workspace, f"swap-{offload}", 0, batch_size=2, **settings)
        lines: list[str] = []
        report = train(config, run_root=workspace / "runs", env=ENV, on_line=lines.append)
        assert report.updates == 2 and all(math.isfinite(x) for x in report.losses)
        assert any("train.offload = 2" in line for line in lines) == (offload == 2)
        losses[offload] = report.losses
    assert losses[2] == losses["none"]


def test_a_resume_with_the_same_offload_continues_exactly(workspace, capsys):
    def run(name: str, max_steps: int, **train_settings) -> list[float]:
        config = tiny_config(workspace, name, 0, max_steps=max_steps, **train_settings)
        try:
            return Trainer(one_rank_setup(config, workspace / "runs")).run()["losses"]
        finally:
            close_distributed()

    whole = run("whole", 4, **CHECKPOINTING)
    run("swapped", 2, offload=2, **CHECKPOINTING)  # checkpoint_every 2: saved at update 2
    capsys.readouterr()
    resumed = run("swapped", 4, offload=2, **CHECKPOINTING)
    assert "resumed from checkpoint step 2" in capsys.readouterr().out
    assert resumed == whole


def test_offload_blocks_parse_as_numbers_only():
    base = {"trainable": {"lora_base_model": "dit"}, "models": {"dit": {"builder": "tiny"}}}
    for bad in (0, True, "3", 2.5):
        with pytest.raises(ConfigError) as error:
            config_from_dict(base | {"train": {"offload": bad}})
        assert "a whole number of blocks >= 1" in str(error.value)
    good = config_from_dict(base | {"train": {"offload": 3} | CHECKPOINTING})
    assert good.train.offload == 3


def test_fit_swaps_the_fewest_blocks_that_fit_with_a_quantized_base(workspace):
    """Between a quantized base and offload = 'cpu', fit tries offload = 2, 4, ... blocks."""
    levers = CHECKPOINTING | {"weight_dtype": "bf16", "batch_size": 1}
    levers |= {"gradient_accumulation_steps": 4, "base_quantization": "int8"}
    swapped = {
        count: estimate_memory(
            make_plan(tiny_config(workspace, "e", 0, offload=count, **levers)),
            torch.device("cpu"),
        ).stage2.peak_bytes
        for count in (2, 4)
    }
    assert swapped[4] < swapped[2]
    config = tiny_config(workspace, "fit", 0, fit="auto", device_memory=swapped[4])
    plan = make_plan(config)
    chosen, memory = choose_fit(plan, estimate_memory(plan, torch.device("cpu")))
    assert chosen.overrides == levers | {"offload": 4}
    assert chosen.peak_bytes == swapped[4] == memory.stage2.peak_bytes
