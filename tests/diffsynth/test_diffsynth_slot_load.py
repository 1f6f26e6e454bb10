"""A frozen slot loaded by `load_slot` equals DiffSynth's own `from_pretrained` of the same file,
to the bit, and never holds the file beside the converted model.

Per pipeline the tests cover (Z-Image, Wan 2.1, Qwen-Image), every slot's tiny fp32 file is
loaded into a bf16 pipeline (a dtype change) and an fp32 one (the file's own dtype): names,
dtypes, devices and values of every parameter and buffer equal DiffSynth's load, and DiffSynth's
`load_model` never ran (the model came through `load_frozen`). A file in another key layout goes
through its entry's state-dict converter. A model whose classes run code of their own on what
they load or move (transformers' `PreTrainedModel.to`: SigLIP2, DINOv3, FLUX's T5; a `to` of its
own: Qwen-Image 2.1's text encoder, which puts fp32 buffers back; a weight-norm load hook: Wan-S2V's
wav2vec2) is loaded by `load_frozen` too, equal to DiffSynth's `load_model`; only a pre-quantized
file is refused. The memory checks load DiffSynth's WanModel from a ~50 MB fp32 file into bf16
(and, its class with a `to` of its own, into fp32: a private copy per tensor) and read the
process's peak RSS (VmHWM, reset through /proc/self/clear_refs after a tiny load warmed every
import).
"""

from __future__ import annotations

import ctypes
import gc
import json
from pathlib import Path

import pytest
import torch
from diffsynth.core import ModelConfig
from diffsynth.models.wan_video_dit import WanModel
from safetensors.torch import save_file

from splitstage.config.job import config_from_dict
from splitstage.pipelines.diffsynth.config import DiffSynthPipelineConfig
from splitstage.pipelines.diffsynth.loader import (
    MovedOnRead,
    SlotSource,
    file_entries,
    lean_load_refusal,
    load_frozen,
    load_slot,
    own_loading_code,
    pipeline_class,
)
from splitstage.tasks.job_plan import make_plan
from tests.helpers.diffsynth_jobs import PIPELINES, job_document, registered
from tests.helpers.tiny_diffsynth import (
    OWN_LOADING_MODELS,
    WAN_MODELS,
    write_tiny_model,
    write_tiny_models,
)
from tests.helpers.weight_loads import weight_loads

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PREFIX = "model.diffusion_model."  # an original-layout file's prefix (ComfyUI's)
DIFFSYNTH_LOAD = "diffsynth.core.loader.model.load_model"


def strip_prefix(state: dict) -> dict:
    """A state-dict converter as DiffSynth writes them (keys and reads only: a DiskMap has no
    items): the model's keys from PREFIX's."""
    return {key.removeprefix(PREFIX): state[key] for key in state}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The tiny models of each pipeline."""
    root = tmp_path_factory.mktemp("slot_load")
    for name in PIPELINES:
        info = write_tiny_models(name, root / name)
        (root / name / "info.json").write_text(json.dumps(info))
    return root


def tensors_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict([*model.named_parameters(), *model.named_buffers()])


def assert_same_model(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """Same class, names, dtypes, devices and bits, parameters and buffers alike."""
    assert type(ours) is type(theirs)
    mine, reference = tensors_of(ours), tensors_of(theirs)
    assert mine.keys() == reference.keys()
    for key, tensor in reference.items():
        assert mine[key].dtype == tensor.dtype, key
        assert mine[key].device == tensor.device, key
        assert mine[key].shape == tensor.shape, key
        assert torch.equal(mine[key], tensor), key
    assert ours.training == theirs.training


def diffsynths_slot(config, path: str, slot: str) -> torch.nn.Module:
    """What DiffSynth's from_pretrained puts in `slot` from `path`, in its own training mode."""
    pipe = pipeline_class(config.pipeline).from_pretrained(
        torch_dtype=DTYPES[config.pipeline.torch_dtype],
        device="cpu",
        model_configs=[ModelConfig(path=path)],
        tokenizer_config=None,
    )
    return getattr(pipe, slot).requires_grad_(False).eval()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", list(PIPELINES))
def test_each_slot_equals_diffsynths_own_load(root, name, dtype):
    info = json.loads((root / name / "info.json").read_text())
    document = job_document(root, name)
    document["pipeline"]["torch_dtype"] = dtype
    config = config_from_dict(document)
    sources = make_plan(config).family.sources
    assert sources.keys() >= {"dit", "text_encoder"}
    with registered([info]):
        for slot, source in sources.items():
            assert lean_load_refusal(source.entry) is None, slot
            with weight_loads() as seen:
                pipe = load_slot(config.pipeline, source, torch.device("cpu"), tokenizer=False)
            assert DIFFSYNTH_LOAD not in seen, slot  # loaded by load_frozen, not DiffSynth
            assert_same_model(getattr(pipe, slot), diffsynths_slot(config, source.path, slot))


def test_a_file_in_another_layout_goes_through_its_converter(tmp_path):
    """The entry's state_dict_converter renames the file's keys before loading, as in DiffSynth."""
    info = write_tiny_models("WanVideoPipeline", tmp_path / "wan")
    dit = next(e for e in info["register_models"] if e["model_name"] == "wan_video_dit")
    from safetensors.torch import load_file

    path = tmp_path / "comfy_dit.safetensors"
    save_file({PREFIX + k: v for k, v in load_file(dit["path"]).items()}, str(path))
    entry = {**dit, "path": str(path)}
    entry["state_dict_converter"] = f"{__name__}.strip_prefix"
    group = pipeline_group(info, [entry], "bf16")
    (registered_entry,) = file_entries(str(path), group.register_models)
    registered_entry["state_dict_converter"] = entry["state_dict_converter"]
    source = SlotSource(str(path), registered_entry)
    config = type("Job", (), {"pipeline": group})()
    from diffsynth.configs.model_configs import MODEL_CONFIGS

    MODEL_CONFIGS.append(registered_entry)
    try:
        with weight_loads() as seen:
            ours = load_slot(group, source, torch.device("cpu"), tokenizer=False).dit
        assert DIFFSYNTH_LOAD not in seen
        assert_same_model(ours, diffsynths_slot(config, str(path), "dit"))
    finally:
        MODEL_CONFIGS.remove(registered_entry)


class WanModelWithOwnTo(WanModel):
    """A model class with its own `to` (as Qwen-Image 2.1's text encoder has one)."""

    def to(self, *args, **kwargs):
        return super().to(*args, **kwargs)


def test_a_class_with_its_own_to_is_loaded_lean_and_equal(tmp_path):
    """A model whose class has its own `to` is loaded by `load_frozen` (its `to` run where
    DiffSynth's `load_model` runs it, each tensor a copy of its own), equal to DiffSynth's load;
    only a pre-quantized file still goes through DiffSynth's loader."""
    info = write_tiny_models("WanVideoPipeline", tmp_path / "wan")
    dit = next(e for e in info["register_models"] if e["model_name"] == "wan_video_dit")
    dit = {**dit, "model_class": f"{__name__}.WanModelWithOwnTo"}
    group = pipeline_group(info, [dit], "bf16")
    (entry,) = file_entries(dit["path"], group.register_models)
    assert lean_load_refusal(entry) is None
    assert "pre-quantized" in lean_load_refusal({**entry, "quant_config": {}})
    from diffsynth.configs.model_configs import MODEL_CONFIGS

    MODEL_CONFIGS.append(entry)
    try:
        with weight_loads() as seen:
            ours = load_slot(group, SlotSource(dit["path"], entry), torch.device("cpu"), False).dit
        assert DIFFSYNTH_LOAD not in seen
        config = type("Job", (), {"pipeline": group})()
        assert_same_model(ours, diffsynths_slot(config, dit["path"], "dit"))
    finally:
        MODEL_CONFIGS.remove(entry)


# Per model of OWN_LOADING_MODELS: the code of its own `own_loading_code` names (transformers'
# `PreTrainedModel.to` on an unquantized model is torch's: not named, the file's views kept).
OWN_CODE = {
    "siglip2_image_encoder": [],
    "siglip_vision_model_428m": [],
    "dinov3_image_encoder": [],
    "flux_text_encoder_t5": [],
    "wans2v_audio_encoder": [
        "ParametrizedConv1d (model.wav2vec2.encoder.pos_conv_embed.conv) load hooks"
    ],
    "qwen_image_21_text_encoder": ["TinyQwenImage21TextEncoder.to"],
}


def diffsynths_model(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """DiffSynth's own load of a registered file (`ModelPool.auto_load_model`, as its
    `from_pretrained` calls it for a pipeline in `dtype` on the CPU)."""
    from diffsynth.models.model_loader import ModelPool

    pool = ModelPool()
    vram_config = pool.default_vram_config() | {"computation_dtype": dtype}
    pool.auto_load_model(path, vram_config=vram_config)
    (model,) = pool.model
    return model


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("model_name", list(OWN_LOADING_MODELS))
def test_a_model_running_its_own_loading_code_equals_diffsynths_load(tmp_path, model_name, dtype):
    """Each fp32 file loaded by `load_frozen` (DiffSynth's `load_model` never runs) equals
    DiffSynth's own load of it, in bf16 and fp32: the class's own `to` (Qwen-Image 2.1's keeps
    its rotary buffers in fp32), load hooks and converter (FLUX's T5 reads its tied embedding
    twice) run as there."""
    fields = OWN_LOADING_MODELS[model_name]
    entry = write_tiny_model(model_name, fields, tmp_path / f"{model_name}.safetensors")
    with registered([{"register_models": [entry]}]):
        (source_entry,) = file_entries(entry["path"], [])
        assert lean_load_refusal(source_entry) is None
        with weight_loads() as seen:
            ours = load_frozen(SlotSource(entry["path"], source_entry), DTYPES[dtype], "cpu")
        assert DIFFSYNTH_LOAD not in seen
        assert own_loading_code(ours) == OWN_CODE[model_name]
        assert_same_model(ours, diffsynths_model(entry["path"], DTYPES[dtype]))
    if model_name == "qwen_image_21_text_encoder":
        kept = {name: b.dtype for name, b in ours.named_buffers() if "inv_freq" in name}
        assert kept and set(kept.values()) == {torch.float32}, kept


# Slots of the pipelines splitstage runs that hold such models: (pipeline, slot, model name).
OWN_LOADING_SLOTS = [
    ("QwenImagePipeline", "siglip2_image_encoder", "siglip2_image_encoder"),
    ("QwenImagePipeline", "dinov3_image_encoder", "dinov3_image_encoder"),
    ("ZImagePipeline", "image_encoder", "siglip_vision_model_428m"),
    ("WanVideoPipeline", "audio_encoder", "wans2v_audio_encoder"),
]


@pytest.mark.parametrize(("pipeline", "slot", "model_name"), OWN_LOADING_SLOTS)
def test_load_slot_loads_those_slots_lean(tmp_path, pipeline, slot, model_name):
    """`load_slot` fills these slots through `load_frozen`, not DiffSynth's loader, equal to
    DiffSynth's `from_pretrained` of the same file (an fp32 file into a bf16 pipeline)."""
    fields = OWN_LOADING_MODELS[model_name]
    entry = write_tiny_model(model_name, fields, tmp_path / f"{model_name}.safetensors")
    group = DiffSynthPipelineConfig(
        pipeline_class=pipeline,
        model_paths=[entry["path"]],
        tokenizer_path=str(tmp_path),
        register_models=[entry],
        torch_dtype="bf16",
    )
    (source_entry,) = file_entries(entry["path"], group.register_models)
    with registered([{"register_models": [entry]}]):
        with weight_loads() as seen:
            pipe = load_slot(
                group, SlotSource(entry["path"], source_entry), torch.device("cpu"), False
            )
        assert DIFFSYNTH_LOAD not in seen
        config = type("Job", (), {"pipeline": group})()
        assert_same_model(getattr(pipe, slot), diffsynths_slot(config, entry["path"], slot))


def test_private_reads_are_tensors_of_their_own(tmp_path):
    """A tensor read in its own dtype is the file's view, one object per key; read `private`,
    each read is a copy of its own (as DiskMap's clone), equal, and the file's pages go back."""
    path = tmp_path / "one.safetensors"
    save_file({"weight": torch.arange(4096, dtype=torch.float32)}, str(path))
    shared = MovedOnRead(str(path), torch.float32, "cpu")
    assert shared["weight"] is shared["weight"]
    private = MovedOnRead(str(path), torch.float32, "cpu", private=True)
    first, second = private["weight"], private["weight"]
    view = private.views["weight"]
    pointers = {first.data_ptr(), second.data_ptr(), view.data_ptr()}
    assert len(pointers) == 3
    assert torch.equal(first, view) and torch.equal(second, view)


def pipeline_group(info: dict, entries: list[dict], dtype: str) -> DiffSynthPipelineConfig:
    """A WanVideoPipeline group over `entries`' files."""
    return DiffSynthPipelineConfig(
        pipeline_class="WanVideoPipeline",
        model_paths=[e["path"] for e in entries],
        tokenizer_path=info["tokenizer_path"],
        register_models=[
            {k: v for k, v in e.items() if k != "state_dict_converter"} for e in entries
        ],
        torch_dtype=dtype,
    )


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> None:
    """The heap's free memory handed back (glibc's malloc_trim: a load must not reuse memory
    freed before it and look smaller), then VmHWM back to the current RSS (clear_refs 5)."""
    ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def wan_dit_source(
    folder: Path,
    kwargs: dict,
    model_class: str = "diffsynth.models.wan_video_dit.WanModel",
    dtype: str = "bf16",
) -> tuple[DiffSynthPipelineConfig, SlotSource]:
    """DiffSynth's WanModel with `kwargs`, random, saved in fp32; a `dtype` group loading it as
    `model_class`, and its source."""
    torch.manual_seed(0)
    folder.mkdir()
    path = folder / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in WanModel(**kwargs).state_dict().items()}, str(path))
    dit = {"path": str(path), "model_name": "wan_video_dit", "extra_kwargs": kwargs}
    dit["model_class"] = model_class
    group = pipeline_group({"tokenizer_path": str(folder)}, [dit], dtype)
    (entry,) = file_entries(str(path), group.register_models)
    return group, SlotSource(str(path), entry)


LARGE_WAN = {"dim": 256, "ffn_dim": 1024, "text_dim": 256, "freq_dim": 256, "num_heads": 4}


@pytest.mark.parametrize(
    ("model_class", "dtype"),
    [
        ("diffsynth.models.wan_video_dit.WanModel", "bf16"),
        (f"{__name__}.WanModelWithOwnTo", "bf16"),
        (f"{__name__}.WanModelWithOwnTo", "fp32"),
    ],
)
def test_a_load_never_holds_the_file_beside_the_model(tmp_path, model_class, dtype):
    """WanModel (DiffSynth's class; and with a `to` of its own, whose tensors are each a copy
    of its own, also in the file's dtype) from a ~50 MB fp32 file, after a tiny one warmed every
    import: the peak RSS the load adds stays under the loaded weights plus twice the largest
    tensor plus 8 MiB, far under the file's bytes, which a load holding the file's pages while
    it converts or copies adds on top of the weights."""
    tiny = WAN_MODELS["dit"][2]
    warm = wan_dit_source(tmp_path / "tiny", tiny, model_class, dtype)
    load_slot(*warm, torch.device("cpu"), tokenizer=False)
    kwargs = {**tiny, **LARGE_WAN, "num_layers": 12}
    group, source = wan_dit_source(tmp_path / "large", kwargs, model_class, dtype)
    largest = max(n * 4 for n in map(torch.Size.numel, shapes(source.path)))
    gc.collect()
    reset_peak_rss()
    before = status_bytes("VmRSS")
    model = load_slot(group, source, torch.device("cpu"), tokenizer=False).dit
    added = status_bytes("VmHWM") - before
    weights = sum(p.numel() * p.element_size() for p in tensors_of(model).values())
    file_bytes = Path(source.path).stat().st_size
    assert file_bytes > 40 * 2**20 and weights < (0.51 if dtype == "bf16" else 1.01) * file_bytes
    assert added <= weights + 2 * largest + 8 * 2**20, (added, weights, largest, file_bytes)


def shapes(path: str) -> list[torch.Size]:
    """The shapes of a safetensors file's tensors, from its header."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        return [torch.Size(handle.get_slice(k).get_shape()) for k in handle.keys()]  # noqa: SIM118
