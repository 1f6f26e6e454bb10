"""Every shipped config, deployment and cluster template validates and agrees with the others."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from splitstage.config.job import SplitstageConfig, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
PREFECT_YAML = ROOT / "deployments" / "prefect.yaml"
K8S = ROOT / "infra" / "k8s"
TEMPLATES = sorted(K8S.glob("*-job-template.json"))
PLACEHOLDER = re.compile(r"\{\{\s*([\w.$]+)\s*\}\}")


def deployments() -> list[dict]:
    """The deployments of deployments/prefect.yaml."""
    return yaml.safe_load(PREFECT_YAML.read_text())["deployments"]


def deployment(name: str) -> dict:
    """One deployment by name."""
    return next(d for d in deployments() if d["name"] == name)


def stack_module():
    """infra/stack.py (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("splitstage_stack", ROOT / "infra" / "stack.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def load_entrypoint(entrypoint: str):
    """The flow object an entrypoint `path.py:function` names."""
    import importlib

    path, name = entrypoint.split(":")
    # flows/x.py is installed as splitstage.flows.x (setuptools package-dir mapping).
    module = importlib.import_module("splitstage." + path.removesuffix(".py").replace("/", "."))
    return getattr(module, name)


# ---- job configs --------------------------------------------------------------------------------


def test_the_expected_configs_ship():
    names = {p.name for p in CONFIGS}
    assert {"demo.toml", "digits-s3.toml", "text-encoder.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    config = load_config(path)
    assert config.job.name
    assert not {"key", "secret", "token"} & set(config.cache.storage_options)


def test_s3_config_keeps_credentials_out():
    config = load_config(ROOT / "configs" / "digits-s3.toml")
    assert config.cache.url.startswith("s3://") and config.cache.storage_options == {}
    assert "AWS_SECRET_ACCESS_KEY" in (ROOT / "configs" / "digits-s3.toml").read_text()


# ---- deployments --------------------------------------------------------------------------------


def test_the_required_deployments_exist():
    names = {
        f"{load_entrypoint(d['entrypoint']).name}/{d['name']}"
        for d in deployments()  # flow name / deployment name, as `prefect deployment run` wants
    }
    assert {"split-training/local", "split-training/nightly", "preprocess/gpu"} <= names
    assert "train/multinode" in names


@pytest.mark.parametrize("dep", deployments(), ids=lambda d: d["name"])
def test_every_deployment_parameter_set_validates(dep):
    params = dep["parameters"]
    config_from_dict(params["config"], f"deployment {dep['name']}: config")
    flow = load_entrypoint(dep["entrypoint"])
    validated = flow.validate_parameters(params)
    assert isinstance(validated["config"], SplitstageConfig)


def test_local_deployment_runs_the_demo_config():
    local = config_from_dict(deployment("local")["parameters"]["config"])
    assert local == load_config(ROOT / "configs" / "demo.toml")


def test_nightly_is_scheduled_and_versioned_with_warm_start():
    from prefect.client.schemas.schedules import CronSchedule

    nightly = deployment("nightly")
    (schedule,) = nightly["schedules"]
    CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])
    params = nightly["parameters"]
    assert params["versioned"] and params["warm_start_from_latest"]
    assert params["fan_out"] == "deployment"


def test_deployments_use_the_stack_pools_and_code_dir():
    stack = stack_module()
    assert {d["work_pool"]["name"] for d in deployments()} <= set(stack.POOLS)
    pull = yaml.safe_load(PREFECT_YAML.read_text())["pull"]
    directory = pull[0]["prefect.deployments.steps.set_working_directory"]["directory"]
    assert directory == "{{ $SPLITSTAGE_CODE_DIR }}"


def test_multinode_job_variables_match_its_config():
    multinode = deployment("multinode")
    config = config_from_dict(multinode["parameters"]["config"])
    variables = multinode["work_pool"]["job_variables"]
    assert variables == {
        "nnodes": config.train.nnodes,
        "gpus_per_node": config.train.nproc_per_node,
    }
    assert config.cache.url.startswith("s3://") and config.output.url.startswith("s3://")


# ---- cluster templates --------------------------------------------------------------------------


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_job_templates_are_valid_kubernetes_work_pool_templates(path):
    template = json.loads(path.read_text())
    job = template["job_configuration"]
    properties = template["variables"]["properties"]
    for key in ("command", "env", "labels", "name", "namespace", "job_manifest", "stream_output"):
        assert key in job, key
    used = set(PLACEHOLDER.findall(json.dumps(job)))
    assert used <= set(properties), f"placeholders without a variable: {used - set(properties)}"
    manifest = job["job_manifest"]
    assert (manifest["apiVersion"], manifest["kind"]) == ("batch/v1", "Job")
    pod = manifest["spec"]["template"]["spec"]
    # What prefect-kubernetes' worker checks before it creates a Job from the manifest:
    assert (pod["parallelism"], pod["completions"], pod["restartPolicy"]) == (1, 1, "Never")
    assert pod["containers"][0]["name"] == "prefect-job"
    env = pod["containers"][0]["env"]
    assert {"name": "SPLITSTAGE_CODE_DIR", "value": "{{ code_dir }}"} in env
    for entry in env:  # a lone placeholder keeps its variable's type; env values must be strings
        if whole := PLACEHOLDER.fullmatch(entry.get("value", "")):
            assert properties[whole[1]]["type"] == "string", entry


def render(template: dict) -> dict:
    """The job configuration with every variable at its default (as a worker renders it)."""
    from prefect.utilities.templating import apply_values

    defaults = {
        name: spec["default"]
        for name, spec in template["variables"]["properties"].items()
        if "default" in spec
    }
    return apply_values(template["job_configuration"], defaults)


def test_multinode_template_is_an_indexed_job_with_one_c10d_rendezvous(monkeypatch):
    from splitstage.flows.multinode import apply_node_env, torchrun_command

    template = json.loads((K8S / "multinode-job-template.json").read_text())
    job = render(template)["job_manifest"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]
    container = pod["spec"]["containers"][0]
    assert container["args"] == ["python", "-m", "splitstage.flows.node_agent"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"]: e for e in container["env"]}
    assert env["SPLITSTAGE_JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['job-name']")
    endpoint = env["SPLITSTAGE_RDZV_ENDPOINT"]["value"]
    assert endpoint == "$(SPLITSTAGE_JOB_NAME)-0.splitstage-rdzv:29500"

    service = yaml.safe_load((K8S / "rendezvous-service.yaml").read_text())
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"]

    # What pod 1 of job "train-abc" runs, once Kubernetes has expanded $(SPLITSTAGE_JOB_NAME):
    config = config_from_dict(deployment("multinode")["parameters"]["config"])
    pod_env = {
        "JOB_COMPLETION_INDEX": "1",
        "SPLITSTAGE_RDZV_ENDPOINT": endpoint.replace("$(SPLITSTAGE_JOB_NAME)", "train-abc"),
    }
    config, rank = apply_node_env(config, pod_env)
    command = torchrun_command(config, rank)
    assert "--rdzv-backend=c10d" in command and "--standalone" not in command
    assert "--rdzv-endpoint=train-abc-0.splitstage-rdzv:29500" in command
    assert {"--nnodes=2", "--nproc-per-node=8"} <= set(command)
    assert command[-3:-1] == ["-m", "splitstage.tasks.stage2.worker"]


def test_node_agents_use_the_flow_runs_version():
    from splitstage.flows.node_agent import node_job

    class FlowRun:
        id = "0f0e0d0c-0000-0000-0000-000000000000"
        created = None
        parameters = {
            "config": deployment("multinode")["parameters"]["config"],
            "version": "20260101T020000Z-0f0e0d0c",
        }

    config, run_id = node_job(FlowRun())
    assert run_id == f"{config.job.name}/20260101T020000Z-0f0e0d0c"


def test_gpu_template_asks_for_one_gpu_per_shard():
    template = json.loads((K8S / "gpu-preprocess-job-template.json").read_text())
    container = render(template)["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "args" not in container  # no command given: the worker fills in its own
