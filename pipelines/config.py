"""The job config: one TOML file validated by typed groups; also the Prefect flows' parameters."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    WrapValidator,
    field_validator,
    model_validator,
)

from splitstage.splitter import UserError


class ConfigError(UserError, ValueError):
    """A job config that does not validate: names the field and what is allowed."""


class Group(BaseModel):
    """Base of every config group: unknown fields are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class JobConfig(Group):
    """Identity and reproducibility of the job."""

    name: str = Field("splitstage-job", description="Job name: names runs, outputs and logs.")
    seed: int = Field(0, description="Seed for data order, noise, timesteps and init.")


class PipelineConfig(Group):
    """Base of every family's `[pipeline]` group: `name` picks the family; the rest are settings.

    A family's group declares each setting once with `setting(..., stage1=...)`: the cache key takes
    exactly the settings marked as changing stage-1 outputs, so no second hand-kept list can go
    stale. Groups are torch-free, so `validate` and the Prefect UI form stay light.
    """

    name: str = Field(description="Pipeline family (see `splitstage families`).")
    family_class: ClassVar[str] = ""  # "module:Class" of the family, imported only when used

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for name, info in cls.model_fields.items():
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            if name != "name" and STAGE1 not in extra:
                raise TypeError(
                    f"{cls.__name__}.{name}: declare it with setting(..., stage1=True|False) so "
                    "the cache key knows whether it changes stage-1 outputs"
                )

    def settings(self) -> dict[str, Any]:
        """Every setting the family's units and training step read."""
        return {name: getattr(self, name) for name in type(self).model_fields if name != "name"}

    def stage1_settings(self) -> dict[str, Any]:
        """The settings that change stage-1 outputs (part of the cache key)."""
        fields = type(self).model_fields
        return {
            name: getattr(self, name)
            for name, info in fields.items()
            if name != "name" and (info.json_schema_extra or {}).get(STAGE1)
        }


STAGE1 = "changes_stage1"


def setting(default: Any = ..., *, stage1: bool, **kwargs: Any) -> Any:
    """A family setting: `stage1=True` when it changes what stage 1 computes (the cache key)."""
    return Field(default, json_schema_extra={STAGE1: stage1}, **kwargs)


def _pipeline_group(value: Any, handler: Any) -> PipelineConfig:
    """Validate `[pipeline]` as the config group of the family its `name` picks (default demo)."""
    if isinstance(value, PipelineConfig):
        return value
    if not isinstance(value, dict):
        return handler(value)
    from splitstage.pipelines.registry import UnknownFamilyError, config_class

    name = value.get("name", DEFAULT_FAMILY)
    try:
        group = config_class(name)
    except UnknownFamilyError as error:
        raise ValidationError.from_exception_data(
            "PipelineConfig",
            [{"type": "value_error", "loc": ("name",), "input": name, "ctx": {"error": error}}],
        ) from None
    return group.model_validate({**value, "name": name})


def _default_pipeline() -> PipelineConfig:
    return _pipeline_group({}, None)


class _AnyFamilySchema:
    """JSON schema of `[pipeline]` for the Prefect UI form: one of the registered families."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        from splitstage.pipelines.registry import config_class, family_names

        options = []
        for name in family_names():
            schema = config_class(name).model_json_schema()
            schema.pop("$defs", None)
            options.append(schema)
        return {"oneOf": options, "title": "Pipeline", "description": PipelineConfig.__doc__}


DEFAULT_FAMILY = "demo"
AnyPipelineConfig = Annotated[
    SerializeAsAny[PipelineConfig], WrapValidator(_pipeline_group), _AnyFamilySchema()
]


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
        None, description="Module names LoRA adapts; default: the family's usual targets."
    )
    lora_rank: int = Field(8, ge=1, le=1024)
    lora_alpha: float | None = Field(None, description="Defaults to the rank.")

    def models(self) -> list[str]:
        """Every model that needs gradients (the splitter's trainable set)."""
        names = list(self.full)
        if self.lora_base_model and self.lora_base_model not in names:
            names.append(self.lora_base_model)
        return names


class DataConfig(Group):
    """A data set in DiffSynth-Studio's format: base folder plus metadata.csv or .jsonl."""

    base_path: str = Field("data/digits", description="Folder the image paths are relative to.")
    metadata_path: str | None = Field(None, description="Defaults to base_path/metadata.csv.")
    skip_bad_rows: bool = Field(False, description="Skip and count bad rows instead of failing.")
    limit: int | None = Field(None, ge=1, description="Use only the first N rows.")


class CacheConfig(Group):
    """Where stage 1 writes and stage 2 reads; credentials come from the environment or a block."""

    url: str = Field("runs/cache", description="Local folder or fsspec URL (s3://bucket/prefix).")
    shard_samples: int = Field(64, ge=1, le=100_000, description="Samples per shard file.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options without secrets, e.g. {endpoint_url = 'http://...'}.",
    )

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        scheme = value.split("://", 1)[0] if "://" in value else "file"
        if scheme not in {"file", "s3", "memory", "gs", "gcs", "az", "abfs"}:
            raise ValueError(
                f"unsupported scheme '{scheme}://'; use a local path, file://, s3://, memory://, "
                "gs:// or az://"
            )
        if scheme == "s3" and not value[5:].strip("/"):
            raise ValueError("s3:// URL needs a bucket, e.g. s3://my-bucket/cache")
        return value

    @field_validator("storage_options")
    @classmethod
    def _no_secrets(cls, value: dict[str, Any]) -> dict[str, Any]:
        secret = {"key", "secret", "token", "password", "aws_secret_access_key", "session_token"}
        found = sorted(k for k in value if k.lower() in secret)
        if found:
            raise ValueError(
                f"holds credentials ({', '.join(found)}); put them in the environment "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or a Prefect block, not the config"
            )
        return value


class PreprocessConfig(Group):
    """Stage 1 settings."""

    workers: int = Field(1, ge=1, le=1024, description="Local worker processes (shards).")
    device: str = Field("auto", description="'auto' (cuda if present), 'cpu', 'cuda', 'cuda:N'.")
    batch_size: int = Field(16, ge=1, le=4096)


class TrainConfig(Group):
    """Stage 2 settings."""

    mode: Literal["split", "unsplit"] = Field(
        "split", description="'split' reads the cache; 'unsplit' runs every unit every step."
    )
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps.")
    batch_size: int = Field(8, ge=1, description="Samples per rank per step.")
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto", description="'auto': bf16 on GPUs that support it, else fp32."
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


class OutputConfig(Group):
    """Where trained weights and run records go."""

    url: str = Field("runs/output", description="Local folder or fsspec URL.")
    remove_prefix_in_ckpt: str = Field("", description="Key prefix to strip in exported weights.")


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

    @model_validator(mode="after")
    def _trainable_models_exist(self) -> SplitstageConfig:
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


def load_config(path: str | Path) -> SplitstageConfig:
    """Read and validate a TOML job config."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"config {path}: cannot read it ({error.strerror or error})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config {path}: not valid TOML: {error}") from None
    return config_from_dict(data, str(path))
