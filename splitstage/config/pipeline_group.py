"""The `[pipeline]` group: the family a job names, and its settings, each marked once as changing
stage-1 outputs or not (torch-free: `validate` and the Prefect UI form stay light)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, SerializeAsAny, ValidationError, WrapValidator

from splitstage.config.base_group import Group


class PipelineConfig(Group):
    """Base of every family's `[pipeline]` group: `name` picks the family; the rest are settings.

    A family's group declares each setting once with `setting(..., stage1=...)`: the cache key takes
    exactly the settings marked as changing stage-1 outputs, so no second hand-kept list can go
    stale. Groups are torch-free, so `validate` and the Prefect UI form stay light.
    """

    name: str = Field(description="Pipeline family (see `splitstage families`).")
    family_class: ClassVar[str] = ""  # "module:Class" of the family, imported only when used
    # Every model the job trains needs a [models.NAME] entry (False: the family finds them,
    # e.g. in a pretrained folder, and [models.NAME] only overrides).
    models_in_config: ClassVar[bool] = True
    # How a job of this family takes video rows, for messages ("'wan'"); "": images only.
    video_rows: ClassVar[str] = ""

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

    def takes_video(self) -> bool:
        """Whether this job's rows may be videos (clips); False: the family trains on images."""
        return bool(self.video_rows)

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
    from splitstage.config.families import UnknownFamilyError, config_class

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
        from splitstage.config.families import config_class, family_names

        options = []
        for name in family_names():
            schema = config_class(name).model_json_schema()
            options.append(_inline_refs(schema, schema.pop("$defs", {})))
        return {"oneOf": options, "title": "Pipeline", "description": PipelineConfig.__doc__}


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    """A family's schema with its nested groups (`#/$defs/X`) written in place: the form embeds
    each family's schema inside the job's, where its own `$defs` would not resolve."""
    if isinstance(node, list):
        return [_inline_refs(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref", "")
    if ref.startswith("#/$defs/") and ref[8:] in defs:
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return {**_inline_refs(defs[ref[8:]], defs), **rest}
    return {key: _inline_refs(value, defs) for key, value in node.items()}


DEFAULT_FAMILY = "demo"
AnyPipelineConfig = Annotated[
    SerializeAsAny[PipelineConfig], WrapValidator(_pipeline_group), _AnyFamilySchema()
]
