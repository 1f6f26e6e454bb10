"""Multi-node settings from the environment: the cluster, not the job config, knows the node rank.

On Kubernetes (infra/k8s/multinode-job-template.json) every pod of an indexed Job runs one torchrun
agent: `SPLITSTAGE_NODE_RANK` is the pod's completion index, `SPLITSTAGE_NNODES` the Job's size and
`SPLITSTAGE_RDZV_ENDPOINT` pod 0's stable name behind a headless service. All agents meet at one
c10d rendezvous there. Unset variables leave the config as it is (one node).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from splitstage.config.job import ConfigError, SplitstageConfig
from splitstage.process.torchrun import build_command
from splitstage.tasks.launch.launcher import torchrun_spec

ENV_NNODES = "SPLITSTAGE_NNODES"
ENV_NPROC_PER_NODE = "SPLITSTAGE_NPROC_PER_NODE"
ENV_NODE_RANK = "SPLITSTAGE_NODE_RANK"
ENV_RDZV_ENDPOINT = "SPLITSTAGE_RDZV_ENDPOINT"
ENV_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"  # set by Kubernetes in indexed Jobs


def _int(environ: Mapping[str, str], name: str) -> int | None:
    """An integer environment variable, or None when unset or empty."""
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment {name}={value!r}: expected an integer") from None


def node_rank_from(environ: Mapping[str, str] = os.environ) -> int:
    """This node's rank: SPLITSTAGE_NODE_RANK, else the indexed Job's completion index, else 0."""
    rank = _int(environ, ENV_NODE_RANK)
    if rank is None:
        rank = _int(environ, ENV_COMPLETION_INDEX)
    return rank or 0


def apply_node_env(
    config: SplitstageConfig, environ: Mapping[str, str] = os.environ
) -> tuple[SplitstageConfig, int]:
    """The config with train.nnodes / nproc_per_node / rdzv_endpoint from the env, and the rank."""
    updates = {}
    if (nnodes := _int(environ, ENV_NNODES)) is not None:
        updates["nnodes"] = nnodes
    if (nproc := _int(environ, ENV_NPROC_PER_NODE)) is not None:
        updates["nproc_per_node"] = nproc
    if endpoint := environ.get(ENV_RDZV_ENDPOINT, "").strip():
        updates["rdzv_endpoint"] = endpoint
    rank = node_rank_from(environ)
    if not updates:
        return config, rank
    data = config.model_dump()
    data["train"].update(updates)
    config = SplitstageConfig.model_validate(data)
    if not 0 <= rank < config.train.nnodes:
        raise ConfigError(
            f"node rank {rank} (from {ENV_NODE_RANK} or {ENV_COMPLETION_INDEX}) is outside "
            f"0..{config.train.nnodes - 1}; set {ENV_NNODES} to the number of pods"
        )
    return config, rank


def torchrun_command(
    config: SplitstageConfig, node_rank: int, spec: str = "runs/train/RUN/spec.json"
) -> list[str]:
    """The torchrun command line this node runs (what `tasks.launch.launcher` launches)."""
    return build_command(torchrun_spec(config, Path(spec), node_rank))
