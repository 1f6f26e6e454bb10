"""Distributed checks of parallelize + materialize_and_load, one torchrun launch for many checks.

Run: torchrun --nproc-per-node=2 tests/integration/workers/blocks_worker.py OUT_DIR
Writes OUT_DIR/results-rank{r}.json: {check name: {"ok": bool, "detail": ...}}.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from tiny import TP_PLAN, Results, Tiny, add_lora, init_buffers, reference_state
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from splitstage.process.leaving import leave
from splitstage.tasks.stage2.distributed import build_mesh, init_distributed
from splitstage.tasks.stage2.parallelize import parallelize
from splitstage.tasks.stage2.pretrained_weights import (
    WeightsError,
    WeightsFileNotFoundError,
    materialize_and_load,
)

BATCH = 8
LAYOUTS_BY_WORLD = {  # world size -> {mode: (dp_shard, tp)}
    2: {"ddp": (2, 1), "fsdp": (2, 1), "tp": (1, 2), "fsdp+tp": (1, 2)},
    4: {"fsdp+tp": (2, 2)},
}
LAYOUTS: dict[str, tuple[int, int]] = {}


def full_state(model) -> dict[str, torch.Tensor]:
    """Gathered full tensors, keyed like the plain model (every rank gets them)."""
    options = StateDictOptions(full_state_dict=True)
    out = {}
    for k, v in get_model_state_dict(model, options=options).items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        out[k.replace("base_model.model.", "").replace(".base_layer", "")] = v.detach().cpu()
    return out


def build(mode: str, path: str, strategy: str = "slices", lora: bool = False, **kw):
    """Meta init -> (LoRA) -> parallelize -> load, as the training worker does."""
    dp, tp = LAYOUTS[mode]
    mesh = build_mesh(dp, tp, dist.get_world_size())
    with torch.device("meta"):
        model = Tiny()
    if lora:
        model = add_lora(model)
    parallelize(model, mesh=mesh, mode=mode, tp_plan=TP_PLAN)
    report = materialize_and_load(model, path, strategy=strategy, buffers_init=init_buffers, **kw)
    return model, mesh, report


def batch(dp_rank: int, dp: int):
    """This data-parallel rank's rows of a fixed global batch."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 1, generator=g)
    rows = BATCH // dp
    return x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows], x, y


def dp_info(mesh):
    """(data-parallel rank, its group) of this rank; (0, None) without a dp dim."""
    if "dp" not in mesh.mesh_dim_names:
        return 0, None
    dp_mesh = mesh["dp"] if mesh.ndim > 1 else mesh
    return dp_mesh.get_local_rank(), dp_mesh.get_group()


def train_two_steps(model, x, y, dp_group=None) -> list[float]:
    """Two plain SGD steps; losses averaged over data-parallel ranks."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    for _ in range(2):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if dp_group is not None:
            dist.all_reduce(value, group=dp_group)
            value /= dist.get_world_size(dp_group)
        losses.append(float(value))
    return losses


def check_equal_to_file(model, file_state) -> str:
    """Every gathered tensor equals the file's exactly (and LoRA B starts at zero)."""
    got = full_state(model)
    for key, expected in file_state.items():
        assert torch.equal(got[key], expected.to(got[key].dtype)), f"{key} differs from the file"
    return f"{len(file_state)} tensors equal"


def main() -> None:
    """Write the test files, run every check, record results per rank."""
    out_dir = sys.argv[1]
    info = init_distributed()
    results = Results(out_dir, info.rank)
    world = info.world_size
    LAYOUTS.update(LAYOUTS_BY_WORLD[world])
    sft, pt = os.path.join(out_dir, "w.safetensors"), os.path.join(out_dir, "w.pt")
    state = reference_state()
    if info.rank == 0:
        save_file(state, sft)
        torch.save(state, pt)
        save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, f"{sft}.prefixed")
        bad = dict(state)
        bad.pop("head.bias")
        bad["extra.weight"] = torch.zeros(1)
        save_file(bad, f"{sft}.keys")
        shaped = dict(state, **{"head.weight": torch.zeros(2, 7)})
        save_file(shaped, f"{sft}.shape")
        save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, f"{sft}.bf16")
    dist.barrier()

    # 1. Exact loading: every layout x strategy x file format equals the file.
    for mode in LAYOUTS:
        for strategy in ("slices", "broadcast"):
            for path in (sft, pt):
                name = f"load/{mode}/{strategy}/{os.path.basename(path)}"
                results.check(
                    name,
                    lambda m=mode, s=strategy, p=path: check_equal_to_file(
                        build(m, p, s)[0], state
                    ),
                )
    if world == 2:
        check_extras(results, sft, state)
        check_errors(results, out_dir, sft, state)
    check_training(results, state, sft, world)
    dist.barrier()
    dist.destroy_process_group()


def check_extras(results: Results, sft: str, state) -> None:
    """dtype cast, buffers_init and the load report."""
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    results.check(
        "load/cast-bf16", lambda: check_equal_to_file(build("fsdp", f"{sft}.bf16")[0], bf16)
    )
    results.check(
        "load/buffers",
        lambda: bool(
            torch.equal(
                build("fsdp", sft)[0].phase, torch.sin(torch.arange(7, dtype=torch.float32))
            )
        ),
    )
    results.check("load/report", lambda: build("fsdp+tp", sft)[2].__dict__)


def check_errors(results: Results, out_dir: str, sft: str, state) -> None:
    """Named errors, raised identically on every rank."""

    def expect(exc_type, fn):
        try:
            fn()
        except exc_type as exc:
            return str(exc)
        raise AssertionError(f"no {exc_type.__name__} raised")

    missing = os.path.join(out_dir, "nope.safetensors")
    results.check(
        "error/missing-file",
        lambda: expect(WeightsFileNotFoundError, lambda: build("fsdp", missing)),
    )
    results.check(
        "error/prefix", lambda: expect(WeightsError, lambda: build("tp", f"{sft}.prefixed"))
    )
    results.check(
        "load/with-prefix",
        lambda: check_equal_to_file(
            build("tp", f"{sft}.prefixed", key_prefix="model.diffusion_model.")[0], state
        ),
    )
    results.check("error/keys", lambda: expect(WeightsError, lambda: build("fsdp", f"{sft}.keys")))
    results.check(
        "error/keys-broadcast",
        lambda: expect(WeightsError, lambda: build("fsdp", f"{sft}.keys", strategy="broadcast")),
    )
    results.check(
        "error/shape", lambda: expect(WeightsError, lambda: build("fsdp+tp", f"{sft}.shape"))
    )

    def no_buffers_init():
        with torch.device("meta"):
            model = Tiny()
        return expect(ValueError, lambda: materialize_and_load(model, sft))

    results.check("error/buffers", no_buffers_init)

    def one_rank_fails_to_save():
        """Rank 1 cannot write its RNG file: both ranks raise (no rank waits forever)."""
        import splitstage.tasks.stage2.checkpoint as ckpt

        model = build("fsdp", sft)[0]
        original = ckpt.write_atomic
        if dist.get_rank() == 1:
            ckpt.write_atomic = lambda *a: (_ for _ in ()).throw(OSError("disk full (simulated)"))
        try:
            return expect(Exception, lambda: ckpt.save_checkpoint(f"{out_dir}/ck", 1, model, None))
        finally:
            ckpt.write_atomic = original

    results.check("error/save-one-rank", one_rank_fails_to_save)


def check_training(results: Results, state, sft: str, world: int) -> None:
    """Same loss and params as one process, plain and with LoRA."""
    # 3. Same loss as one process for two steps (the second after an optimizer step), every mode.
    ref = Tiny()
    ref.load_state_dict(state)
    for mode, (dp, _tp) in LAYOUTS.items():

        def same_loss(mode=mode, dp=dp):
            model, mesh, _ = build(mode, sft)
            dp_rank, group = dp_info(mesh)
            x, y, gx, gy = batch(dp_rank, dp)
            got = train_two_steps(model, x, y, group)
            want = train_two_steps(copy.deepcopy(ref), gx, gy)
            params = full_state(model)
            reference = copy.deepcopy(ref)
            train_two_steps(reference, gx, gy)
            worst = max(
                float((params[k] - v).abs().max()) for k, v in reference.state_dict().items()
            )
            assert all(abs(a - b) <= 1e-6 * max(1, abs(b)) for a, b in zip(got, want)), (got, want)
            assert worst <= 1e-6, f"params differ by {worst}"
            return {"losses": got, "reference": want, "max_param_diff": worst, "world": world}

        results.check(f"loss/{mode}", same_loss)

    # 4. LoRA (peft) under FSDP+TP: base frozen and exact, adapters init identically, same loss.
    def lora_loss(mode):
        model, mesh, report = build(mode, sft, lora=True)
        assert report.initialized_adapters, "no adapter initialized"
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable), trainable
        start = full_state(model)
        reference = add_lora(copy.deepcopy(ref))
        reference.load_state_dict(
            {
                k: start[k.replace("base_model.model.", "").replace(".base_layer", "")]
                for k in reference.state_dict()
            }
        )
        dp, _ = LAYOUTS[mode]
        dp_rank, group = dp_info(mesh)
        x, y, gx, gy = batch(dp_rank, dp)
        got = train_two_steps(model, x, y, group)
        want = train_two_steps(reference, gx, gy)
        assert all(abs(a - b) <= 1e-6 * max(1, abs(b)) for a, b in zip(got, want)), (got, want)
        end = full_state(model)
        moved = [k for k in end if "lora_B" in k and float(end[k].abs().max()) > 0]
        assert moved, "LoRA B did not train"
        for k, v in end.items():
            if "lora_" not in k:
                assert torch.equal(v, state[k]), f"frozen {k} changed"
        return {"losses": got, "reference": want, "adapters": report.initialized_adapters[:2]}

    for mode in LAYOUTS:
        results.check(f"lora/{mode}", lambda m=mode: lora_loss(m))


if __name__ == "__main__":
    main()
    leave(0)  # as a rank leaves: no interpreter teardown, where torch threads can abort
