"""Stage-2 step vs unsplit step vs the denoiser alone for the sd, sdxl, sd3 and flux families.

Run: .venv/bin/python bench/bench_families.py [--quick] [--families sd,sdxl,sd3,flux] [--rounds 12]
     [--resolution 128] [--batch 4] [--real-prompts]

Each family trains a random-weight diffusers folder built from the real configs (SD 1.5, SDXL
base, SD3-medium, FLUX.1-dev) with every width (channels, hidden sizes, head dims, projections,
GroupNorm groups) divided by one factor (8; FLUX 16) and real depths and head counts, so the text
encoder : denoiser : VAE encoder parameter ratios stay the real ones. The tokenizers are those of
`tests.helpers.tiny_diffusers` and the token tables their size (they cost no compute), so the ratio
kept is that without token tables; both real ratios are printed. Prompt tokens keep their real
share of the denoiser's sequence (77 at 512 px -> 5 at 128 px), except the 77 CLIP tokens SD3 and
FLUX always take. One process, one thread, fp32, LoRA rank 4; on one batch, interleaved (split,
unsplit, alone, split, ...), medians after warm-up:
  stage-2  V2 outputs (prompt + VAE encoding) computed once; V1 units + denoiser fwd/bwd + AdamW
  unsplit  decode the images, every unit (text encoders, VAE encoder), denoiser fwd/bwd + AdamW
  alone    the denoiser fwd/bwd + AdamW on one prepared step's inputs
Goals: stage-2 / unsplit < 1 for every family; stage-2 / denoiser alone <= 1.15.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from functools import partial
from pathlib import Path

QUIET = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
for _name, _value in {**QUIET, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1"}.items():
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from splitstage.config.families import config_class  # noqa: E402
from splitstage.config.job import config_from_dict  # noqa: E402
from splitstage.data.digits import write_digits_dataset  # noqa: E402
from splitstage.data.index import index_data_set  # noqa: E402
from splitstage.pipelines.draws import Draws  # noqa: E402
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units  # noqa: E402
from splitstage.tasks.job_plan import make_plan  # noqa: E402
from splitstage.tasks.stage2.models import add_lora  # noqa: E402
from tests.helpers.tiny_diffusers import SD_SCHEDULE, clip_tokenizer, t5_tokenizer  # noqa: E402

WORK = Path("runs/bench/families")
FAMILIES = ("sd", "sdxl", "sd3", "flux")
SCALE = {"sd": 8, "sdxl": 8, "sd3": 8, "flux": 16}  # widths are divided by this
REAL = {"sd": (512, 77), "sdxl": (1024, 77), "sd3": (1024, 256), "flux": (1024, 512)}  # px, tokens
REAL_VOCAB = {"clip": 49408, "t5": 32128}

# The real components (diffusers / transformers constructor arguments).
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
CLIP_L |= dict(projection_dim=768, hidden_act="quick_gelu")
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32)
CLIP_G |= dict(num_attention_heads=20, projection_dim=1280, hidden_act="gelu")
T5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32)
VAE |= dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
SD15_UNET = dict(block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, norm_num_groups=32)
SD15_UNET |= dict(cross_attention_dim=768, attention_head_dim=8, sample_size=64)
SDXL_UNET = dict(block_out_channels=(320, 640, 1280), layers_per_block=2, norm_num_groups=32)
SDXL_UNET |= dict(down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * 2)
SDXL_UNET |= dict(up_block_types=("CrossAttnUpBlock2D",) * 2 + ("UpBlock2D",))
SDXL_UNET |= dict(transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20))
SDXL_UNET |= dict(cross_attention_dim=2048, addition_embed_type="text_time", sample_size=128)
SDXL_UNET |= dict(addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816)
SDXL_UNET |= dict(use_linear_projection=True)
SD3_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24)
SD3_MEDIUM |= dict(attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096)
SD3_MEDIUM |= dict(caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38)
FLUX_DEV |= dict(attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096)
FLUX_DEV |= dict(pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
WIDTHS = {  # the keys that are widths, scaled by the family's factor
    "hidden_size", "intermediate_size", "projection_dim", "d_model", "d_kv", "d_ff",
    "block_out_channels", "norm_num_groups", "cross_attention_dim", "addition_time_embed_dim",
    "projection_class_embeddings_input_dim", "attention_head_dim", "joint_attention_dim",
    "caption_projection_dim", "pooled_projection_dim",
}  # fmt: skip


def scaled(config: dict, factor: int) -> dict:
    """The config with every width divided by `factor` (tuples element-wise); a UNet's
    attention_head_dim is its head count in diffusers, so it stays."""
    out = dict(config)
    unet = "cross_attention_dim" in config
    for key in WIDTHS & set(config) - ({"attention_head_dim"} if unet else set()):
        value = config[key]
        out[key] = tuple(v // factor for v in value) if type(value) is tuple else value // factor
    if "axes_dims_rope" in config:  # FLUX's RoPE axes must stay even and sum to the head dim
        head = out["attention_head_dim"]
        axes = [max(2, round(a * head / sum(config["axes_dims_rope"]) / 2) * 2) for a in (16, 56)]
        out["axes_dims_rope"] = (axes[0], axes[1], head - sum(axes))
    return out


def clip(config: dict, projection: bool, vocab: int | None = None):
    """A CLIP text model (with projection) for the tiny CLIP tokenizer (table: `vocab` rows)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    ids = len(clip_tokenizer())  # its specials are the last two ids, as in the real tokenizer
    special = {"bos_token_id": ids - 2, "eos_token_id": ids - 1, "pad_token_id": ids - 1}
    cfg = CLIPTextConfig(vocab_size=vocab or ids, max_position_embeddings=77, **special, **config)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg)


def t5(config: dict, vocab: int | None = None):
    """A T5 v1.1 encoder (gated GELU) for the tiny T5 tokenizer (table: `vocab` rows)."""
    from transformers import T5Config, T5EncoderModel

    special = {"pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}
    vocab = vocab or len(t5_tokenizer())
    return T5EncoderModel(
        T5Config(vocab_size=vocab, feed_forward_proj="gated-gelu", **special, **config)
    )


def vae(config: dict, latent: int, scaling: float, shift: float | None = None):
    """SD's AutoencoderKL layout (SD3/FLUX: 16 latent channels, no quant convs, a shift)."""
    from diffusers import AutoencoderKL

    flow = {"use_quant_conv": shift is None, "use_post_quant_conv": shift is None}
    return AutoencoderKL(
        latent_channels=latent, scaling_factor=scaling, shift_factor=shift, **flow, **config
    )


def parts(kind: str, f: int, vocab: dict | None = None) -> tuple[str, dict, dict]:
    """(pipeline class, components, extra kwargs) of `kind` with widths / f (f=1: the real one)."""
    import diffusers as d

    v = vocab or {}
    clip_l, clip_g = scaled(CLIP_L, f), scaled(CLIP_G, f)
    flow, ddpm = {"num_train_timesteps": 1000, "shift": 3.0}, {**SD_SCHEDULE, "clip_sample": False}
    sd, unet_class = "StableDiffusion", d.UNet2DConditionModel
    table = {  # pipeline, denoiser, (latent channels, scaling, shift), text encoders, scheduler
        "sd": (sd, unet_class, SD15_UNET, (4, 0.18215, None), "L", ddpm),
        "sdxl": (f"{sd}XL", unet_class, SDXL_UNET, (4, 0.13025, None), "LG", ddpm),
        "sd3": (f"{sd}3", d.SD3Transformer2DModel, SD3_MEDIUM, (16, 1.5305, 0.0609), "lGT", flow),
        "flux": ("Flux", d.FluxTransformer2DModel, FLUX_DEV, (16, 0.3611, 0.1159), "LT", flow),
    }
    pipeline, denoiser, config, latents, encoders, schedule = table[kind]
    unet = kind in ("sd", "sdxl")
    components = {
        "unet" if unet else "transformer": denoiser(**scaled(config, f)),
        "vae": vae(scaled(VAE, f), *latents),
        "scheduler": (d.DDPMScheduler if unet else d.FlowMatchEulerDiscreteScheduler)(**schedule),
    }
    for index, code in enumerate(encoders):  # "l": CLIP-L with its projection (SD3)
        suffix = f"_{index + 1}" if index else ""
        components[f"tokenizer{suffix}"] = t5_tokenizer() if code == "T" else clip_tokenizer()
        clip_model = partial(clip, clip_g if code == "G" else clip_l, code != "L", v.get("clip"))
        t5_model = partial(t5, scaled(T5_XXL, f), v.get("t5"))
        components[f"text_encoder{suffix}"] = t5_model() if code == "T" else clip_model()
    extra = {"feature_extractor": None, "image_encoder": None}
    if kind == "sd":  # StableDiffusionPipeline takes no image encoder but a safety checker
        extra = {"feature_extractor": None, "safety_checker": None}
        extra["requires_safety_checker"] = False
    return f"{pipeline}Pipeline", components, extra


def counts(components: dict) -> dict[str, tuple[float, float]]:
    """Per model: (parameters, parameters without token tables); the VAE's encoder only."""
    out = {}
    for name, model in ((n, m) for n, m in components.items() if isinstance(m, torch.nn.Module)):
        if name == "vae":
            model = torch.nn.ModuleList([model.encoder, model.quant_conv or torch.nn.Identity()])
        total = sum(p.numel() for p in model.parameters())
        tables = {  # token tables (T5's two names share one)
            id(m.weight): m.weight.numel()
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Embedding) and ("token" in n or n == "shared")
        }
        out[name] = (total, total - sum(tables.values()))
    return out


def real_counts(kind: str) -> dict[str, tuple[float, float]]:
    """Parameter counts of the real components, built on the meta device (no memory)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        _, components, _ = parts(kind, 1, REAL_VOCAB)
    for model in components.values():  # T5 ties its token tables only outside the context
        if hasattr(model, "tie_weights") and not hasattr(model, "register_to_config"):
            model.tie_weights()
    return counts(components)


def write_folder(kind: str, folder: Path, factor=None, vocab=None, dtype=None) -> dict:
    """Save `kind` (widths / factor) as a diffusers folder in `dtype`; returns its counts."""
    import diffusers

    torch.manual_seed(0)
    class_name, components, extra = parts(kind, factor or SCALE[kind], vocab)
    numbers = counts(components)
    pipe = getattr(diffusers, class_name)(**components, **extra)
    if dtype is not None:  # and off the GPU it may have been built on
        pipe.to("cpu", dtype)
    shutil.rmtree(folder, ignore_errors=True)
    pipe.save_pretrained(folder)
    return numbers


def job_config(kind, folder: Path, work: Path, side, batch, prompt, rank=4, precision="fp32"):
    """A LoRA job on the folder's denoiser, data under work/data, frozen models in `precision`."""
    pipeline = {"name": kind, "pretrained": str(folder), "resolution": side}
    if "precision" in config_class(kind).model_fields:
        pipeline["precision"] = precision
    denoiser = "unet" if kind in ("sd", "sdxl") else "transformer"
    return config_from_dict({
        "job": {"name": f"bench-{kind}", "seed": 0}, "data": {"base_path": str(work / "data")},
        "pipeline": pipeline | {"max_prompt_length": prompt},
        "trainable": {"lora_base_model": denoiser, "lora_rank": rank},
        "cache": {"url": str(work / "cache")}, "output": {"url": str(work / "out")},
        "train": {"batch_size": batch, "max_steps": 3},
    })  # fmt: skip


class Steps:
    """One batch's training step three ways (split, unsplit, denoiser alone), models loaded."""

    def __init__(self, config, device: torch.device, precision: torch.dtype | None = None):
        self.plan = plan = make_plan(config)
        self.family = family = plan.family
        self.device, on = device, precision is not None
        self.autocast = partial(torch.autocast, device.type, dtype=precision, enabled=on)
        self.models = {name: family.build_model(name, device) for name in family.model_names}
        name = family.denoiser  # frozen: in pipeline.precision; the denoiser trains in fp32
        # with LoRA under `precision` autocast, as stage 2's trainer does
        self.models[name] = add_lora(self.models[name].float(), family).train()
        params = [p for p in self.models[name].parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-4)
        self.rows = index_data_set(config).rows[: config.train.batch_size]
        self.base = config.data.base_path
        with torch.no_grad():
            stage1 = run_units(plan.v2_units, self.context(0), self.raw_batch())
        self.cached = {name: stage1[name] for name in plan.split.boundary_params}
        self.prepared_ctx = self.context(1)
        with self.autocast():
            inputs = run_units(plan.v1_units, self.prepared_ctx, dict(self.cached))
            self.prepared = family.training_step(self.prepared_ctx, inputs)
        self.seeds = iter(range(2, 2**62))

    def context(self, seed: int) -> StepContext:
        """A step's context: the models, the device, that step's random draws."""
        generator = torch.Generator(self.device).manual_seed(seed)
        settings = self.family.settings()
        draws = Draws.shared(generator)
        return StepContext(self.models, self.device, draws=draws, settings=settings)

    def raw_batch(self) -> dict:
        """The batch decoded from the data set, as unsplit training reads it every step."""
        batch = collate_samples([self.family.load_sample(row, self.base) for row in self.rows])
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def update(self, loss: torch.Tensor) -> None:
        """Backward, AdamW step, zero grads."""
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def split(self) -> None:
        """Stage 2: V1 units + denoiser on the cached V2 outputs."""
        ctx = self.context(next(self.seeds))
        with self.autocast():
            inputs = run_units(self.plan.v1_units, ctx, dict(self.cached))
            loss = self.family.training_loss(ctx, inputs)
        self.update(loss)

    def unsplit(self) -> None:
        """Every unit every step (decode, text encoders, VAE) + denoiser."""
        ctx = self.context(next(self.seeds))
        with self.autocast():
            loss = self.family.training_loss(ctx, run_units(self.plan.units, ctx, self.raw_batch()))
        self.update(loss)

    def stage1(self) -> dict[str, float]:
        """Seconds each V2 unit takes on the decoded batch (what stage 1 does once per sample)."""
        inputs, ctx, seconds = self.raw_batch(), self.context(0), {}
        with torch.no_grad(), self.autocast():
            for unit in self.plan.v2_units:
                run = partial(run_units, [unit], ctx, inputs)
                seconds[unit.spec.name] = timed(run, self.device)
        return seconds

    def alone(self) -> None:
        """The denoiser only, on one prepared step's inputs."""
        with self.autocast():
            prediction = self.family.denoise(self.prepared_ctx, self.prepared)
            loss = self.family.loss(prediction, self.prepared)
        self.update(loss)


def ratios(numbers: dict[str, tuple[float, float]]) -> tuple[float, float, float]:
    """(text : denoiser, the same without token tables, VAE encoder : denoiser)."""
    denoiser = numbers.get("unet", numbers.get("transformer"))[0]
    texts = [v for k, v in numbers.items() if k.startswith("text_encoder")]
    text, bare = (sum(t[i] for t in texts) / denoiser for i in (0, 1))
    return text, bare, numbers["vae"][0] / denoiser


def timed(step, device: torch.device | None = None) -> float:
    """Seconds one call of `step` takes (waiting for the GPU's queue on CUDA)."""
    start = time.perf_counter()
    step()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def bench_family(kind: str, args) -> dict:
    """Build, load and time one family; returns its figures."""
    scaled_counts = write_folder(kind, folder := WORK / kind)
    side, length = REAL[kind]  # prompt tokens keep their share of the latent positions
    length = length if args.real_prompts else max(2, round(length * (args.resolution / side) ** 2))
    config = job_config(kind, folder, WORK, args.resolution, args.batch, length)
    bench = Steps(config, torch.device("cpu"))
    steps = {"split": bench.split, "unsplit": bench.unsplit, "alone": bench.alone}
    times = {name: [] for name in steps}
    units: dict[str, list[float]] = {}
    for _ in range(args.warmup + args.rounds):
        for name, step in steps.items():
            times[name].append(timed(step))
        for name, seconds in bench.stage1().items():
            units.setdefault(name, []).append(seconds)
    medians = {name: statistics.median(t[args.warmup :]) for name, t in times.items()}
    result = dict(kind=kind, scale=SCALE[kind], prompt_length=length, counts=scaled_counts)
    result |= dict(v1=[u.spec.name for u in bench.plan.v1_units], real_counts=real_counts(kind))
    result |= {f"{n}_s": v for n, v in medians.items()}
    result["v2"] = [u.spec.name for u in bench.plan.v2_units]
    result["v2_unit_s"] = {name: statistics.median(t[args.warmup :]) for name, t in units.items()}
    result["step_ratio"] = medians["split"] / medians["unsplit"]
    result["split_vs_denoiser"] = medians["split"] / medians["alone"]
    return result


def print_proportions(r: dict) -> None:
    """Parameter counts and ratios, real vs benchmarked, and where a batch's time goes."""
    print(f"\n{r['kind']}: widths / {r['scale']}, prompt tokens {r['prompt_length']}, ", end="")
    print(f"V1 {r['v1']}, V2 {r['v2']}")
    print(f"  {'component':16} {'real (M)':>10} {'w/o tokens':>11} {'here (M)':>9}")
    for name, (total, bare) in r["real_counts"].items():
        here = r["counts"][name][0] / 1e6
        print(f"  {name:16} {total / 1e6:10.1f} {bare / 1e6:11.1f} {here:9.3f}")
    real, here = ratios(r["real_counts"]), ratios(r["counts"])
    print(f"  text:denoiser real {real[0]:.3f} (w/o token tables {real[1]:.3f}), ", end="")
    print(f"here {here[0]:.3f} ({here[1]:.3f}); VAE encoder:denoiser real {real[2]:.4f}, ", end="")
    print(f"here {here[2]:.4f}")
    units = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["v2_unit_s"].items())
    steps = ", ".join(f"{k} {r[f'{k}_s'] * 1e3:.0f} ms" for k in ("split", "unsplit", "alone"))
    print(f"  per batch: V2 units {units}; steps {steps}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 px, fewer rounds (~3 min)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (after warm-up)")
    parser.add_argument("--resolution", type=int, default=None, help="default 128 (quick: 64)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--real-prompts", action="store_true", help="real lengths (slow: ~15 min)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (5 if args.quick else 12)
    args.warmup, args.resolution = (
        (1, args.resolution or 64) if args.quick else (2, args.resolution or 128)
    )
    torch.set_num_threads(1)
    write_digits_dataset(WORK / "data", limit=args.batch, size=32)
    results = []
    for kind in args.families.split(","):
        start = time.perf_counter()
        results.append(bench_family(kind, args))
        print_proportions(results[-1])
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"\nbatch {args.batch}, {args.resolution} px, median of {args.rounds} rounds, 1 thread")
    print(f"{'figure':36} {'measured':28} {'ratio':>7} {'goal':>7}  met")
    figures = {}
    for r in results:
        k, split = r["kind"], r["split_s"]
        figures |= {f"{k}_{n}": r[n] for n in ("step_ratio", "split_vs_denoiser")}
        for label, other, ratio, goal in (
            ("unsplit step", r["unsplit_s"], r["step_ratio"], "< 1"),
            ("denoiser alone", r["alone_s"], r["split_vs_denoiser"], "<= 1.15"),
        ):
            met = "yes" if ratio < 1 or (goal == "<= 1.15" and ratio <= 1.15) else "NO"
            measured, name = (
                f"{split * 1e3:.0f} ms / {other * 1e3:.0f} ms",
                f"{k}: stage-2 step / {label}",
            )
            print(f"{name:36} {measured:28} {ratio:7.3f} {goal:>7}  {met}")
    return figures


if __name__ == "__main__":
    main()
