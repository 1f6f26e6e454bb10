"""Storage options of data sets and the cache: checked in the config, normalised for s3fs, merged
with a Prefect block's credentials, and the one way to open a URL (pipelines and tasks share it).

Credentials never go into the config: they come from the environment (AWS_ACCESS_KEY_ID, ...) or
from a Prefect block named by `credentials_block` (see `storage.credentials`). Options handed
to other processes (a run spec) may name a block instead (`name_block`): its credentials are read
where the URL is opened (`resolve_credentials`, called by `open_url`), so no secret is written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import fsspec

from splitstage.storage import urls

S3_ALIASES = {
    "aws_access_key_id": "key",
    "aws_secret_access_key": "secret",
    "aws_session_token": "token",
}
CONFIG_SECRETS = {"key", "secret", "token", "password", "aws_secret_access_key", "session_token"}
BLOCK_OPTION = "credentials_block"  # in handed-on options: {"name": block, "field": config field}


def check_storage_options(value: Mapping[str, Any]) -> dict[str, Any]:
    """Config validator of every `storage_options`: no secrets, a valid endpoint_url if given."""
    value = dict(value)
    found = sorted(k for k in value if str(k).lower() in CONFIG_SECRETS)
    if found:
        raise ValueError(
            f"holds credentials ({', '.join(found)}); put them in the environment "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or a Prefect block (credentials_block), "
            "not the config"
        )
    if BLOCK_OPTION in value:
        raise ValueError(
            "holds credentials_block; name the block in the group's own credentials_block "
            "field, beside storage_options"
        )
    endpoint = value.get("endpoint_url")
    if endpoint is not None:
        value["endpoint_url"] = urls.validate_endpoint_url(endpoint, "endpoint_url")
    return value


def s3_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Normalise S3 options: boto names to s3fs names, endpoint from options or AWS_ENDPOINT_URL."""
    opts = {S3_ALIASES.get(k, k): v for k, v in options.items()}
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    named = {"storage_options.endpoint_url": opts.pop("endpoint_url", None)}
    named["storage_options.client_kwargs.endpoint_url"] = client_kwargs.get("endpoint_url")
    named.update({v: os.environ.get(v) for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")})
    source = next((name for name, value in named.items() if value), None)
    if source:  # a bad endpoint fails late, deep in botocore, or (with a path) writes elsewhere
        client_kwargs["endpoint_url"] = urls.validate_endpoint_url(named[source], source)
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    return opts


def with_credentials(
    url: str,
    storage_options: Mapping[str, Any] | None,
    credentials_block: str | None,
    *,
    field: str = "credentials_block",
) -> dict[str, Any]:
    """`storage_options` plus the named Prefect block's credentials (object stores only).

    The config's own options win over the block's (e.g. its endpoint_url); the block's secrets
    live only in the returned dict (in memory), never in the config or its dump.
    """
    opts = dict(storage_options or {})
    if not credentials_block or urls.scheme_of(url) not in urls.OBJECT_STORE_SCHEMES:
        return opts
    from splitstage.storage.credentials import block_options

    block = block_options(credentials_block, field=field)
    client = {**block.get("client_kwargs", {}), **opts.get("client_kwargs", {})}
    if opts.get("endpoint_url"):
        client.pop("endpoint_url", None)
    merged = {**{k: v for k, v in block.items() if k != "client_kwargs"}, **opts}
    if client:
        merged["client_kwargs"] = client
    return merged


def name_block(
    storage_options: Mapping[str, Any] | None, credentials_block: str | None, *, field: str
) -> dict[str, Any]:
    """`storage_options` naming a block whose credentials join them when the URL is opened: safe
    to write into JSON (the name and the config field that gave it, never a secret)."""
    opts = dict(storage_options or {})
    if credentials_block:
        opts[BLOCK_OPTION] = {"name": credentials_block, "field": field}
    return opts


def resolve_credentials(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Options ready for a filesystem: a block named by `name_block` replaced by its credentials
    (object stores only; read once per process); other options are returned as they are."""
    opts = dict(storage_options or {})
    named = opts.pop(BLOCK_OPTION, None)
    if not named:
        return opts
    return with_credentials(url, opts, named["name"], field=named["field"])


def open_url(
    url: str, storage_options: Mapping[str, Any] | None = None, *, field: str | None = None
) -> tuple[Any, str]:
    """`(fs, root_path)` of a local path, `file://`, `memory://`, `s3://`, `gs://`... URL.

    Normalised first (`urls.normalize_url`, without the bucket-naming rules); `~` is expanded on
    this machine. Raises InvalidURLError for bad forms, ImportError when the filesystem is not
    installed and TypeError for an unknown option (callers say these in their own words).
    """
    url = urls.normalize_url(url, field, check_bucket=False)
    protocol = urls.scheme_of(url)
    opts = resolve_credentials(url, storage_options)
    if protocol == "file":
        url = urls.local_path(url)
    elif protocol == "s3":
        opts = s3_options(opts)
    fs, root = fsspec.core.url_to_fs(url, **opts)
    return fs, root.rstrip("/") or root
