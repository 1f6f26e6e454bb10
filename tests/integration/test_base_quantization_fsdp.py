"""QLoRA under FSDP2: `base_quantization = "nf4"` with `parallelism = "fsdp"` on 2 gloo ranks
(real torchrun through the launcher), against the same job on one process.

NF4 weights are made on the meta device before `fully_shard` and filled whole-weight-quantized
at load (torchtune's order), so each rank holds half the NF4 base, and the gathered NF4 weights
are bitwise those of one process. Convolutions stay plain under FSDP (torchao's NF4 all-gather is
for 2-D weights): the demo DiT's `patch_embed` (1 of its 42 quantized weights) is NF4 on one
process and fp32 here, the one difference; so losses and LoRA within 5e-3, not 1e-5 (with that
convolution plain on both sides, the DiT's outputs were bitwise equal).
Run: .venv/bin/pytest -m slow tests/integration/test_base_quantization_fsdp.py
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitstage.config.job import ConfigError
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.memory.fit import fit_candidates, usable
from splitstage.tasks.memory.memory_plan import estimate_memory
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models
from splitstage.tasks.stage2.quantization import frozen_nbytes, nf4_shardable
from tests.helpers.tiny_job import make_workspace, tiny_config

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
ONE_CPU = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")
NF4 = {"base_quantization": "nf4", "checkpoint_every": 1, "epochs": 2}
TOLERANCE = 5e-3  # patch_embed: NF4 on one process, fp32 under FSDP (module docstring)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """Digits, demo weights and a filled cache."""
    return make_workspace(tmp_path_factory.mktemp("nf4_fsdp"), samples=8, seed=0)


def run(workspace: Path, name: str, lines: list[str] | None = None, **train_fields):
    """Train the tiny NF4 LoRA job `name` to its end (resuming when it has a checkpoint)."""
    config = tiny_config(workspace, name, 0, **(NF4 | train_fields))
    sink = lines.append if lines is not None else lambda line: None
    return train(config, run_root=workspace / "runs", env=ENV, on_line=sink)


def test_nf4_under_fsdp_trains_as_one_process_on_half_the_bytes_and_resumes(workspace):
    one = run(workspace, "one", batch_size=4, max_steps=3)
    lines: list[str] = []
    two = run(workspace, "fsdp", lines, batch_size=2, max_steps=2, **FSDP)
    assert two.world_size == 2 and two.parallelism == "fsdp" and two.updates == 2
    assert two.losses == pytest.approx(one.losses[:2], rel=TOLERANCE)
    held = next(line for line in lines if "dit: frozen base nf4 (" in line)
    per_rank = int(re.search(r"\((\d+) frozen bytes on this rank\)", held).group(1))
    config = tiny_config(workspace, "bytes", 0, base_quantization="nf4")
    plan = make_plan(config)
    whole = build_stage2_models(plan, ONE_CPU, names=["dit"], log=lambda line: None)
    ratio = per_rank / frozen_nbytes(whole.models["dit"])
    assert 0.45 <= ratio <= 0.56, ratio
    resumed_lines: list[str] = []
    resumed = run(workspace, "fsdp", resumed_lines, batch_size=2, max_steps=3, **FSDP)
    assert any("resumed from checkpoint step 2" in line for line in resumed_lines)
    assert resumed.updates == 3 and all(math.isfinite(x) for x in resumed.losses)
    assert resumed.losses == pytest.approx(one.losses, rel=TOLERANCE)
    exported, reference = load_file(resumed.outputs["dit"]), load_file(one.outputs["dit"])
    assert exported.keys() == reference.keys() and all(".lora_" in k for k in exported)
    for key, value in reference.items():
        torch.testing.assert_close(exported[key], value, rtol=TOLERANCE, atol=TOLERANCE)


FSDP = {"parallelism": "fsdp", "nproc_per_node": 2}


def test_the_memory_plan_holds_half_the_nf4_base_per_rank(workspace):
    """`validate`'s estimate of an nf4 + fsdp job: the frozen base as rank 0's NF4 shards
    (about half of what each `ddp` rank holds whole), on the fake world FSDP is estimated on."""
    frozen = {}
    for layout, fields in {"ddp": {"nproc_per_node": 2}, "fsdp": FSDP}.items():
        config = tiny_config(workspace, layout, 0, base_quantization="nf4", **fields)
        frozen[layout] = estimate_memory(make_plan(config)).stage2.parts["frozen_weights"]
    assert 0.45 <= frozen["fsdp"] / frozen["ddp"] <= 0.56, frozen


def test_fit_combines_nf4_with_the_jobs_fsdp_ranks(workspace):
    """`fit = "auto"` on a 2-rank `ddp` LoRA job: after NF4 in place of FSDP, NF4 over FSDP."""
    config = tiny_config(workspace, "fit", 0, nproc_per_node=2, gradient_checkpointing=True)
    candidates = list(fit_candidates(config, torch.device("cpu"), blocks=6))
    both = [c for c in candidates if c.get("parallelism") == "fsdp" and "base_quantization" in c]
    assert both and both[0]["base_quantization"] == "nf4"
    nf4_alone = next(i for i, c in enumerate(candidates) if c.get("base_quantization") == "nf4")
    assert nf4_alone < candidates.index(both[0])
    fitted = config.model_copy(deep=True)
    for name, value in both[0].items():
        setattr(fitted.train, name, value)
    assert usable(fitted, make_plan(fitted))


def test_real_widths_shard_with_one_process_blocks():
    """At Qwen-Image / FLUX widths each rank's rows hold whole scaler blocks: the same NF4
    weights as one process, on 2 to 8 ranks."""
    for world in (2, 4, 8):
        for shape in ((3072, 3072), (12288, 3072), (3072, 12288)):
            assert nf4_shardable(torch.Size(shape), world) == (64, 256), (shape, world)


@pytest.mark.parametrize(
    ("train_fields", "says"),
    [
        ({"base_quantization": "int8", "parallelism": "fsdp"}, "use base_quantization = 'nf4'"),
        ({"base_quantization": "fp8", "parallelism": "fsdp"}, "use base_quantization = 'nf4'"),
        ({"base_quantization": "nf4", "parallelism": "tp", "tp_degree": 2}, "not 'tp'"),
        (
            {"base_quantization": "nf4", "parallelism": "fsdp+tp", "tp_degree": 2},
            "not 'fsdp+tp'",
        ),
        ({"base_quantization": "nf4", "parallelism": "pp"}, "not 'pp'"),
        ({"base_quantization": "nf4", "parallelism": "fsdp", "offload": "cpu"}, "combine"),
    ],
)
def test_what_still_cannot_run_is_one_line_naming_what_can(workspace, train_fields, says):
    with pytest.raises(ConfigError) as error:
        tiny_config(workspace, "refused", 0, nproc_per_node=2, **train_fields)
    assert says in str(error.value) and "\n" not in str(error.value)
