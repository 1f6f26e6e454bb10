"""Train a real stage-2 run spec with the Trainer, counting each micro-batch's gradient
collectives (torch's profiler sees gloo's as `gloo:all_reduce`, `gloo:reduce_scatter`, also
those DDP's reducer and FSDP2 issue from C++).

Run: torchrun --nproc-per-node=2 tests/integration/workers/sync_worker.py RUN_DIR/spec.json OUT
Writes OUT/result-rank{r}.json: {"micro": [{collective: count}, ...] (one entry per micro-batch,
in order), "groups": the FSDP2 parameter groups holding trained parameters (each reduces its
gradients in one collective), "losses": [...], "outputs": {...}}.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.profiler import ProfilerActivity, profile

from splitstage.process.leaving import leave
from splitstage.tasks.stage2.distributed import close_distributed
from splitstage.tasks.stage2.rank_setup import set_up_rank
from splitstage.tasks.stage2.run_spec import RunSpec
from splitstage.tasks.stage2.trainer import Trainer

REDUCTIONS = ("all_reduce", "reduce_scatter")  # what reduces gradients (not all_gather, ...)


def fsdp_groups(model: nn.Module) -> int:
    """FSDP2 modules whose own parameters (not a nested FSDP module's) include trained ones."""

    def own(module: nn.Module):
        yield from module.parameters(recurse=False)
        for child in module.children():
            if not isinstance(child, FSDPModule):
                yield from own(child)

    return sum(
        isinstance(module, FSDPModule) and any(param.requires_grad for param in own(module))
        for module in model.modules()
    )


def main() -> None:
    """Set up the rank from the spec, train with every micro-step profiled, write the counts."""
    spec = RunSpec.read(sys.argv[1])
    out = Path(sys.argv[2])
    setup = set_up_rank(spec)
    trainer = Trainer(setup)
    micro: list[dict[str, int]] = []
    step = trainer.micro_step

    def counted(*args, **kwargs):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = step(*args, **kwargs)
        names = (event.name[5:] for event in prof.events() if event.name.startswith("gloo:"))
        micro.append(dict(collections.Counter(n for n in names if n.startswith(REDUCTIONS))))
        return loss

    trainer.micro_step = counted
    result = trainer.run()
    record = {
        "micro": micro,
        "groups": fsdp_groups(trainer.trained_models()[0]),
        "losses": result["losses"],
        "outputs": result["outputs"],
    }
    (out / f"result-rank{setup.dist.rank}.json").write_text(json.dumps(record))
    close_distributed(barrier=True)


if __name__ == "__main__":
    main()
    leave(0)
