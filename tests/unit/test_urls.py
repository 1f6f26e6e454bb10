"""storage/urls.py, table-driven: storage URLs, bucket names, endpoints, rendezvous endpoints.

Every invalid value must raise `InvalidURLError` (a ValueError) whose one-line message names the
field and says what is wrong; valid values come back in their normal form.
"""

from __future__ import annotations

import os

import pytest

from splitstage.splitter import UserError
from splitstage.storage.urls import (
    InvalidURLError,
    bucket_of,
    local_path,
    normalize_url,
    redact,
    scheme_of,
    scrub,
    validate_bucket_name,
    validate_endpoint_url,
    validate_rdzv_endpoint,
)

FIELD = "cache.url"

# ---- normalize_url ------------------------------------------------------------------------------
VALID_URLS = [
    # object stores: '//' collapse, trailing '/' go, the scheme is lower-cased
    ("s3://bucket/prefix", "s3://bucket/prefix"),
    ("s3://bucket//prefix", "s3://bucket/prefix"),
    ("s3://bucket//prefix//", "s3://bucket/prefix"),
    ("s3://bucket///a//b///c/", "s3://bucket/a/b/c"),
    ("s3://bucket/", "s3://bucket"),
    ("s3://bucket", "s3://bucket"),
    ("S3://bucket/Prefix", "s3://bucket/Prefix"),  # keys keep their case
    ("  s3://bucket/prefix  ", "s3://bucket/prefix"),
    ("s3://my.bucket-01/x", "s3://my.bucket-01/x"),
    ("s3://bucket/my folder/ünïcödé/日本", "s3://bucket/my folder/ünïcödé/日本"),
    ("s3://bucket/a%20b", "s3://bucket/a%20b"),  # no percent-decoding: keys are literal
    ("s3://bucket/...x/x..", "s3://bucket/...x/x.."),  # only whole '.'/'..' segments are refused
    ("s3://bucket/~user", "s3://bucket/~user"),
    ("gs://my_bucket/x//y/", "gs://my_bucket/x/y"),
    ("gcs://my-bucket/x", "gcs://my-bucket/x"),
    ("az://container/x//y", "az://container/x/y"),
    ("abfs://container@account.dfs.core.windows.net/x", None),
    # memory://
    ("memory://", "memory://"),
    ("memory://x/y/", "memory://x/y"),
    ("memory:///x//y", "memory://x/y"),
    # local paths: '//' collapse, '.' and trailing '/' go, '..' and '~' stay, relative stays
    ("runs/cache", "runs/cache"),
    ("runs/cache/", "runs/cache"),
    ("runs//cache", "runs/cache"),
    ("./runs/./cache", "runs/cache"),
    (".", "."),
    ("./", "."),
    ("/", "/"),
    ("//data//cache", "/data/cache"),
    ("/data/cache/", "/data/cache"),
    ("../shared/cache", "../shared/cache"),
    ("/data/../cache", "/data/../cache"),  # a symlinked /data makes '..' mean something
    ("~/cache", "~/cache"),
    ("~alice/cache/", "~alice/cache"),
    ("/data/my cache/ünï", "/data/my cache/ünï"),
    ("C:\\data\\cache", "C:\\data\\cache"),
    # file://
    ("file:///data/cache", "file:///data/cache"),
    ("file:///data//cache/", "file:///data/cache"),
    ("file:////data", "file:///data"),
    ("FILE:///data", "file:///data"),
    ("file://~/cache", "file://~/cache"),
    ("file://relative/dir", "file://relative/dir"),
]


@pytest.mark.parametrize(("url", "expected"), VALID_URLS)
def test_normalize_valid(url, expected):
    got = normalize_url(url, FIELD)
    assert got == (url if expected is None else expected)
    assert normalize_url(got, FIELD) == got  # idempotent


INVALID_URLS = [
    ("", "non-empty"),
    ("   ", "non-empty"),
    (None, "non-empty"),
    (3, "non-empty"),
    ("s3://", "needs a bucket"),
    ("s3:///prefix", "needs a bucket"),
    ("s3:////", "needs a bucket"),
    ("gs://", "needs a bucket"),
    ("az://", "needs a bucket"),
    ("s3://bucket/../x", "'..' segment"),
    ("s3://bucket/a/../../x", "'..' segment"),
    ("s3://bucket/./x", "'.' segment"),
    ("s3://bucket/x/.", "'.' segment"),
    ("s3://bucket/x/..", "'..' segment"),
    ("memory://a/../b", "'..' segment"),
    ("gs://bucket/../x", "'..' segment"),
    ("ftp://host/cache", "unsupported scheme 'ftp://'"),
    ("http://host/cache", "unsupported scheme 'http://'"),
    ("s3a://bucket/x", "unsupported scheme 's3a://'"),
    ("s3:/bucket/x", "did you mean 's3://bucket/x'"),
    ("s3:bucket/x", "did you mean 's3://bucket/x'"),
    ("memory:/x", "did you mean 'memory://x'"),
    ("file:/data", "did you mean 'file://data'"),
    ("file://", "has no path"),
    ("file:///", "has no path"),
    ("s3://bucket/a\nb", "control character"),
    ("runs/ca\tche", "control character"),
    ("s3://key:s3cr3tvalue@bucket/x", "holds credentials"),
    ("s3://host:9000/x", "holds credentials or a port"),
    ("s3://Bucket/x", "uppercase"),
    ("s3://my_bucket/x", "'_'"),
    ("s3://ab/x", "2 characters long"),
    ("s3://10.0.0.1/x", "IP address"),
]


@pytest.mark.parametrize(("url", "needle"), INVALID_URLS)
def test_normalize_invalid(url, needle):
    with pytest.raises(InvalidURLError) as err:
        normalize_url(url, FIELD)
    message = str(err.value)
    assert needle in message
    assert message.startswith(f"{FIELD}: ") and "\n" not in message
    assert isinstance(err.value, ValueError) and isinstance(err.value, UserError)
    assert "s3cr3tvalue" not in message  # credentials in a URL are never echoed


def test_field_is_optional_and_bucket_rules_can_be_skipped():
    with pytest.raises(InvalidURLError) as err:
        normalize_url("s3://", None)
    assert str(err.value).startswith("s3:// URL needs a bucket")
    # buckets named before AWS's current rules (uppercase, '_') still open when asked
    assert normalize_url("s3://Legacy_Bucket//x/", check_bucket=False) == "s3://Legacy_Bucket/x"
    with pytest.raises(InvalidURLError, match="needs a bucket"):
        normalize_url("s3:///x", check_bucket=False)
    with pytest.raises(InvalidURLError, match="'..' segment"):
        normalize_url("s3://Legacy/../x", check_bucket=False)


# ---- bucket names -------------------------------------------------------------------------------
VALID_S3_BUCKETS = [
    "abc",
    "a" * 63,
    "my-bucket",
    "my.bucket.name",
    "bucket-01",
    "0bucket9",
    "123",
    "a-b.c-d",
    "xn-abc",  # only the 'xn--' prefix is reserved
    "1.2.3",  # three numbers: not an IP address
]


@pytest.mark.parametrize("name", VALID_S3_BUCKETS)
def test_valid_s3_bucket(name):
    assert validate_bucket_name(name, "output.url") == name
    assert normalize_url(f"s3://{name}/x", "output.url") == f"s3://{name}/x"


INVALID_S3_BUCKETS = [
    ("ab", "2 characters long", "my-bucket"),
    ("a", "1 character long", "my-bucket"),
    ("a" * 64, "64 characters long", "my-bucket"),
    ("MyBucket", "uppercase", "mybucket"),
    ("my_bucket", "'_'", "my-bucket"),
    ("My_Bucket", "uppercase letters and '_'", "my-bucket"),
    ("my bucket", "' '", "my-bucket"),
    ("bücket", "'ü'", "b-cket"),
    ("-bucket", "start and end", "bucket"),
    ("bucket-", "start and end", "bucket"),
    (".bucket", "start and end", "bucket"),
    ("bucket.", "start and end", "bucket"),
    ("my..bucket", "two dots in a row", "my.bucket"),
    ("my.-bucket", "dot next to a hyphen", "my-bucket"),
    ("my-.bucket", "dot next to a hyphen", "my-bucket"),
    ("192.168.5.4", "IP address", "my-bucket"),
    ("999.1.1.1", "IP address", "my-bucket"),
    ("xn--bucket", "'xn--'", "my-bucket"),
    ("sthree-bucket", "'sthree-'", "my-bucket"),
    ("amzn-s3-demo-bucket", "'amzn-s3-demo-'", "my-bucket"),
    ("bucket-s3alias", "'-s3alias'", "my-bucket"),
    ("bucket--ol-s3", "'--ol-s3'", "my-bucket"),
    ("bucket.mrap", "'.mrap'", "my-bucket"),
    ("bucket--x-s3", "'--x-s3'", "my-bucket"),
    ("bucket--table-s3", "'--table-s3'", "my-bucket"),
]


@pytest.mark.parametrize(("name", "needle", "example"), INVALID_S3_BUCKETS)
def test_invalid_s3_bucket(name, needle, example):
    with pytest.raises(InvalidURLError) as err:
        validate_bucket_name(name, "output.url")
    message = str(err.value)
    assert message.startswith("output.url: bucket name ") and needle in message
    assert f"e.g. s3://{example}/cache" in message and "\n" not in message


@pytest.mark.parametrize(
    ("scheme", "name"),
    [("gs", "goog_Upper"), ("gcs", "ab"), ("az", "Container"), ("abfs", "a--b@acct")],
)
def test_other_stores_names_are_left_to_their_filesystem(scheme, name):
    # gcsfs / adlfs are not dependencies: their naming rules are the store's to report
    assert validate_bucket_name(name, "cache.url", scheme=scheme) == name
    assert normalize_url(f"{scheme}://{name}/x", FIELD) == f"{scheme}://{name}/x"


# ---- endpoint URLs ------------------------------------------------------------------------------
VALID_ENDPOINTS = [
    ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
    ("http://127.0.0.1:9000/", "http://127.0.0.1:9000"),
    ("https://s3.eu-west-1.amazonaws.com", "https://s3.eu-west-1.amazonaws.com"),
    ("HTTPS://minio.local:443", "https://minio.local:443"),
    ("http://localhost", "http://localhost"),
    ("http://minio_1:9000", "http://minio_1:9000"),  # docker-compose service names
    ("http://[::1]:9000", "http://[::1]:9000"),
    ("http://[fd00::2]", "http://[fd00::2]"),
    ("http://host:1", "http://host:1"),
    ("http://host:65535", "http://host:65535"),
    (" http://host:9000 ", "http://host:9000"),
]


@pytest.mark.parametrize(("url", "expected"), VALID_ENDPOINTS)
def test_valid_endpoint(url, expected):
    assert validate_endpoint_url(url, "cache.storage_options.endpoint_url") == expected


INVALID_ENDPOINTS = [
    ("", "non-empty"),
    (None, "non-empty"),
    ("localhost:9000", "no http:// or https:// scheme; e.g. http://localhost:9000"),
    ("127.0.0.1:9000", "e.g. http://127.0.0.1:9000"),
    ("http:/host:9000", "e.g. http://host:9000"),
    ("htp://host:9000", "scheme 'htp://'"),
    ("s3://host:9000", "scheme 's3://'"),
    ("ftp://host", "scheme 'ftp://'"),
    ("http://", "no host"),
    ("http://:9000", "no host"),
    ("http://host:0", "port '0'"),
    ("http://host:65536", "port '65536'"),
    ("http://host:99999", "port '99999'"),
    ("http://host:abc", "port 'abc'"),
    ("http://host:", "port ''"),
    ("http://host:9000/bucket", "has a path"),
    ("http://host:9000//", "has a path"),
    ("http://host:9000/a/b", "has a path"),
    ("http://host:9000?x=1", "query"),
    ("http://host:9000#frag", "fragment"),
    ("http://user:pw-s3cr3t@host:9000", "holds credentials"),
    ("http://ho st:9000", "space"),
    ("http://host\n:9000", "control character"),
    ("http://::1:9000", "IPv6 address in brackets"),
    ("http://[::1:9000", "unclosed"),
    ("http://[xyz]:9000", "not an IPv6 address"),
    ("http://300.1.1.1:9000", "not an IPv4 address"),
    ("http://-bad-.host:9000", "not a valid hostname"),
    ("http://a..b:9000", "not a valid hostname"),
]


@pytest.mark.parametrize(("url", "needle"), INVALID_ENDPOINTS)
def test_invalid_endpoint(url, needle):
    field = "cache.storage_options.endpoint_url"
    with pytest.raises(InvalidURLError) as err:
        validate_endpoint_url(url, field)
    message = str(err.value)
    assert message.startswith(f"{field}: ") and needle in message, message
    assert "e.g. http" in message and "\n" not in message and "s3cr3t" not in message


# ---- rendezvous endpoints -----------------------------------------------------------------------
VALID_RDZV = [
    "127.0.0.1:29500",
    "node0:29500",
    "node0.cluster.local:1",
    "host-1:65535",
    "[::1]:29500",
    "[fd00::1:2]:29400",
    " node0:29500 ",
]


@pytest.mark.parametrize("value", VALID_RDZV)
def test_valid_rdzv(value):
    assert validate_rdzv_endpoint(value) == value.strip()


INVALID_RDZV = [
    ("", "host:port"),
    ("node0", "no port"),
    ("[::1]", "no port"),
    ("node0:", "port ''"),
    ("node0:0", "port '0'"),
    ("node0:65536", "port '65536'"),
    ("node0:http", "port 'http'"),
    (":29500", "no host"),
    ("::1:29500", "IPv6 address in brackets"),
    ("fd00::1", "IPv6 address in brackets"),
    ("[zz]:29500", "not an IPv6 address"),
    ("[::1:29500", "unclosed"),
    ("tcp://node0:29500", "is a URL"),
    ("node0:29500/x", "is a URL"),
    ("node 0:29500", "space"),
    ("-node:29500", "not a valid hostname"),
    ("256.0.0.1:29500", "not an IPv4 address"),
]


@pytest.mark.parametrize(("value", "needle"), INVALID_RDZV)
def test_invalid_rdzv(value, needle):
    with pytest.raises(InvalidURLError) as err:
        validate_rdzv_endpoint(value, "train.rdzv_endpoint")
    message = str(err.value)
    assert message.startswith("train.rdzv_endpoint: ") and needle in message, message
    assert "29500" in message and "\n" not in message  # an example of a valid value


# ---- small helpers ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "scheme", "bucket"),
    [
        ("s3://b/x", "s3", "b"),
        ("S3://b", "s3", "b"),
        ("gs://g/x", "gs", "g"),
        ("memory://m/x", "memory", None),
        ("/data", "file", None),
        ("file:///data", "file", None),
        ("runs/x", "file", None),
    ],
)
def test_scheme_and_bucket_of(url, scheme, bucket):
    assert scheme_of(url) == scheme
    assert bucket_of(url) == bucket


def test_local_path_expands_home_on_this_machine(monkeypatch):
    monkeypatch.setenv("HOME", "/home/tester")
    assert local_path("~/cache") == "/home/tester/cache"
    assert local_path("file://~/cache") == "/home/tester/cache"
    assert local_path("file:///data/x") == "/data/x"
    assert local_path("runs/x") == "runs/x"
    assert local_path("/a/~b") == "/a/~b"  # only a leading ~ means home
    with pytest.raises(InvalidURLError, match="not a local path"):
        local_path("s3://bucket/x")


def test_redact_and_scrub(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret-value")
    options = {"key": "AKIA1", "secret": "opt-secret", "client_kwargs": {"token": "t0k3n"}}
    assert redact(options) == {"key": "***", "secret": "***", "client_kwargs": {"token": "***"}}
    text = scrub("env-secret-value opt-secret t0k3n plain", options)
    assert text == "*** *** *** plain"
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "env-secret-value"
