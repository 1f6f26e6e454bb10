"""A quantized frozen base under the diffsynth family: Qwen-Image's DiT (the model users quantize
to fit one GPU) trained from the same cache with `train.base_quantization` int8, fp8 and nf4
keeps the bf16 base's first loss within each kind's tolerance, holds its frozen weights in a
fraction of the bytes, and exports a LoRA DiffSynth's own pipeline loads (real torchrun, gloo,
DiffSynth's real classes at tiny size)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from splitstage.data.digits import write_digits_dataset
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models
from splitstage.tasks.stage2.quantization import frozen_nbytes, is_quantized
from splitstage.tasks.stage2.run_records import read_metrics
from tests.helpers.diffsynth_jobs import ENV, fresh, job, output, registered
from tests.helpers.tiny_diffsynth import write_tiny_models

NAME = "QwenImagePipeline"
BF16_BASE = {"weight_dtype": "bf16", "max_steps": 1}
LOSS_TOLERANCE = {"int8": 0.01, "fp8": 0.01, "nf4": 0.03}  # of the bf16 base's first loss
# of the bf16 base: the main families' bounds plus what per-row scales weigh at 32 wide
BYTES_BOUND = {"int8": 0.55 + 0.08, "fp8": 0.55 + 0.08, "nf4": 0.30 + 0.08}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Two captioned digits, Qwen-Image's tiny models, the cache stage 1 wrote for them."""
    root = tmp_path_factory.mktemp("diffsynth-quantized")
    write_digits_dataset(root / "data", limit=2, size=32)
    info = write_tiny_models(NAME, root / NAME)
    (root / NAME / "info.json").write_text(json.dumps(info))
    assert preprocess(job(root, NAME), progress=False).computed == 2
    return root


def first_loss(root: Path, run: str, **settings) -> tuple[float, list[str], Path]:
    """The first update's loss, the rank's lines and the exported LoRA of a 1-update run."""
    config = job(root, NAME, **BF16_BASE, **settings)
    config.output.url = str(root / "out" / run)
    lines: list[str] = []
    result = train(config, run_root=root / "runs" / run, env=ENV, on_line=lines.append)
    metrics = read_metrics(Path(result.run_dir))
    return metrics[0]["loss"], lines, Path(result.outputs["dit"])


def test_each_kind_keeps_the_bf16_first_loss_and_its_lora_loads_in_diffsynth(root):
    base, _, _ = first_loss(root, "bf16")
    info = json.loads((root / NAME / "info.json").read_text())
    for kind in ("int8", "fp8", "nf4"):
        loss, lines, lora = first_loss(root, kind, base_quantization=kind)
        assert any(f"dit: frozen base {kind} (" in line for line in lines), (kind, lines)
        assert abs(loss - base) <= LOSS_TOLERANCE[kind] * abs(base), (kind, loss, base)
        with registered([info]):
            untrained = output(fresh(NAME, info), NAME)
            pipe = fresh(NAME, info)
            pipe.load_lora(pipe.dit, str(lora))  # a plain LoRA: no quantized tensor in it
            assert not torch.equal(output(pipe, NAME), untrained), kind


def test_the_quantized_dit_holds_its_frozen_weights_in_fewer_bytes(root):
    one_cpu = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")

    def dit(**train):
        plan = make_plan(job(root, NAME, weight_dtype="bf16", **train))
        return build_stage2_models(plan, one_cpu, names=["dit"]).models["dit"]

    bf16 = frozen_nbytes(dit())
    for kind in ("int8", "fp8", "nf4"):
        model = dit(base_quantization=kind)
        quantized = [n for n, p in model.named_parameters() if is_quantized(p)]
        assert quantized and not any("lora_" in n for n in quantized), kind
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        assert frozen_nbytes(model) <= BYTES_BOUND[kind] * bf16, kind
