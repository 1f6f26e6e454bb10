"""Shared fixtures: a real S3 endpoint (moto server on loopback) and a fresh bucket per test."""

from __future__ import annotations

import json
import logging
import os
import urllib.request
from collections.abc import Iterator

import pytest

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "key",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "AWS_EC2_METADATA_DISABLED": "true",
}
S3_BUCKET = "bucket"


def _post(url: str, body: bytes = b"") -> None:
    """POST to the moto control API (text body, so moto reads it as raw data)."""
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "text/plain"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """Start a moto S3 server on 127.0.0.1 (a free port); yield its endpoint URL.

    While it runs, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret and
    AWS_EC2_METADATA_DISABLED=true are set (the previous values come back afterwards), so no real
    credentials of the user are used.
    """
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in S3_ENV.items():
            mp.setenv(name, value)
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()  # port 0: the OS picks a free port when the server binds
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> Iterator[tuple[str, dict]]:
    """Empty the server, create bucket 'bucket'; yield ('s3://bucket/prefix', storage_options)."""
    import s3fs

    _post(f"{s3_endpoint}/moto-api/reset")
    _post(
        f"{s3_endpoint}/moto-api/reset-auth", b"inf"
    )  # no auth checks unless a test turns them on
    s3fs.S3FileSystem.clear_instance_cache()
    options = {
        "key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"endpoint_url": s3_endpoint},
    }
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(S3_BUCKET)  # no region_name: moto refuses us-east-1 as a location constraint
    try:
        yield f"s3://{S3_BUCKET}/prefix", options
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_auth(s3_bucket, s3_endpoint):
    """Turn on moto's credential checks; yield (url, opts(user, secret=None) -> options)."""
    import boto3

    url, options = s3_bucket
    iam = boto3.client(
        "iam",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="key",
        aws_secret_access_key="secret",
    )
    allow_all = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
    policy = {"Version": "2012-10-17", "Statement": [allow_all]}
    creds = {}
    for user in ("writer", "nobody"):
        iam.create_user(UserName=user)
        creds[user] = iam.create_access_key(UserName=user)["AccessKey"]
    iam.put_user_policy(UserName="writer", PolicyName="all", PolicyDocument=json.dumps(policy))

    def opts(user: str, secret: str | None = None) -> dict:
        c = creds[user]
        return {**options, "key": c["AccessKeyId"], "secret": secret or c["SecretAccessKey"]}

    _post(f"{s3_endpoint}/moto-api/reset-auth", b"0")
    try:
        yield url, opts
    finally:
        _post(f"{s3_endpoint}/moto-api/reset-auth", b"inf")
