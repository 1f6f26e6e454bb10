"""The loop's checkpointer decides its own cadence (every N updates and the last) and saves and
restores the run's named `Stateful` parts beside the model and optimizer; recorded values (the
run's settings) are written for the checks before a resume."""

from __future__ import annotations

from pathlib import Path

import torch

from splitstage.tasks.stage2.checkpoint import Checkpointer, read_extra_state


class Counter:
    """A Stateful part."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = int(state["value"])


def checkpointer(url: Path, parts: dict, seed: int = 0) -> tuple[Checkpointer, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return (
        Checkpointer(
            str(url),
            model,
            [optimizer],
            parts,
            every=3,
            keep_last=5,
            lora_only=False,
            recorded={"settings": {"seed": seed}},
        ),
        model,
    )


def test_it_saves_when_due_and_restores_every_part(tmp_path):
    url = tmp_path / "ckpt"
    loop = Counter()
    saver, model = checkpointer(url, {"loop": loop})
    saved = []
    for update in range(1, 8):
        loop.value = update
        if saver.save(update, last=update == 7):
            saved.append(update)
    assert saved == [3, 6, 7]
    assert read_extra_state(str(url), 7)["settings"] == {"seed": 0}

    fresh, average = Counter(), Counter(41)
    loader, other = checkpointer(url, {"loop": fresh, "ema": average}, seed=1)
    assert not torch.equal(other.weight, model.weight)
    assert loader.load() == 7
    assert fresh.value == 7
    assert average.value == 41  # a part the checkpoint lacks keeps its fresh state
    assert torch.equal(other.weight, model.weight)


def test_without_a_checkpoint_nothing_is_loaded(tmp_path):
    part = Counter(5)
    loader, _ = checkpointer(tmp_path / "none", {"loop": part})
    assert loader.load() is None and loader.latest() is None
    assert part.value == 5


def test_a_parameter_without_a_gradient_yet_resumes_as_if_never_interrupted(tmp_path):
    """A trained parameter no loss reached before the checkpoint (a LoRA on a block output
    nothing reads, as Qwen-Image's last text stream) has no optimizer state in it: the resume
    loads (DCP refused the missing keys), and a parameter whose first gradient comes after the
    resume starts its state then, as in the run never interrupted (bitwise)."""
    from splitstage.tasks.stage2.checkpoint import load_checkpoint, save_checkpoint

    def built():
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "late": torch.nn.Linear(4, 4)})
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def update(model, optimizer, step: int) -> None:
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        out = model["used"](x)
        if step > 2:  # `late` gets its first gradient after the checkpoint at update 2
            out = out + model["late"](x)
        out.square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    straight, optimizer = built()
    for step in (1, 2, 3, 4):
        update(straight, optimizer, step)
    halted, optimizer = built()
    for step in (1, 2):
        update(halted, optimizer, step)
    save_checkpoint(str(tmp_path), 2, halted, optimizer, {}, save_rng=False)
    resumed, optimizer = built()
    load_checkpoint(str(tmp_path), 2, resumed, optimizer)
    assert not any(p in optimizer.state for p in resumed["late"].parameters())
    for step in (3, 4):
        update(resumed, optimizer, step)
    for (name, mine), theirs in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(mine, theirs), name
