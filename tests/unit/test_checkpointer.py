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
