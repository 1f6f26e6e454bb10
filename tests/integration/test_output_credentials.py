"""Outputs and checkpoints on the cache's object store take the cache's Prefect credentials block
(real S3 endpoint: moto on loopback with credential checks; a real Prefect test server): the
launcher's write probe, a checkpoint saved, found and loaded through the options the run spec
hands the ranks, and an export file; no secret in the spec, a repr, a log line or a message."""

from __future__ import annotations

import json

import pytest
import torch

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.tasks.stage2.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_extra_state,
    save_checkpoint,
)
from splitstage.tasks.stage2.outputs import (
    check_outputs,
    open_output,
    output_storage_options,
    probe_writable,
    run_places,
)
from splitstage.tasks.stage2.run_spec import RunSpec
from tests.helpers.data_s3_job import data_s3_config

pytestmark = pytest.mark.slow
BLOCK = "aws-credentials/splitstage-outputs"


@pytest.fixture
def block_job(s3_auth, s3_endpoint, demo_weights, tmp_path, monkeypatch, prefect_harness):
    """A job whose cache and outputs are in the bucket, credentials in a saved block only: the
    environment holds a user without any permission. Yields (config dict, writer's options)."""
    import s3fs
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    from splitstage.storage.credentials import forget_blocks

    url, opts = s3_auth
    writer, nobody = opts("writer"), opts("nobody")
    AwsCredentials(
        aws_access_key_id=writer["key"],
        aws_secret_access_key=writer["secret"],
        aws_client_parameters=AwsClientParameters(endpoint_url=s3_endpoint),
    ).save(BLOCK.split("/")[1], overwrite=True)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", nobody["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", nobody["secret"])
    forget_blocks()
    s3fs.S3FileSystem.clear_instance_cache()
    config = data_s3_config(tmp_path, demo_weights, url, None, credentials_block=BLOCK)
    config["cache"]["credentials_block"] = BLOCK
    config["output"] = {"url": f"{url}/output"}
    monkeypatch.chdir(tmp_path)
    yield config, writer
    forget_blocks()
    s3fs.S3FileSystem.clear_instance_cache()


def test_checkpoints_and_outputs_use_the_cache_block(block_job, tmp_path, caplog):
    import s3fs

    raw, writer = block_job
    config = config_from_dict(raw)
    caplog.set_level("DEBUG")
    places = run_places(config, "run1", tmp_path / "runs")
    check_outputs(places)  # the launcher's write probes, before it holds the run
    written = RunSpec(config=config, run_id="run1", places=places).write(
        tmp_path / "run1/spec.json"
    )
    spec = json.loads(written.read_text())["places"]
    options = spec["checkpoint_storage_options"]  # what every rank reads from the spec
    assert options["credentials_block"]["name"] == BLOCK
    torch.manual_seed(0)
    model, fresh = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    url = spec["checkpoint_url"]
    save_checkpoint(url, 2, model, [optimizer], {"update": 2}, storage_options=options)
    assert latest_checkpoint(url, storage_options=options) == 2
    assert read_extra_state(url, 2, storage_options=options)["update"] == 2
    load_checkpoint(url, 2, fresh, None, storage_options=options, restore_rng=False)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)

    fs, root = open_output(config, spec["output_url"])  # how the export writes its files
    fs.pipe_file(f"{root}/weights.safetensors", b"weights")
    check = s3fs.S3FileSystem(**writer)  # an independent client: the objects are there
    assert check.cat_file(f"{root}/weights.safetensors") == b"weights"
    assert check.ls(f"{root}/checkpoints/step-00000002")

    shown = [(tmp_path / "run1" / "spec.json").read_text(), repr(options), caplog.text]
    shown += [repr(config), config.model_dump_json()]
    assert not [s for s in shown if writer["secret"] in s]


def test_without_the_block_the_probe_refuses_and_names_the_field(block_job, s3_endpoint, tmp_path):
    raw, writer = block_job
    raw["cache"]["credentials_block"] = None  # the environment's user may not write
    raw["cache"]["storage_options"] = {"endpoint_url": s3_endpoint}  # the block gave it before
    config = config_from_dict(raw)
    url = run_places(config, "run1", tmp_path / "runs").output_url
    assert output_storage_options(config, url) == {"endpoint_url": s3_endpoint}
    with pytest.raises(ConfigError) as error:
        probe_writable(url, "output.url", output_storage_options(config, url))
    message = str(error.value)
    assert message.startswith("output.url: ") and "\n" not in message, message
    assert "permission" in message  # refused for its credentials, the endpoint answered
    assert writer["secret"] not in message
