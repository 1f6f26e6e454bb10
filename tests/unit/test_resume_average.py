"""[train.ema] on a resume: the config's decay holds from the resume point on (not the
checkpoint's), an average added at a resume starts from the resumed weights at the resume update,
and without an average the export sets an earlier launch's `*_ema` file aside in the run's output
folder, touching nothing else."""

from __future__ import annotations

from pathlib import Path

import torch

from splitstage.tasks.stage2.export import set_aside_averages
from splitstage.tasks.stage2.optimization import TrainedAverage
from splitstage.tasks.stage2.outputs import RunPlaces


def trained(updates: int, decay: float) -> tuple[torch.nn.Parameter, dict]:
    """A parameter moved `updates` times with its average folded in after each, and its state."""
    param = torch.nn.Parameter(torch.zeros(3))
    average = TrainedAverage([param], decay, 0)
    for update in range(1, updates + 1):
        param.data.fill_(float(update))
        average.step()
    return param, average.state_dict()


def test_a_changed_decay_holds_from_the_resume_point_on():
    param, state = trained(12, decay=0.9)
    resumed = TrainedAverage([param], 0.5, 0)
    resumed.load_state_dict(state)
    resumed.resume_at(12)
    before = resumed.ema.shadow_params[0].clone()
    param.data.fill_(20.0)
    resumed.step()
    assert resumed.ema.decay == 0.5 and resumed.ema.cur_decay_value == 0.5
    torch.testing.assert_close(resumed.ema.shadow_params[0], 0.5 * before + 0.5 * param.detach())
    assert resumed.state_dict()["decay"] == 0.5  # what the next checkpoint records


def test_an_average_added_at_a_resume_starts_there_from_the_resumed_weights():
    param = torch.nn.Parameter(torch.zeros(3))  # the fresh build, before the checkpoint loads
    average = TrainedAverage([param], 0.9, 2)
    param.data.fill_(5.0)  # the checkpoint's weights (it holds no average)
    average.resume_at(6)
    assert torch.equal(average.ema.shadow_params[0], torch.full((3,), 5.0))
    state = average.state_dict()
    assert (state["optimization_step"], state["update_after_step"]) == (6, 6)
    param.data.fill_(7.0)
    average.step()  # update 7: the average's first, a copy
    param.data.fill_(8.0)
    average.step()  # update 8: the warm-up's first decay, counted from update 6
    assert average.ema.cur_decay_value == 2 / 11
    torch.testing.assert_close(
        average.ema.shadow_params[0], torch.full((3,), 7 * 2 / 11 + 8 * 9 / 11)
    )


def test_without_an_average_an_earlier_launchs_ema_file_is_set_aside(tmp_path: Path):
    out = tmp_path / "out" / "run"
    (out / "peft").mkdir(parents=True)
    files = {
        "dit.safetensors": b"new",
        "dit_ema.safetensors": b"old average",
        "dit_ema.safetensors.stale": b"older average",
        "peft/adapter_model.safetensors": b"new",
        "peft/adapter_model_ema.safetensors": b"old peft average",
        "notes_ema.safetensors": b"the user's",  # no twin of a written file: left alone
    }
    for name, data in files.items():
        (out / name).write_bytes(data)
    (tmp_path / "out" / "dit_ema.safetensors").write_bytes(b"outside")
    places = RunPlaces(
        run_dir=str(tmp_path / "runs"), output_url=str(out), checkpoint_url=str(out / "checkpoints")
    )
    written = {"dit": f"{out}/dit.safetensors", "peft": f"{out}/peft/adapter_model.safetensors"}
    moved = set_aside_averages(places, written)
    assert moved == [
        (f"{out}/dit_ema.safetensors", f"{out}/dit_ema.safetensors.stale-2"),
        (
            f"{out}/peft/adapter_model_ema.safetensors",
            f"{out}/peft/adapter_model_ema.safetensors.stale",
        ),
    ]
    assert sorted(p.name for p in out.rglob("*_ema.safetensors")) == ["notes_ema.safetensors"]
    assert (out / "dit_ema.safetensors.stale-2").read_bytes() == b"old average"  # nothing lost
    assert (out / "dit_ema.safetensors.stale").read_bytes() == b"older average"
    assert (tmp_path / "out" / "dit_ema.safetensors").read_bytes() == b"outside"
    assert set_aside_averages(places, written) == []
