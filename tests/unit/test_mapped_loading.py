"""Stage 2 loads without copies: a frozen tensor in the file's dtype becomes a view of the file
mapped copy-on-write (no anonymous copy; a write never reaches the file); a tensor that is
trained, converted to another dtype or sliced is copied, one at a time, and the file's pages it
was read from leave the resident set at once."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from splitstage.storage.safetensors_io import drop_mapped_pages
from splitstage.tasks.stage2.pretrained_weights import materialize_and_load

WIDTH = 1024  # 4 MB a weight in fp32: whole pages inside every tensor


def file_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges this process maps from `path`."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path.resolve()):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


def in_file(tensor: torch.Tensor, path: Path) -> bool:
    return any(low <= tensor.data_ptr() < high for low, high in file_ranges(path))


def resident_file_kb() -> int:
    """RssFile of this process: the pages of mapped files it holds."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


@pytest.fixture
def weights(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in model().state_dict().items()}
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    return path, state


def meta_model(trained: str | None = None, dtype=torch.float32) -> nn.Module:
    """The model on the meta device; parameters under `trained` take gradients, others not."""
    with torch.device("meta"):
        built = model().to(dtype)
    for name, param in built.named_parameters():
        param.requires_grad_(trained is not None and name.startswith(trained))
    return built


def test_frozen_tensors_are_views_of_the_file_and_writes_stay_private(weights):
    path, state = weights
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = meta_model(trained="1.")  # layer 0 frozen, layer 1 trained
    report = materialize_and_load(loaded, path, device="cpu")
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[key]), key
    assert in_file(loaded[0].weight, path) and in_file(loaded[0].bias, path)
    assert not in_file(loaded[1].weight, path)  # trained: its own memory
    assert report.mapped == 2 and report.bytes_mapped == (WIDTH * WIDTH + WIDTH) * 4
    with torch.no_grad():
        loaded[0].weight.add_(1.0)  # copy-on-write: the file keeps its bytes
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_a_dtype_change_copies_each_tensor_and_hands_the_files_pages_back(weights):
    path, state = weights
    loaded = meta_model(dtype=torch.bfloat16)  # everything frozen, held in bf16
    before = resident_file_kb()
    report = materialize_and_load(loaded, path, device="cpu")
    assert report.mapped == 0 and len(report.cast) == 4
    for key, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and not in_file(tensor, path)
        assert torch.equal(tensor, state[key].to(torch.bfloat16)), key
    file_kb = path.stat().st_size // 1024
    assert resident_file_kb() - before < file_kb // 4  # the 8 MB file was not kept


def test_without_mapping_every_tensor_is_copied(weights):
    path, _ = weights
    loaded = meta_model()
    report = materialize_and_load(loaded, path, device="cpu", map_frozen=False)
    assert report.mapped == 0 and not in_file(loaded[0].weight, path)


def test_dropped_pages_read_back_from_the_file(weights):
    path, state = weights
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as handle:
        view = handle.get_tensor("0.weight")
    assert in_file(view, path)
    assert drop_mapped_pages(view) > 0
    assert torch.equal(view, state["0.weight"])  # faulted in again from the file


class OriginalLayout(nn.Sequential):
    """The test model, reading a file whose keys are another layout's (`first.*`, `second.*`)
    through slice rules, as a family's single-file hook does."""

    def original_layout_rules(self, shapes):
        from splitstage.pipelines.key_rules import Piece, Rule

        if "first.weight" not in shapes:
            return None
        names = {"0": "first", "1": "second"}
        rules = {}
        for key in ("0.weight", "0.bias", "1.weight", "1.bias"):
            layer, kind = key.split(".")
            source = f"{names[layer]}.{kind}"
            rows = shapes[source][0]
            rules[key] = Rule((Piece(source, 0, rows),), len(shapes[source]))
        return rules, "test layout"


def test_an_original_layout_file_is_converted_without_keeping_its_pages(weights, tmp_path):
    _, state = weights
    renamed = {("first." if k[0] == "0" else "second.") + k[2:]: v for k, v in state.items()}
    path = tmp_path / "original.safetensors"
    save_file(renamed, str(path))
    with torch.device("meta"):
        loaded = OriginalLayout(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    loaded.requires_grad_(False)
    before = resident_file_kb()
    report = materialize_and_load(loaded, path, device="cpu")
    assert report.loaded == 4 and report.mapped == 0
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[key]) and not in_file(tensor, path), key
    assert resident_file_kb() - before < path.stat().st_size // 1024 // 4


def test_a_frozen_stage1_model_converts_one_tensor_at_a_time_without_the_file(weights):
    """Stage 1's frozen models (pipelines.diffusers.components.place): a file view converted to
    another dtype hands its pages back; an anonymous buffer and a tied weight keep their values."""
    from splitstage.pipelines.diffusers.components import place
    from splitstage.storage.safetensors_io import mapped_state

    path, state = weights
    with torch.device("meta"):
        loaded = model()
    mapped = mapped_state(path)
    views = {t.data_ptr() for t in mapped.values()}
    loaded.load_state_dict(mapped, assign=True)
    mapped.clear()
    loaded[1].register_buffer("table", torch.arange(WIDTH * WIDTH, dtype=torch.float32))
    loaded[1].tied = loaded[0].weight  # the same Parameter under two names
    before = resident_file_kb()
    place(loaded, torch.device("cpu"), torch.bfloat16, views)
    assert loaded[1].tied is loaded[0].weight
    for key, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and not in_file(tensor, path), key
        expected = {**state, "1.tied": state["0.weight"]}.get(key, torch.arange(WIDTH * WIDTH))
        assert torch.equal(tensor, expected.to(torch.bfloat16)), key
    assert resident_file_kb() - before < path.stat().st_size // 1024 // 4
