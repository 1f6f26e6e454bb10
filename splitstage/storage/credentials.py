"""Credentials named in the config (`credentials_block = "aws-credentials/my-creds"`), read once
per process by a loader: the Prefect one (`splitstage.flows.blocks`) comes in through the
`splitstage.credentials` entry-point group, so this layer never imports Prefect itself.

A loader maps a block name to s3fs options (`key`, `secret`, `token`, `client_kwargs`). What it
returns stays in memory: never in the config, its dump, a repr or a message.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from splitstage.splitter import UserError

ENTRY_POINT_GROUP = "splitstage.credentials"
BLOCK_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
Loader = Callable[[str], dict[str, Any]]
_loaders: list[Loader] = []
_cache: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


class CredentialsError(UserError, ValueError):
    """A credentials block that no installed loader can read: names the field and the fix."""


def check_block_name(value: str) -> str:
    """Config validator: a block named as `<block-type-slug>/<block-name>`."""
    value = value.strip()
    if not BLOCK_NAME.match(value):
        raise ValueError(
            f"{value!r} is not a Prefect block name; write '<block type>/<block name>', e.g. "
            "'aws-credentials/my-creds' or 's3-bucket/my-data'"
        )
    return value


def register_loader(loader: Loader) -> None:
    """Add a loader tried before the entry-point ones (tests, other secret stores)."""
    _loaders.insert(0, loader)


def _all_loaders() -> list[Loader]:
    found = [ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP)]
    return [*_loaders, *found]


def block_options(name: str, *, field: str = "credentials_block") -> dict[str, Any]:
    """s3fs options holding the credentials of block `name` (cached for this process)."""
    with _lock:
        if name in _cache:
            return dict(_cache[name])
    loaders = _all_loaders()
    if not loaders:
        raise CredentialsError(
            f"{field}: no credentials loader is installed to read block {name!r}; "
            "`pip install splitstage[aws]` (prefect-aws) or use AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY"
        )
    options = loaders[0](name, field=field)
    with _lock:
        _cache[name] = dict(options)
    return dict(options)


def forget_blocks() -> None:
    """Drop the cached block credentials (a block was edited; tests)."""
    with _lock:
        _cache.clear()
