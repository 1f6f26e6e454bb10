"""[train.ema] under pipeline parallelism, real torchrun (2 stages, gloo, CPU): each stage's
average is checkpointed under its parameters' global names, restored to its own stage on resume,
and exported as `dit_ema` equal to the one-process run's; a mismatched average is refused.
Run: .venv/bin/pytest -m slow tests/integration/test_pipeline_ema.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage2.checkpoint import CheckpointError, read_extra_state
from splitstage.tasks.stage2.optimization import TrainedAverage
from splitstage.tasks.stage2.run_records import read_metrics
from tests.helpers.tiny_job import make_workspace, tiny_config

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu"}
SEED = 5
PP = {"nproc_per_node": 2, "parallelism": "pp", "pp_microbatches": 2}
EMA = {"ema": {"decay": 0.9, "start_update": 1}}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A digits subset, demo weights and a filled cache, shared by the module's tests."""
    return make_workspace(tmp_path_factory.mktemp("pp-ema"), samples=32, seed=SEED)


def run(root: Path, name: str, lines: list[str] | None = None, **fields):
    """Train a tiny LoRA job with EMA to the end (resuming from its checkpoints)."""
    on_line = lines.append if lines is not None else (lambda line: None)
    config = tiny_config(root, name, SEED, **{"max_steps": 4, **EMA, **fields})
    return train(config, run_root=root / "runs", env=ENV, on_line=on_line)


def test_pipeline_ema_resumes_per_stage_and_is_exported(workspace):
    reference = run(workspace, "one")
    first = run(workspace, "pp", **(PP | {"max_steps": 2}))
    saved = read_extra_state(first.checkpoint_url, 2)["ema"]["shadow_params"]
    assert any(key.startswith("blocks.0.") for key in saved)  # stage 0's averages
    assert any(key.startswith("blocks.5.") for key in saved)  # stage 1's averages
    lines: list[str] = []
    resumed = run(workspace, "pp", lines, **PP)
    assert any("resumed from checkpoint step 2" in line for line in lines)
    assert resumed.parallelism == "pp" and resumed.updates == 4
    assert resumed.losses == pytest.approx(reference.losses, rel=1e-5)
    assert set(resumed.outputs) == set(reference.outputs) == {"dit", "dit_ema"}
    assert Path(resumed.outputs["dit_ema"]).name == Path(reference.outputs["dit_ema"]).name
    for label in ("dit", "dit_ema"):
        got, want = load_file(resumed.outputs[label]), load_file(reference.outputs[label])
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert (got[key] - value).abs().max() < 1e-5, (label, key)
    trained, average = load_file(resumed.outputs["dit"]), load_file(resumed.outputs["dit_ema"])
    assert any(not torch.equal(trained[k], average[k]) for k in trained)
    assert all("peak_rss_gib" in record for record in read_metrics(Path(resumed.run_dir)))


def test_an_average_of_other_parameters_is_refused():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    average = TrainedAverage(params, decay=0.9, start_update=0)
    state = average.state_dict()
    with pytest.raises(CheckpointError, match="do not match the 2 trained parameters"):
        average.load_state_dict({**state, "shadow_params": state["shadow_params"][:1]})
    named = average.state_by_name(["a", "b"])
    with pytest.raises(CheckpointError, match=r"lacks 1 trained parameters \(first: c\)"):
        average.load_state_by_name(named, ["a", "c"])
    with pytest.raises(CheckpointError, match="keyed by parameter name"):
        average.load_state_dict(named)
    named["shadow_params"]["b"] = torch.ones(2, 2)
    average.load_state_by_name(named, ["a", "b"])
    assert torch.equal(average.ema.shadow_params[1], torch.ones(2, 2))
