"""The job config's foundations: the error it raises and the base of every config group."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from splitstage.splitter import UserError


class ConfigError(UserError, ValueError):
    """A job config that does not validate: names the field and what is allowed."""


class Group(BaseModel):
    """Base of every config group: unknown fields are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
