"""Read a Prefect block named in the config (`credentials_block`) as s3fs options: what a
deployment on a work pool uses instead of environment variables. Registered as the
`splitstage.credentials` entry point (see `storage.credentials`).

Blocks: prefect-aws `AwsCredentials` (`aws-credentials/NAME`), `MinIOCredentials`
(`minio-credentials/NAME`) and `S3Bucket` (`s3-bucket/NAME`: its credentials are used).
"""

from __future__ import annotations

from typing import Any

from splitstage.config.base_group import ConfigError
from splitstage.storage.urls import scrub


def _secret(value: Any) -> str | None:
    """The plain text of a SecretStr (or a str); None when unset."""
    if value is None:
        return None
    return value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)


def _client_kwargs(params: Any, region: str | None) -> dict[str, Any]:
    """client_kwargs from an AwsClientParameters (endpoint_url, verify) and a region."""
    out: dict[str, Any] = {}
    endpoint = getattr(params, "endpoint_url", None) if params is not None else None
    if endpoint:
        out["endpoint_url"] = str(endpoint)
    verify = getattr(params, "verify", None) if params is not None else None
    if verify is False:
        out["verify"] = False
    if region:
        out["region_name"] = region
    return out


def credentials_options(creds: Any) -> dict[str, Any]:
    """s3fs options of an AwsCredentials or MinIOCredentials block."""
    if hasattr(creds, "minio_root_user"):
        key, secret, token = creds.minio_root_user, _secret(creds.minio_root_password), None
        profile = None
    else:
        key = creds.aws_access_key_id
        secret, token = _secret(creds.aws_secret_access_key), _secret(creds.aws_session_token)
        profile = getattr(creds, "profile_name", None)
    options: dict[str, Any] = {"key": key, "secret": secret, "token": token, "profile": profile}
    options = {k: v for k, v in options.items() if v}
    client = _client_kwargs(getattr(creds, "aws_client_parameters", None), creds.region_name)
    if client:
        options["client_kwargs"] = client
    return options


def prefect_api_url() -> str | None:
    """The Prefect API this process talks to: PREFECT_API_URL, or the server of the flow run it
    is in (ephemeral mode); None when reading a block would start a temporary server."""
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return str(PREFECT_API_URL.value())
    in_run = FlowRunContext.get() is not None or TaskRunContext.get() is not None
    return "the flow run's server" if in_run else None


def block_storage_options(name: str, *, field: str = "credentials_block") -> dict[str, Any]:
    """s3fs options from the saved block `name` ('aws-credentials/x', 's3-bucket/y', ...)."""
    api = prefect_api_url()
    if api is None:  # a temporary server would start (20-40 s) with a database of its own
        raise ConfigError(
            f"{field}: block {name!r} is read from a Prefect server, but no Prefect API is set "
            "in this process (PREFECT_API_URL); `prefect config set PREFECT_API_URL="
            "http://127.0.0.1:4200/api` (the server of `prefect server start`) or export it, or "
            "leave the block out and use AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        )
    try:
        import prefect_aws  # noqa: F401  (registers the AWS block types)
    except ImportError:
        raise ConfigError(
            f"{field}: reading block {name!r} needs prefect-aws; `pip install splitstage[aws]`"
        ) from None
    from prefect.blocks.core import Block

    slug = name.split("/", 1)[0]
    try:
        block = Block.load(name)
    except ValueError as exc:
        raise ConfigError(
            f"{field}: no Prefect block {name!r} on the Prefect server at {api} "
            f"({scrub(str(exc))}); "
            "create it (e.g. `AwsCredentials(...).save('my-creds')`) or fix the name"
        ) from None
    except Exception as exc:  # the API is unreachable, the block type is unknown...
        raise ConfigError(
            f"{field}: cannot read Prefect block {name!r}: {type(exc).__name__}: "
            f"{scrub(str(exc))[:300]}; check PREFECT_API_URL and the block name"
        ) from None
    creds = getattr(block, "credentials", block)  # an S3Bucket carries its credentials block
    if not hasattr(creds, "aws_access_key_id") and not hasattr(creds, "minio_root_user"):
        raise ConfigError(
            f"{field}: block {name!r} (type {slug}) holds no AWS credentials; name an "
            "'aws-credentials/...', 'minio-credentials/...' or 's3-bucket/...' block"
        )
    return credentials_options(creds)
