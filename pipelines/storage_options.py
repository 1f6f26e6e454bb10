"""Storage options of data sets and the cache: checked in the config, normalised for s3fs, merged
with a Prefect block's credentials, and the one way to open a URL (pipelines and tasks share it).

Credentials never go into the config: they come from the environment (AWS_ACCESS_KEY_ID, ...) or
from a Prefect block named by `credentials_block` (see `pipelines.credentials`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import fsspec

from splitstage.pipelines import urls

S3_ALIASES = {
    "aws_access_key_id": "key",
    "aws_secret_access_key": "secret",
    "aws_session_token": "token",
}
CONFIG_SECRETS = {"key", "secret", "token", "password", "aws_secret_access_key", "session_token"}


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
    from splitstage.pipelines.credentials import block_options

    block = block_options(credentials_block, field=field)
    client = {**block.get("client_kwargs", {}), **opts.get("client_kwargs", {})}
    if opts.get("endpoint_url"):
        client.pop("endpoint_url", None)
    merged = {**{k: v for k, v in block.items() if k != "client_kwargs"}, **opts}
    if client:
        merged["client_kwargs"] = client
    return merged


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
    opts = dict(storage_options or {})
    if protocol == "file":
        url = urls.local_path(url)
    elif protocol == "s3":
        opts = s3_options(opts)
    fs, root = fsspec.core.url_to_fs(url, **opts)
    return fs, root.rstrip("/") or root
