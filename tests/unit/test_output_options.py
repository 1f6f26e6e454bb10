"""Options of outputs and checkpoints: the cache's endpoint options, the cache's credentials block
named (never its secrets) on the cache's object store, resolved when the URL is opened."""

from __future__ import annotations

import json

import pytest

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.storage import credentials
from splitstage.storage.options import name_block, open_url, resolve_credentials
from splitstage.tasks.stage2.outputs import output_storage_options

BLOCK = "aws-credentials/out-creds"
SECRET = "s3cr3t-from-the-block"


@pytest.fixture
def loader():
    """A credentials loader standing in for the Prefect one; counts the reads."""
    reads = []

    def load(name: str, *, field: str) -> dict:
        reads.append((name, field))
        return {"key": "block-key", "secret": SECRET, "client_kwargs": {"region_name": "r1"}}

    credentials.register_loader(load)
    credentials.forget_blocks()
    yield reads
    credentials._loaders.remove(load)
    credentials.forget_blocks()


def job(output: str, cache: str = "s3://bucket/cache", block: str | None = BLOCK):
    options = {"endpoint_url": "http://127.0.0.1:9000"}
    cache_group = {"url": cache, "storage_options": options, "credentials_block": block}
    return config_from_dict({"cache": cache_group, "output": {"url": output}})


def test_outputs_on_the_cache_store_name_its_block_and_nothing_secret():
    options = output_storage_options(job("s3://other-bucket/out"), "s3://other-bucket/out/run")
    assert options == {
        "endpoint_url": "http://127.0.0.1:9000",
        "credentials_block": {"name": BLOCK, "field": "cache.credentials_block"},
    }
    json.dumps(options)  # it goes into the run spec as it is
    assert output_storage_options(job("runs/out"), "runs/out/run") is None
    assert output_storage_options(job("gs://gbucket/out"), "gs://gbucket/out/run") == {
        "endpoint_url": "http://127.0.0.1:9000"  # another store: the environment's credentials
    }
    assert output_storage_options(job("s3://bkt/o", block=None), "s3://bkt/o/r") == {
        "endpoint_url": "http://127.0.0.1:9000"
    }


def test_a_named_block_is_resolved_once_per_process_where_the_url_opens(loader):
    options = output_storage_options(job("s3://bucket/out"), "s3://bucket/out/run")
    resolved = resolve_credentials("s3://bucket/out/run", options)
    assert resolved == {
        "endpoint_url": "http://127.0.0.1:9000",
        "key": "block-key",
        "secret": SECRET,
        "client_kwargs": {"region_name": "r1"},
    }
    assert "credentials_block" in options and SECRET not in json.dumps(options)  # not mutated
    fs, root = open_url("s3://bucket/out/run", options)
    assert (fs.key, fs.secret, root) == ("block-key", SECRET, "bucket/out/run")
    assert fs.client_kwargs["endpoint_url"] == "http://127.0.0.1:9000"
    assert loader == [(BLOCK, "cache.credentials_block")]  # read once, named by its field
    local = name_block({}, BLOCK, field="cache.credentials_block")
    assert resolve_credentials("/tmp/x", local) == {}  # local paths take no credentials


def test_storage_options_in_the_config_may_not_name_a_block():
    with pytest.raises(ConfigError, match=r"cache.storage_options: holds credentials_block"):
        config_from_dict({"cache": {"storage_options": {"credentials_block": {"name": BLOCK}}}})
