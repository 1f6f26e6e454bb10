"""A small training loop that checkpoints, can crash itself, and resumes: for the DCP tests.

Run: torchrun --nproc-per-node=2 tests/integration/workers/ckpt_worker.py --url DIR --out OUT
Rank 0 writes OUT/losses-<tag>.json ({step: loss}) after every step, OUT/final-<tag>.safetensors
(full params) at the end, and OUT/saved-<step>.safetensors (full params) at each checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tiny import TP_PLAN, Tiny, add_lora, init_buffers, reference_state
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from splitstage.process.leaving import leave
from splitstage.tasks.stage2.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from splitstage.tasks.stage2.distributed import build_mesh, init_distributed
from splitstage.tasks.stage2.parallelize import parallelize
from splitstage.tasks.stage2.pretrained_weights import materialize_and_load


def parse() -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="run")
    p.add_argument("--mode", default="fsdp")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--crash-at", type=int, default=0, help="rank 1 SIGKILLs itself at this step")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--lora", action="store_true", help="peft LoRA, LoRA-only checkpoints")
    p.add_argument("--storage-options", default="{}", help="JSON")
    p.add_argument("--verify-reload", action="store_true")
    p.add_argument("--check-params", default="", help="safetensors the resumed params must equal")
    return p.parse_args()


def full_params(model) -> dict[str, torch.Tensor]:
    """Gathered full model state (collective)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out = {}
    for k, v in sd.items():
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().contiguous()
    return out


def build(args, world: int, weights: str):
    """Meta init -> parallelize -> load pretrained; AdamW + LambdaLR."""
    dp, tp = {"fsdp": (world, 1), "ddp": (world, 1), "fsdp+tp": (1, world), "none": (1, 1)}[
        args.mode
    ]
    mesh = build_mesh(dp, tp, world) if args.mode != "none" else None
    with torch.device("meta"):
        model = Tiny(dropout=0.1)
    if args.lora:
        model = add_lora(model)
    parallelize(model, mesh=mesh, mode=args.mode, tp_plan=TP_PLAN)
    materialize_and_load(model, weights, buffers_init=init_buffers)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched, mesh


def batch(rank: int):
    """Data drawn from every RNG a loader might use: torch, python random, numpy."""
    x = torch.randn(4, 5) + random.random() + float(np.random.rand())
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    """Train, checkpoint every few steps, optionally crash or resume."""
    args = parse()
    options = json.loads(args.storage_options)
    info = init_distributed()
    rank, world = info.rank, info.world_size
    weights = os.path.join(args.out, "pretrained.safetensors")
    if rank == 0 and not os.path.exists(weights):
        save_file(reference_state(), weights)  # seeds torch: do it before seeding the run
    dist.barrier()
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    model, opt, sched, mesh = build(args, world, weights)
    losses_path = os.path.join(args.out, f"losses-{args.tag}.json")
    losses: dict[str, float] = {}
    start = 0
    if args.resume:
        step = latest_checkpoint(args.url, storage_options=options)
        assert step is not None, "nothing to resume from"
        extra = load_checkpoint(args.url, step, model, opt, storage_options=options)
        sched.load_state_dict(extra["scheduler"])
        start = extra["step"]
        if args.check_params:
            want = load_file(args.check_params)
            got = full_params(model)
            diffs = {k: float((got[k] - want[k]).abs().max()) for k in want}
            if rank == 0:
                with open(os.path.join(args.out, f"check-{args.tag}.json"), "w") as fh:
                    json.dump({"keys": sorted(got), "max_diff": max(diffs.values())}, fh)
    for step in range(start + 1, args.steps + 1):
        if step == args.crash_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses[str(step)] = float(value) / world
        if rank == 0:
            with open(losses_path, "w") as fh:
                json.dump(losses, fh)
        if step % args.save_every == 0:
            extra = {"step": step, "scheduler": sched.state_dict()}
            save_checkpoint(
                args.url,
                step,
                model,
                opt,
                extra,
                keep_last=args.keep_last,
                lora_only=args.lora,
                storage_options=options,
            )
            params = full_params(model)
            if rank == 0:
                save_file(params, os.path.join(args.out, f"saved-{args.tag}-{step}.safetensors"))
    final = full_params(model)
    if rank == 0:
        save_file(final, os.path.join(args.out, f"final-{args.tag}.safetensors"))
    if args.verify_reload:
        verify_reload(args, options, world, weights, final, opt)
    dist.barrier()
    dist.destroy_process_group()


def verify_reload(args, options, world, weights, final, opt) -> None:
    """A fresh model + optimizer loads the latest checkpoint back to the same state."""
    step = latest_checkpoint(args.url, storage_options=options)
    model2, opt2, _, _ = build(args, world, weights)
    extra = load_checkpoint(args.url, step, model2, opt2, storage_options=options)
    got = full_params(model2)
    same = all(torch.equal(got[k], final[k]) for k in final)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    same_opt = all(torch.equal(_local(s1[i]["exp_avg"]), _local(s2[i]["exp_avg"])) for i in s1)
    report = {"step": step, "extra_step": extra["step"], "params_equal": same}
    report["optim_equal"] = same_opt
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, f"reload-{args.tag}.json"), "w") as fh:
            json.dump(report, fh)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor or DTensor."""
    return t.to_local() if isinstance(t, DTensor) else t


if __name__ == "__main__":
    main()
    leave(0)  # as a rank leaves: no interpreter teardown, where torch threads can abort
