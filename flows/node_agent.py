"""One pod of a multi-node training Job: pod 0 runs the flow, the others join its torchrun job.

Every pod of the indexed Job made from infra/k8s/multinode-job-template.json runs

    python -m splitstage.flows.node_agent

Pod 0 (JOB_COMPLETION_INDEX=0) executes the Prefect flow run (`prefect flow-run execute`), whose
`train` flow starts torchrun as node 0. Every other pod reads the same flow run's parameters from
the API (PREFECT__FLOW_RUN_ID, set by the worker) and starts torchrun as node i with the same run
id, so all agents meet at one c10d rendezvous (SPLITSTAGE_RDZV_ENDPOINT, pod 0 behind a headless
service).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from splitstage.config.job import ConfigError, SplitstageConfig
from splitstage.flows.multinode import apply_node_env, node_rank_from
from splitstage.flows.versioned_outputs import run_id_for, version_for, warm_start
from splitstage.tasks.launch.launcher import train

FLOW_RUN_ENV = "PREFECT__FLOW_RUN_ID"


def read_flow_run(flow_run_id: str) -> Any:
    """The flow run this Job executes (its parameters hold the job config)."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def node_job(flow_run: Any) -> tuple[SplitstageConfig, str]:
    """The config and run id node 0's train flow uses (same version, same warm start)."""
    params = flow_run.parameters
    config = SplitstageConfig.model_validate(params["config"])
    version = params.get("version") or (
        version_for(flow_run) if params.get("versioned", True) else None
    )
    if params.get("warm_start_from_latest"):
        config, _ = warm_start(config)
    return config, run_id_for(config, version)


def main() -> int:
    """Run this pod's part: the flow on pod 0, a torchrun agent on the others."""
    rank = node_rank_from(os.environ)
    if rank == 0:
        command = [sys.executable, "-m", "prefect", "flow-run", "execute"]
        os.execvp(command[0], command)
    flow_run_id = os.environ.get(FLOW_RUN_ENV)
    if not flow_run_id:
        raise ConfigError(f"{FLOW_RUN_ENV} is not set: run this in a pod started by a worker")
    config, run_id = node_job(read_flow_run(flow_run_id))
    config, rank = apply_node_env(config)
    train(config, run_id=run_id, node_rank=rank, on_line=print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
