"""`train.max_grad_norm` under every parallelism (real torchrun, gloo, CPU): the recorded
`grad_norm` is the global pre-clip norm of the one-process run, and the clipped update is the same.

The same job (the demo DiT, fixed seed, the same 4 samples per update, a max_grad_norm well below
the gradient's norm, 2 updates) runs on 1 rank and on 2 ranks as fsdp (2 replicas of 2 samples;
every gradient a DTensor shard), tp (1 replica of 4; column/row shards beside replicated
tensors) and pp (2 stages of 4 in 2 microbatches; each stage's norm summed over the stages).
Run: .venv/bin/pytest -m slow tests/integration/test_clipping_parallel.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage2.run_records import read_metrics
from tests.helpers.tiny_job import make_workspace, tiny_config

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
SEED = 11
MAX_NORM = 1e-3  # under the demo's gradient norms (~2.7 full, ~0.02 LoRA; asserted): all clip
# Every layout sees the same global batch of 4 per update (the draws are per sample).
LAYOUTS = {
    "fsdp": {"nproc_per_node": 2, "parallelism": "fsdp", "batch_size": 2},
    "tp": {"nproc_per_node": 2, "parallelism": "tp", "tp_degree": 2},
    "pp": {"nproc_per_node": 2, "parallelism": "pp", "pp_microbatches": 2},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """8 digits (2 updates of 4), demo weights and a filled cache, shared by the module."""
    return make_workspace(tmp_path_factory.mktemp("clipping"), samples=8, seed=SEED)


def run(root: Path, name: str, trainable: str, **fields):
    """Train 2 updates of the job on a layout; return the report, its records and weights.

    AdamW's eps well above |g| keeps its first updates ~ lr * g / eps, linear in the (clipped)
    gradient: clipping shows in the weights (with eps=1e-8 Adam would divide the scale out)."""
    fields = {"max_steps": 2, "learning_rate": 1e-2, "optimizer_args": {"eps": 1e-2}} | fields
    config = tiny_config(root, f"{trainable}-{name}", SEED, **fields)
    if trainable == "full":
        config.trainable.lora_base_model = None
        config.trainable.full = ["dit"]
    report = train(config, run_root=root / "runs", env=ENV, on_line=lambda line: None)
    return report, read_metrics(Path(report.run_dir)), load_file(report.outputs["dit"])


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The L2 norm of a - b over every tensor."""
    assert a.keys() == b.keys()
    return float(torch.stack([(a[k].double() - b[k].double()).norm() for k in a]).norm())


@pytest.mark.parametrize("trainable", ["full", "lora"])
def test_grad_norm_and_clipping_agree_across_parallelisms(workspace, trainable):
    one, one_records, one_weights = run(workspace, "one", trainable, max_grad_norm=MAX_NORM)
    free, free_records, free_weights = run(workspace, "free", trainable)
    norms = [r["grad_norm"] for r in one_records]
    assert one.updates == 2 and len(norms) == 2

    # clipping happened: the pre-clip norm is above the bound, the first gradient (before any
    # update) is the unclipped run's, and the clipped run moved the weights less
    assert all(n > 10 * MAX_NORM for n in norms), norms
    assert free_records[0]["grad_norm"] == pytest.approx(norms[0], rel=1e-6)
    assert one.losses[0] == pytest.approx(free.losses[0], rel=1e-6)
    if trainable == "full":
        initial = load_file(str(workspace / "weights/dit.safetensors"))
        initial = {k: initial[k] for k in one_weights}
        moved, moved_free = distance(one_weights, initial), distance(free_weights, initial)
        assert 0 < moved < 0.5 * moved_free, (moved, moved_free)
    else:  # LoRA's trained weights start from a seeded draw, not the file
        assert distance(one_weights, free_weights) > 0
    reference_move = max(distance(one_weights, free_weights), 1e-12)

    for name, layout in LAYOUTS.items():
        report, records, weights = run(workspace, name, trainable, max_grad_norm=MAX_NORM, **layout)
        assert report.world_size == 2 and report.updates == 2, name
        got = [r["grad_norm"] for r in records]
        # fp32 gradients of the same 4 samples reduced in another order (per shard, per stage,
        # over replicas): a few ulps of each term, far below 1e-4 of the norm
        assert got == pytest.approx(norms, rel=1e-4), (name, got, norms)
        assert report.losses == pytest.approx(one.losses, rel=1e-5), name
        # the weights after 2 clipped updates: float noise of the gradient (<= 1e-4 relative)
        # passes into each update ~ lr * g / eps, so the layouts differ by far less than 1e-3 of
        # how far clipping moved the weights away from the unclipped run
        gap = distance(weights, one_weights)
        assert gap <= 1e-3 * reference_move, (name, gap, reference_move)
