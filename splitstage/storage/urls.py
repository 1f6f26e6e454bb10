"""Storage URLs, S3 bucket names, endpoint URLs and rendezvous endpoints: checked and normalised.

Pure functions (no torch, no prefect, no I/O), called by the config validators and, defensively,
by `storage.files.open_fs`. Each raises `InvalidURLError` (a `ValueError`) with one line that
names the field, what is wrong and an example of a valid value; each returns the normalised value.
Also `redact` / `scrub`: credentials kept out of reprs and messages.

Normal form of a storage URL (`normalize_url`):
- scheme lower-cased; surrounding whitespace removed; inner spaces and unicode kept as written
  (object keys are bytes: `%20` stays `%20`, composed/decomposed unicode are not unified);
- object stores (`s3://`, `gs://`, `gcs://`, `az://`, `abfs://`): a bucket is required, repeated
  slashes in the key collapse (`s3://b//p` -> `s3://b/p`: the same objects every lister finds),
  trailing slashes go, `.` and `..` segments are refused (object stores do not resolve them);
- local paths and `file://`: repeated slashes collapse, `.` segments and trailing slashes go; `..`
  is kept (it means something on a disk); relative paths stay relative;
- `~` is kept as written, not expanded: the config stays valid on every machine it travels to
  (Prefect workers, other nodes); the machine doing the I/O expands it (`local_path`, `open_fs`).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from typing import Any

from splitstage.splitter import UserError

OBJECT_STORE_SCHEMES = frozenset({"s3", "gs", "gcs", "az", "abfs"})
# the fsspec filesystem package each object store needs (only s3fs is a dependency)
FILESYSTEM_PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
SCHEMES = frozenset({"file", "memory", *OBJECT_STORE_SCHEMES})
_SCHEME_HINT = "use a local path, file://, s3://, memory://, gs:// or az://"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEME_TYPO = re.compile(r"^(s3|gs|gcs|az|abfs|memory|file):/?(?!/)", re.IGNORECASE)
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")
_S3_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_S3_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
_EXAMPLE_URL = "s3://my-bucket/cache"
_EXAMPLE_ENDPOINT = "http://127.0.0.1:9000"
_EXAMPLE_RDZV = "node0.cluster.local:29500 (IPv6: [fd00::1]:29500)"


MASK = "***"
SECRET_NAMES = {
    "key",
    "secret",
    "token",
    "password",
    "passwd",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "access_key",
    "secret_key",
    "session_token",
    "credentials",
}
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


class InvalidURLError(UserError, ValueError):
    """A storage URL, bucket name or endpoint that cannot be used; the message names the field."""


def _fail(field: str | None, message: str) -> InvalidURLError:
    return InvalidURLError(f"{field}: {message}" if field else message)


def scheme_of(url: str) -> str:
    """The URL's scheme, lower-cased; 'file' for a plain local path."""
    match = _SCHEME.match(url.strip())
    return match.group(1).lower() if match else "file"


def _collapse(path: str) -> str:
    return re.sub(r"/{2,}", "/", path)


def _check_text(url: object, field: str | None) -> str:
    if not isinstance(url, str) or not url.strip():
        raise _fail(field, f"storage URL must be a non-empty string, got {url!r}; e.g. runs/cache")
    if _CONTROL.search(url):
        raise _fail(field, f"{url!r} contains a control character (newline, tab, ...); remove it")
    return url.strip()


def normalize_url(url: str, field: str | None = "url", *, check_bucket: bool = True) -> str:
    """Return the normal form of a storage URL or local path (see the module docstring).

    `check_bucket`: also apply S3's bucket-naming rules (`validate_bucket_name`; other stores'
    names are left to their filesystem); off, only an empty bucket is refused (for buckets named
    before AWS's current rules).
    """
    url = _check_text(url, field)
    scheme = scheme_of(url)
    rest = url[len(scheme) + 3 :] if _SCHEME.match(url) else url
    if scheme not in SCHEMES:
        raise _fail(field, f"unsupported scheme '{scheme}://' in {url!r}; {_SCHEME_HINT}")
    if scheme == "file":
        typo = _SCHEME_TYPO.match(url)
        if typo and not _SCHEME.match(url):
            fixed = f"{typo.group(1).lower()}://{url[typo.end() :]}"
            raise _fail(field, f"{url!r} lacks a '/' after the scheme; did you mean {fixed!r}?")
        if _SCHEME.match(url) and not rest.strip("/"):
            raise _fail(field, f"{url!r} has no path; e.g. file:///data/cache or runs/cache")
        path = _local(rest)
        return f"file://{path}" if _SCHEME.match(url) else path
    if scheme in OBJECT_STORE_SCHEMES and (not rest.strip("/") or rest.startswith("/")):
        raise _fail(
            field, f"{scheme}:// URL needs a bucket, e.g. {scheme}://my-bucket/cache (got {url!r})"
        )
    parts = [p for p in _collapse(rest).strip("/").split("/") if p != ""]
    bad = [p for p in parts if p in (".", "..")]
    if bad:
        raise _fail(
            field,
            f"{url!r} has a '{bad[0]}' segment; object stores do not resolve '.' or '..', so "
            f"the objects would land where no listing finds them: write the key without them, "
            f"e.g. {scheme}://{'cache/run1' if scheme == 'memory' else 'my-bucket/cache'}",
        )
    if scheme == "memory":
        return "memory://" + "/".join(parts)
    bucket = parts[0]
    if scheme in ("s3", "gs", "gcs") and ("@" in bucket or ":" in bucket):
        raise _fail(
            field,
            f"the {scheme}:// URL holds credentials or a port before the bucket (user:secret@ or "
            "host:port); remove them: credentials go in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
            f"and the endpoint in storage_options.endpoint_url; e.g. {_EXAMPLE_URL}",
        )
    if check_bucket:
        validate_bucket_name(bucket, field, scheme=scheme)
    return f"{scheme}://" + "/".join(parts)


def _local(path: str) -> str:
    """Normal form of a local path: '//' collapsed, '.' segments and trailing '/' dropped."""
    if re.match(r"^[A-Za-z]:[\\/]", path):  # a Windows drive path: leave it alone
        return path
    absolute = path.startswith("/")
    parts = [p for p in _collapse(path).split("/") if p not in ("", ".")]
    joined = "/".join(parts)
    if absolute:
        return "/" + joined
    return joined or "."


def local_path(url: str) -> str:
    """The OS path of a local path or `file://` URL, with `~` expanded on this machine."""
    url = url.strip()
    if scheme_of(url) != "file":
        raise _fail(None, f"{url!r} is not a local path or file:// URL")
    path = url[len("file://") :] if _SCHEME.match(url) else url
    return os.path.expanduser(path)


def bucket_of(url: str) -> str | None:
    """The bucket (container) of an object-store URL; None for local and memory:// URLs."""
    url = url.strip()
    scheme = scheme_of(url)
    if scheme not in OBJECT_STORE_SCHEMES:
        return None
    return url[len(scheme) + 3 :].lstrip("/").split("/", 1)[0]


def _ip_like(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return bool(re.fullmatch(r"\d+(\.\d+){3}", name))
    return True


def _s3_bucket_problem(name: str) -> str | None:
    if not 3 <= len(name) <= 63:
        return f"is {len(name)} character{'s' if len(name) != 1 else ''} long (3-63 allowed)"
    found = ["uppercase letters"] if any(c.isupper() for c in name) else []
    bad = sorted({c for c in name if not c.isupper() and not re.match(r"[a-z0-9.-]", c)})
    found += [", ".join(repr(c) for c in bad)] if bad else []
    if found:
        return f"has {' and '.join(found)} (allowed: lowercase letters, digits, '.', '-')"
    if not (name[0].isalnum() and name[-1].isalnum()):
        return "must start and end with a lowercase letter or a digit"
    if ".." in name:
        return "has two dots in a row"
    if ".-" in name or "-." in name:
        return "has a dot next to a hyphen"
    if _ip_like(name):
        return "looks like an IP address"
    for prefix in _S3_PREFIXES:
        if name.startswith(prefix):
            return f"starts with '{prefix}', which AWS reserves"
    for suffix in _S3_SUFFIXES:
        if name.endswith(suffix):
            return f"ends with '{suffix}', which AWS reserves"
    return None


def _suggest(name: str, problem) -> str:
    guess = re.sub(r"[^a-z0-9.-]+", "-", name.lower()).strip(".-")
    guess = re.sub(r"\.{2,}", ".", guess)
    return guess if guess and guess != name and problem(guess) is None else "my-bucket"


def validate_bucket_name(name: str, field: str | None = "bucket", *, scheme: str = "s3") -> str:
    """Check an S3 bucket name by AWS's naming rules; returns it unchanged.

    s3: AWS general-purpose bucket rules (3-63 characters; lowercase letters, digits, dots and
    hyphens; starts and ends with a letter or digit; no '..', no dot next to a hyphen; not an IP
    address; not the reserved prefixes xn--, sthree-, amzn-s3-demo- or suffixes -s3alias, --ol-s3,
    .mrap, --x-s3, --table-s3). Other stores (gs/gcs, az/abfs) are not checked here: their
    filesystem (gcsfs, adlfs) and the store report a bad name.
    """
    if scheme != "s3":
        return name
    found = _s3_bucket_problem(name)
    if found:
        raise _fail(
            field,
            f"bucket name {name!r} {found}; S3 bucket names are 3-63 lowercase letters, digits, "
            "'.' and '-', starting and ending with a letter or digit; "
            f"e.g. {scheme}://{_suggest(name, _s3_bucket_problem)}/cache",
        )
    return name


def _host_problem(host: str) -> str | None:
    """Why `host` is not a hostname, IPv4 address or bracketed IPv6 address; None if it is."""
    if not host:
        return "has no host"
    if host.startswith("["):
        if not host.endswith("]"):
            return f"has an unclosed '[' in host {host!r}"
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"has {host!r}, which is not an IPv6 address"
        return None
    if ":" in host:
        return f"has host {host!r} with ':' (write an IPv6 address in brackets: [::1])"
    if re.fullmatch(r"[\d.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"has {host!r}, which is not an IPv4 address"
        return None
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        return f"has host {host!r}, which is not a valid hostname"
    return None


def _split_host_port(netloc: str) -> tuple[str, str | None]:
    if netloc.startswith("["):
        end = netloc.find("]")
        if end < 0:
            return netloc, None
        rest = netloc[end + 1 :]
        return netloc[: end + 1], rest[1:] if rest.startswith(":") else (rest or None)
    if netloc.count(":") == 1:
        host, port = netloc.split(":")
        return host, port
    return netloc, None


def _port_problem(port: str | None, required: bool) -> str | None:
    if port is None:
        return "has no port" if required else None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"has port {port!r} (must be a number 1-65535)"
    return None


def validate_endpoint_url(url: str, field: str | None = "storage_options.endpoint_url") -> str:
    """Check an S3-compatible endpoint: `http(s)://host[:port][/]`; returns it without the '/'."""
    if not isinstance(url, str) or not url.strip():
        raise _fail(field, f"endpoint URL must be a non-empty string; e.g. {_EXAMPLE_ENDPOINT}")
    url = url.strip()
    if _CONTROL.search(url) or " " in url:
        raise _fail(
            field, f"{url!r} contains a space or control character; e.g. {_EXAMPLE_ENDPOINT}"
        )
    match = _SCHEME.match(url)
    if not match:
        fix = f"http://{url.split(':/', 1)[-1].lstrip('/')}" if url else _EXAMPLE_ENDPOINT
        raise _fail(field, f"{url!r} has no http:// or https:// scheme; e.g. {fix}")
    scheme = match.group(1).lower()
    if scheme not in ("http", "https"):
        raise _fail(
            field,
            f"{url!r} has scheme '{scheme}://'; use http:// or https://, e.g. {_EXAMPLE_ENDPOINT}",
        )
    rest = url[match.end() :]
    netloc, _, path = rest.partition("/")
    netloc, hashed, _ = netloc.partition("#")
    netloc, queried, _ = netloc.partition("?")
    if "@" in netloc:
        raise _fail(
            field,
            "the endpoint URL holds credentials (user:secret@); remove them and set "
            f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; e.g. {_EXAMPLE_ENDPOINT}",
        )
    if path or queried or hashed:
        raise _fail(
            field,
            f"{url!r} has a path, query or fragment; the endpoint is only scheme://host[:port] "
            f"(the bucket goes in the storage URL, s3://bucket/prefix); e.g. {_EXAMPLE_ENDPOINT}",
        )
    host, port = _split_host_port(netloc)
    problem = _host_problem(host) or _port_problem(port, required=False)
    if problem:
        raise _fail(field, f"{url!r} {problem}; e.g. {_EXAMPLE_ENDPOINT}")
    return f"{scheme}://{netloc}"


def validate_rdzv_endpoint(value: str, field: str | None = "train.rdzv_endpoint") -> str:
    """Check a torchrun c10d rendezvous endpoint `host:port` (IPv6 as `[addr]:port`)."""
    if not isinstance(value, str) or not value.strip():
        raise _fail(field, f"rendezvous endpoint must be 'host:port'; e.g. {_EXAMPLE_RDZV}")
    value = value.strip()
    if _CONTROL.search(value) or " " in value:
        raise _fail(field, f"{value!r} contains a space or control character; e.g. {_EXAMPLE_RDZV}")
    if "://" in value or "/" in value:
        raise _fail(field, f"{value!r} is a URL; give only host:port, e.g. {_EXAMPLE_RDZV}")
    if not value.startswith("[") and value.count(":") > 1:
        raise _fail(
            field,
            f"{value!r}: write an IPv6 address in brackets with its port, e.g. [fd00::1]:29500",
        )
    host, port = _split_host_port(value)
    problem = _host_problem(host) or _port_problem(port, required=True)
    if problem:
        raise _fail(field, f"{value!r} {problem}; e.g. {_EXAMPLE_RDZV}")
    return value


# ---- credentials never shown: in reprs (redact) and in messages (scrub)
def redact(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return a copy of `options` with credentials masked, safe to log or show in a repr."""
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if str(name).lower() in SECRET_NAMES and value is not None:
            out[name] = MASK
        elif isinstance(value, Mapping):
            out[name] = redact(value)
        else:
            out[name] = value
    return out


def scrub(text: str, options: Mapping[str, Any] | None = None) -> str:
    """Remove any credential value (from options or the AWS env vars) from `text`."""
    secrets = [os.environ.get(name) for name in SECRET_ENV]
    stack = [options or {}]
    while stack:
        for name, value in stack.pop().items():
            if isinstance(value, Mapping):
                stack.append(value)
            elif str(name).lower() in SECRET_NAMES and isinstance(value, str):
                secrets.append(value)
    for secret in sorted({s for s in secrets if s and len(s) >= 3}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text
