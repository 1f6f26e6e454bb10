"""train.weight_dtype under LoRA: the frozen base in the compute dtype, the adapters in fp32.

In-process on the real stage-2 build (meta -> LoRA -> dtypes -> load from the file) for the demo
DiT and a tiny diffusers FLUX transformer; under torchrun, DDP on 2 ranks trains a bf16 base.
Run: .venv/bin/pytest -m slow tests/integration/test_weight_dtype.py
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage2.models import frozen_base_dtype
from splitstage.tasks.stage2.parallelize import logical_name
from tests.helpers.stage2_step import (
    demo_config,
    demo_files,
    flux_config,
    seed_adapters,
    step_loss,
    trained_model,
)
from tests.helpers.tiny_job import make_workspace, tiny_config

pytestmark = pytest.mark.slow
CONFIGS = {"demo": demo_config, "flux": flux_config}
FILES = {"demo": "dit.safetensors", "flux": "flux/transformer/diffusion_pytorch_model.safetensors"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return demo_files(tmp_path_factory.mktemp("dtype"))


def float_tensors(model: torch.nn.Module):
    """(name, tensor, trained) of every floating parameter and buffer."""
    for name, param in model.named_parameters():
        if param.is_floating_point():
            yield name, param, param.requires_grad
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point():
            yield name, buffer, False


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_bf16_base_holds_no_fp32_frozen_weight_and_trains(root, family):
    lines: list[str] = []
    plan, model = trained_model(CONFIGS[family](root, weight_dtype="bf16"), lines)
    tensors = list(float_tensors(model))
    frozen = [(n, t) for n, t, trained in tensors if not trained]
    lora = [(n, t) for n, t, trained in tensors if trained]
    assert frozen and lora and all(".lora_" in n for n, _ in lora)
    assert [n for n, t in frozen if t.dtype != torch.bfloat16] == []
    assert [n for n, t in lora if t.dtype != torch.float32] == []
    name = plan.family.denoiser
    assert lines == [f"{name}: frozen base bf16, trained params fp32"]
    # Loaded straight from the file into bf16: equal to the file's tensors cast once.
    file = load_file(str(root / FILES[family]))
    params = {logical_name(n): p for n, p in model.named_parameters() if not p.requires_grad}
    assert set(params) == set(file)
    for key, value in file.items():
        assert torch.equal(params[key], value.to(torch.bfloat16)), key

    seed_adapters(model)
    optimizer = torch.optim.AdamW([p for _, p in lora], lr=1e-3)
    start = {n: p.detach().clone() for n, p in lora}
    losses = []
    for step in range(3):
        loss = step_loss(plan, model, seed=step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert all(p.dtype == torch.float32 for _, p in lora)
    assert any(not torch.equal(p, start[n]) for n, p in lora)
    assert all(torch.equal(params[k], v.to(torch.bfloat16)) for k, v in file.items())


def test_auto_is_the_compute_dtype_and_full_fine_tuning_keeps_fp32(root):
    lines: list[str] = []
    trained_model(demo_config(root), lines)  # 'auto' on a CPU: fp32 unless bf16 is asked for
    assert lines == ["dit: frozen base fp32, trained params fp32"]
    cpu = torch.device("cpu")
    auto_bf16 = demo_config(root, mixed_precision="bf16")
    family = trained_model(auto_bf16)[0].family
    assert frozen_base_dtype(auto_bf16, family, "dit", cpu) == torch.bfloat16
    assert frozen_base_dtype(demo_config(root, weight_dtype="fp16"), family, "dit", cpu) == (
        torch.float16
    )
    lines.clear()
    full = demo_config(root, trainable={"full": ["dit"]}, weight_dtype="bf16")
    _, model = trained_model(full, lines)
    assert all(t.dtype == torch.float32 for _, t, _ in float_tensors(model))
    assert lines == ["dit: trained params fp32 (full fine-tuning)"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("dtype-run"), samples=16, seed=3)


@pytest.mark.parametrize(
    "layout",
    [
        # DDP, rank 0 reads the file and broadcasts the base (already cast to bf16)
        {"parallelism": "ddp", "weights_loading": "broadcast"},
        # FSDP2 shards bf16 frozen and fp32 trained parameters in the same blocks
        {"parallelism": "fsdp"},
    ],
    ids=["ddp-broadcast", "fsdp"],
)
def test_two_ranks_train_a_bf16_base_with_fp32_adapters(workspace, layout):
    lines: list[str] = []
    name = f"{layout['parallelism']}-bf16"
    config = tiny_config(
        workspace, name, 3, nproc_per_node=2, batch_size=2, weight_dtype="bf16", **layout
    )
    report = train(
        config, run_root=workspace / "runs", env={"SPLITSTAGE_DEVICE": "cpu"}, on_line=lines.append
    )
    assert report.world_size == 2 and report.updates == 3
    assert all(math.isfinite(loss) for loss in report.losses)
    assert any("dit: frozen base bf16, trained params fp32" in line for line in lines)
    exported = load_file(report.outputs["dit"])
    assert exported and all(t.dtype == torch.float32 for t in exported.values())
