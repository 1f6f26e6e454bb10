"""The job config: one TOML file validated by typed groups; also the Prefect flows' parameters.

The `[pipeline]` group lives in `pipeline_config`, the error and the group base in `config_base`.
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from splitstage.config.base_group import ConfigError, Group
from splitstage.config.bucket_settings import BucketConfig
from splitstage.config.monitoring import TrackingConfig, ValidationConfig
from splitstage.config.pipeline_group import (
    AnyPipelineConfig,
    _default_pipeline,
)
from splitstage.config.update_rule import checked_optimizer_args, checked_schedule_args
from splitstage.storage.credentials import check_block_name
from splitstage.storage.options import check_storage_options
from splitstage.storage.urls import (
    local_path,
    normalize_url,
    scheme_of,
    validate_rdzv_endpoint,
)

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: Any, field_name: str) -> int:
    """Bytes of a size given as bytes or a string such as '24GiB', '80GB' or '512 MiB'."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name}: expected a size such as '24GiB', got {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        text = str(value).strip().lower().replace(" ", "").replace("_", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        number, unit = (float(digits) if digits else -1.0), text[len(digits) :]
    if unit not in SIZE_UNITS or number <= 0:
        raise ValueError(
            f"{field_name}: expected a size such as '24GiB', '80GB' or a number of bytes, "
            f"got {value!r}"
        )
    return int(number * SIZE_UNITS[unit])


def storage_url(cls: type, value: str) -> str:
    """A config validator: the storage URL in normal form (see `storage.urls`)."""
    return normalize_url(value, None)


def _storage_options(cls: type, value: dict[str, Any]) -> dict[str, Any]:
    """A config validator: storage options without secrets (`check_storage_options`)."""
    return check_storage_options(value)


def _credentials_block(cls: type, value: str | None) -> str | None:
    """A config validator: a Prefect block name, or None."""
    return None if value is None else check_block_name(value)


class JobConfig(Group):
    """Identity and reproducibility of the job."""

    name: str = Field(
        "splitstage-job",
        min_length=1,
        max_length=200,
        description="Job name: names runs, outputs and logs (one path segment).",
    )
    seed: int = Field(
        0, ge=0, le=2**63 - 1, description="Seed for data order, noise, timesteps and init."
    )

    @field_validator("name")
    @classmethod
    def _one_path_segment(cls, value: str) -> str:
        return check_path_segment(value)


def check_path_segment(value: str) -> str:
    """A name used as one folder name under an output URL: it may not escape or hide."""
    bad = sorted({c for c in value if c in "/\\" or ord(c) < 32 or ord(c) == 127})
    if bad or value.strip() != value or value in (".", "..") or value.startswith((".", "-")):
        raise ValueError(
            f"{value!r} cannot name one folder under output.url: no '/' or '\\', no control "
            "characters or surrounding spaces, no leading '.' or '-'; e.g. 'sdxl-lora-v2'"
        )
    return value


class ModelConfig(Group):
    """Where one model's weights come from: a file, or a builder known to the pipeline."""

    weights: str | None = Field(None, description="safetensors or torch.save state-dict file.")
    builder: str | None = Field(
        None, description="Built-in source instead of a file, e.g. 'minilm' or 'tiny'."
    )
    key_prefix: str = Field("", description="Prefix to strip from the file's keys.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.weights is None) == (self.builder is None):
            raise ValueError("give exactly one of 'weights' (a file) or 'builder'")
        return self


class TrainableConfig(Group):
    """Which models get gradients: trained in full, or through LoRA adapters."""

    full: list[str] = Field(default_factory=list, description="Models trained in full.")
    lora_base_model: str | None = Field(None, description="Model to train with LoRA.")
    lora_target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="Module names LoRA adapts; default: the family's usual targets.",
    )
    lora_rank: int = Field(8, ge=1, le=1024)
    lora_alpha: float | None = Field(
        None, gt=0, description="LoRA scale numerator (scale = alpha / rank); default: the rank."
    )

    @model_validator(mode="after")
    def _one_way_per_model(self) -> TrainableConfig:
        duplicates = sorted({n for n in self.full if self.full.count(n) > 1})
        if duplicates:
            raise ValueError(f"full lists {', '.join(duplicates)} more than once; list each once")
        if self.lora_base_model and self.lora_base_model in self.full:
            raise ValueError(
                f"'{self.lora_base_model}' is both in full and the lora_base_model: train it in "
                "full (remove lora_base_model) or with LoRA (remove it from full)"
            )
        if self.lora_target_modules is not None and not self.lora_base_model:
            raise ValueError(
                "lora_target_modules is set but lora_base_model is not: set lora_base_model, "
                "or remove lora_target_modules"
            )
        return self

    def models(self) -> list[str]:
        """Every model that needs gradients (the splitter's trainable set)."""
        names = list(self.full)
        if self.lora_base_model and self.lora_base_model not in names:
            names.append(self.lora_base_model)
        return names


class VideoConfig(Group):
    """`[data.video]`: which frames of a video row stage 1 decodes (each a cache-key setting)."""

    num_frames: int = Field(
        81, ge=1, le=1025, description="Frames per clip; 4k+1 (1, 5, ..., 81), as Wan's VAE needs."
    )
    frame_stride: int | None = Field(
        None, ge=1, le=1000, description="Take every n-th source frame (default 1 unless fps)."
    )
    fps: float | None = Field(
        None, gt=0, le=240, description="Resample to this frame rate by timestamps instead."
    )
    start: Literal["first", "uniform"] = Field(
        "first",
        description="'first': from the first frame, at the stride or fps; 'uniform': num_frames "
        "spread evenly over the whole video.",
    )
    short_clips: Literal["refuse", "repeat_last", "shorten"] = Field(
        "refuse",
        description="A video with fewer frames than a clip needs: refuse the row by name, "
        "pad the clip with its last frame, or shorten the clip to the largest 4k+1 frames the "
        "video has (DiffSynth's rule: clips then fall into frame-count buckets).",
    )

    @field_validator("num_frames")
    @classmethod
    def _four_k_plus_one(cls, value: int) -> int:
        if (value - 1) % 4:
            low, high = value - (value - 1) % 4, value + 4 - (value - 1) % 4
            raise ValueError(
                f"num_frames = {value}: video VAEs (Wan) encode 4k+1 frames; use {low} or {high}"
            )
        return value

    @field_validator("start", mode="before")
    @classmethod
    def _no_random_start(cls, value: Any) -> Any:
        if value == "random":
            raise ValueError(
                "start = 'random' draws a new clip every epoch: per-step work that a stage-1 "
                "cache cannot hold; use 'first' or 'uniform'"
            )
        return value

    @model_validator(mode="after")
    def _stride_or_fps(self) -> VideoConfig:
        if self.fps is not None and self.frame_stride is not None:
            raise ValueError("set data.video.fps or data.video.frame_stride, not both")
        if self.start == "uniform" and (self.fps is not None or self.frame_stride is not None):
            raise ValueError(
                "start = 'uniform' spreads the frames over the whole video; remove fps and "
                "frame_stride, or use start = 'first'"
            )
        return self


class DataConfig(Group):
    """A data set in DiffSynth-Studio's format: base folder or URL plus metadata (csv, jsonl,
    parquet); credentials come from the environment or a Prefect block, as the cache's."""

    base_path: str = Field(
        "data/digits", description="Folder or fsspec URL the image paths are relative to."
    )
    metadata_path: str | None = Field(
        None, description="Path or URL; defaults to base_path/metadata.csv (.jsonl, .parquet)."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options without secrets, e.g. {endpoint_url = 'http://...'}.",
    )
    credentials_block: str | None = Field(
        None, description="Prefect block with the credentials, e.g. 'aws-credentials/my-creds'."
    )
    skip_bad_rows: bool = Field(False, description="Skip and count bad rows instead of failing.")
    limit: int | None = Field(None, ge=1, description="Use only the first N rows.")
    buckets: BucketConfig = Field(default_factory=BucketConfig, description="Aspect buckets.")
    video: VideoConfig = Field(
        default_factory=VideoConfig, description="Frame sampling of video rows."
    )

    _options = field_validator("storage_options")(_storage_options)
    _block = field_validator("credentials_block")(_credentials_block)

    @field_validator("base_path", "metadata_path")
    @classmethod
    def _data_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = normalize_url(value, None)
        if scheme_of(value) == "memory":
            raise ValueError(
                f"{value!r}: a memory:// data set lives inside one process; use a folder or "
                "object storage (s3://bucket/data)"
            )
        return local_path(value) if scheme_of(value) == "file" else value


class CacheConfig(Group):
    """Where stage 1 writes and stage 2 reads; credentials come from the environment or a block."""

    url: str = Field("runs/cache", description="Local folder or fsspec URL (s3://bucket/prefix).")
    shard_samples: int = Field(64, ge=1, le=100_000, description="Samples per shard file.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options without secrets, e.g. {endpoint_url = 'http://...'}.",
    )
    credentials_block: str | None = Field(
        None, description="Prefect block with the credentials, e.g. 'aws-credentials/my-creds'."
    )

    _url = field_validator("url")(storage_url)
    _options = field_validator("storage_options")(_storage_options)
    _block = field_validator("credentials_block")(_credentials_block)


class PreprocessConfig(Group):
    """Stage 1 settings."""

    workers: int = Field(1, ge=1, le=1024, description="Local worker processes (shards).")
    device: str = Field("auto", description="'auto' (cuda if present), 'cpu', 'cuda', 'cuda:N'.")
    batch_size: int = Field(16, ge=1, le=4096)


OptionValue = bool | int | float | str | list[bool | int | float | str]


class EmaConfig(Group):
    """`[train.ema]`: an exponential moving average of the trained parameters (for LoRA: the
    adapter), checkpointed, resumed and exported beside the weights (`..._ema`)."""

    decay: float = Field(
        0.9999, gt=0, lt=1, description="Weight of the old average at each update, in (0, 1)."
    )
    start_update: int = Field(
        0, ge=0, description="Updates before the average starts (it copies the weights then)."
    )
    use_for_validation: bool = Field(
        False, description="Draw validation samples with the averaged weights."
    )


class TrainConfig(Group):
    """Stage 2 settings."""

    mode: Literal["split", "unsplit"] = Field(
        "split", description="'split' reads the cache; 'unsplit' runs every unit every step."
    )
    task: Literal["sft", "direct_distill"] = Field(
        "sft",
        description="'sft': supervised flow matching; 'direct_distill': the student's few-step "
        "sampling from each row's seed matches the teacher-made image (families that support it).",
    )
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps.")
    batch_size: int = Field(8, ge=1, description="Samples per rank per step.")
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0, description="Linear warmup updates before the schedule.")
    optimizer: Literal["adamw", "adamw8bit", "prodigy", "adafactor"] = Field(
        "adamw",
        description="'adamw' (torch), 'adamw8bit' (bitsandbytes), 'prodigy' (prodigyopt), "
        "'adafactor' (transformers).",
    )
    optimizer_args: dict[str, OptionValue] = Field(
        default_factory=dict,
        description="Keyword arguments of the optimizer (e.g. betas = [0.9, 0.99], eps).",
    )
    lr_scheduler: Literal["constant", "linear", "cosine", "cosine_with_restarts", "polynomial"] = (
        Field(
            "constant",
            description="Learning-rate schedule after warmup (diffusers' get_scheduler).",
        )
    )
    lr_scheduler_args: dict[str, OptionValue] = Field(
        default_factory=dict,
        description="Extra schedule arguments: num_cycles (cosine_with_restarts), power "
        "(polynomial).",
    )
    max_grad_norm: float | None = Field(
        None, gt=0, description="Clip the global gradient norm to this; default: no clipping."
    )
    ema: EmaConfig | None = Field(None, description="Off when absent.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward: less memory, ~20-40% more time."
    )
    weight_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Dtype of the frozen weights of the trained model under LoRA; 'auto': the "
        "compute dtype of mixed_precision. Trained parameters stay fp32.",
    )
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto", description="'auto': bf16 on GPUs that support it, else fp32."
    )
    base_quantization: Literal["none", "int8", "fp8", "nf4"] = Field(
        "none",
        description="Quantize the frozen base of the LoRA-trained model while it loads, tensor "
        "by tensor (torchao weight-only: int8, float8 e4m3, NF4 as in QLoRA); LoRA params stay "
        "fp32. Needs the `quantization` extra (torchao).",
    )
    offload: Literal["none", "cpu"] | Annotated[int, Field(strict=True, ge=1)] = Field(
        "none",
        description="'cpu': keep the trained model's weights in host memory and bring each block "
        "to the device only while it runs (FSDP2's CPUOffloadPolicy); the optimizer steps on "
        "the CPU. A number N (LoRA, with gradient checkpointing): the frozen weights of the "
        "trained model's last N blocks stay in host memory and each layer copies its own to the "
        "device while it runs (musubi-tuner's blocks_to_swap); combines with base_quantization.",
    )
    nnodes: int = Field(1, ge=1)
    nproc_per_node: int = Field(1, ge=1)
    rdzv_endpoint: str | None = Field(None, description="host:port of the c10d rendezvous.")
    max_restarts: int = Field(0, ge=0)
    parallelism: Literal["ddp", "fsdp", "tp", "fsdp+tp", "pp"] = "ddp"
    tp_degree: int = Field(1, ge=1)
    pp_microbatches: int = Field(2, ge=1)
    weights_loading: Literal["slices", "broadcast"] = Field(
        "slices", description="'slices': each rank reads its part; 'broadcast': rank 0 reads."
    )
    prefetch: int = Field(2, ge=0, description="Cache batches read ahead.")
    checkpoint_every: int = Field(50, ge=1, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(2, ge=1)
    checkpoint_url: str | None = Field(None, description="Defaults to <output.url>/checkpoints.")
    log_every: int = Field(10, ge=1)
    device_memory: int | None = Field(
        None,
        description="Device memory one rank (and one preprocess worker) may use: '24GiB', "
        "'80GB' or bytes; a job estimated above it is refused before any model loads; "
        "default: the GPU's own memory, none on a CPU.",
    )

    fit: Literal["off", "auto"] = Field(
        "off",
        description="'auto': when stage 2 is estimated over the device budget, apply the "
        "cheapest levers that fit (docs/job-config.md gives the order) and record them in the "
        "run; 'off': refuse, naming the settings that fit.",
    )

    @field_validator("device_memory", mode="before")
    @classmethod
    def _device_memory(cls, value: Any) -> int | None:
        return None if value is None else parse_size(value, "train.device_memory")

    @field_validator("offload", mode="before")
    @classmethod
    def _offload(cls, value: Any) -> Any:
        if value in ("none", "cpu") or (type(value) is int and value >= 1):
            return value
        raise ValueError(
            f"{value!r} is not an offload: use 'none', 'cpu' (FSDP2's CPU offload) or a whole "
            "number of blocks >= 1 whose frozen weights stay in host memory (e.g. offload = 8)"
        )

    @field_validator("checkpoint_url")
    @classmethod
    def _checkpoint_url(cls, value: str | None) -> str | None:
        return None if value is None else normalize_url(value, None)

    @field_validator("rdzv_endpoint")
    @classmethod
    def _rendezvous(cls, value: str | None) -> str | None:
        return None if value is None else validate_rdzv_endpoint(value, None)

    _optimizer_args = field_validator("optimizer_args")(checked_optimizer_args)
    _schedule_args = field_validator("lr_scheduler_args")(checked_schedule_args)

    allow_stale_cache: bool = Field(
        False,
        description="Train on the cached samples of the data set even when the cache does not "
        "hold all of it (images added, edited or deleted since preprocess); default: refuse.",
    )
    scratch_dir: str | None = Field(
        None,
        description="Local folder for each run's spec, metrics and result; default: the run's "
        "output folder when output.url is local, else ./runs/train.",
    )


class OutputConfig(Group):
    """Where trained weights and run records go."""

    url: str = Field("runs/output", description="Local folder or fsspec URL.")
    remove_prefix_in_ckpt: str = Field("", description="Key prefix to strip in exported weights.")

    _url = field_validator("url")(storage_url)


def check_memory_levers(train: TrainConfig, trainable: TrainableConfig) -> None:
    """`train.base_quantization` and `train.offload` where they can run, else one line saying
    what can."""
    kind, offload = train.base_quantization, train.offload
    if isinstance(offload, int):
        check_block_offload(train, trainable)
    if kind != "none":
        where = f"train.base_quantization = '{kind}'"
        if trainable.lora_base_model is None:
            raise ValueError(
                f"{where} quantizes the frozen base of a LoRA run, but this job trains every "
                "weight of its model (full fine-tuning); set base_quantization = 'none', or "
                "train a LoRA (trainable.lora_base_model)"
            )
        if train.parallelism != "ddp" and (kind, train.parallelism) != ("nf4", "fsdp"):
            shards = (
                "; with train.parallelism = 'fsdp' use base_quantization = 'nf4' (torchao's "
                "NF4 tensor shards under FSDP2, its int8 and float8 tensors do not)"
                if train.parallelism == "fsdp"
                else "; to shard the base, use train.parallelism = 'fsdp' with "
                "base_quantization = 'nf4'"
            )
            raise ValueError(
                f"{where} runs on one process or with train.parallelism = 'ddp' (each rank "
                f"holds the whole quantized base), not '{train.parallelism}'{shards}"
            )
        if train.weights_loading != "slices":
            raise ValueError(
                f"{where} quantizes each weight as its rank reads it: set "
                "train.weights_loading = 'slices'"
            )
        if offload == "cpu":
            raise ValueError(
                f"{where} and train.offload = 'cpu' do not combine yet: keep the quantized "
                "blocks in host memory with train.offload = N (a number of blocks) instead"
            )
        if importlib.util.find_spec("torchao") is None:
            raise ValueError(f"{where} needs torchao: pip install 'splitstage[quantization]'")
    ranks = train.nnodes * train.nproc_per_node
    if (
        offload == "cpu"
        and train.parallelism != "fsdp"
        and (ranks > 1 or train.parallelism != "ddp")
    ):
        raise ValueError(
            f"train.offload = '{offload}' runs through FSDP2: on one process, or with "
            f"train.parallelism = 'fsdp' (not '{train.parallelism}' on {ranks} ranks)"
        )


def check_block_offload(train: TrainConfig, trainable: TrainableConfig) -> None:
    """`train.offload = N` (blocks in host memory) where it can run, else one line saying what
    can; N against the model's block count is checked before launch (`preflight`)."""
    where = f"train.offload = {train.offload}"
    if trainable.lora_base_model is None:
        raise ValueError(
            f"{where} keeps the frozen base of a LoRA's blocks in host memory, but this job "
            "trains every weight of its model; use train.offload = 'cpu' for full fine-tuning"
        )
    if train.parallelism != "ddp":
        raise ValueError(
            f"{where} runs on one process or with train.parallelism = 'ddp' (each rank swaps "
            f"its own copy of the base), not '{train.parallelism}'; FSDP offloads with "
            "train.offload = 'cpu'"
        )
    if not train.gradient_checkpointing:
        raise ValueError(
            f"{where} needs train.gradient_checkpointing = true: without recompute, autograd "
            "keeps every swapped block's device weights until backward, which saves nothing"
        )
    if train.weights_loading != "slices":
        raise ValueError(f"{where} loads with train.weights_loading = 'slices'")


class SplitstageConfig(Group):
    """A whole job: what to train, on what data, where the cache and outputs live."""

    job: JobConfig = Field(default_factory=JobConfig)
    pipeline: AnyPipelineConfig = Field(default_factory=_default_pipeline)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    trainable: TrainableConfig = Field(default_factory=TrainableConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _memory_levers_apply(self) -> SplitstageConfig:
        check_memory_levers(self.train, self.trainable)
        return self

    @model_validator(mode="after")
    def _trainable_models_exist(self) -> SplitstageConfig:
        if not self.pipeline.models_in_config:  # e.g. read from a pretrained folder
            return self
        for name in self.trainable.models():
            if self.models and name not in self.models:
                known = ", ".join(sorted(self.models))
                raise ValueError(
                    f"trainable model '{name}' has no [models.{name}] entry; known: {known}"
                )
        return self


def _field_path(loc: tuple) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def format_validation_error(error: ValidationError, source: str) -> str:
    """One line per problem: `source: field.path: message`."""
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field; remove it or check its spelling"
        elif item.get("ctx", {}).get("expected"):
            message = f"{message}"
        lines.append(f"{source}: {_field_path(item['loc'])}: {message}")
    return "; ".join(lines)


def config_from_dict(data: dict[str, Any], source: str = "config") -> SplitstageConfig:
    """Validate a config mapping; errors name every bad field."""
    try:
        return SplitstageConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source)) from None


MAX_CONFIG_BYTES = 16 * 2**20


def load_config(path: str | Path) -> SplitstageConfig:
    """Read and validate a TOML job config."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a folder, /dev/zero, a FIFO: never read forever
        raise ConfigError(f"config {path}: not a regular file; give the path of a TOML job file")
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config {path}: over {MAX_CONFIG_BYTES // 2**20} MiB, not a job config (a few "
                "KB of TOML); check the path"
            )
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config {path}: not UTF-8 text (byte {error.start}); save it as UTF-8 TOML"
        ) from None
    except OSError as error:
        raise ConfigError(f"config {path}: cannot read it ({error.strerror or error})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config {path}: not valid TOML: {error}") from None
    except RecursionError:
        raise ConfigError(f"config {path}: TOML nested too deeply to read") from None
    return config_from_dict(data, str(path))
