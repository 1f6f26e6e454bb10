"""Experiment trackers through accelerate: TensorBoard by default when installed, W&B when
configured; loss, learning rate, throughput, the validation grids and a video family's clips.
Optional: nothing breaks without them, and a tracker failing to log is a line in the log, never
a failed run."""

from __future__ import annotations

import importlib.util
import io
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from splitstage.config.job import ConfigError, SplitstageConfig

INSTALL = {"tensorboard": "tensorboard", "wandb": "wandb"}


def installed(name: str) -> bool:
    """Whether a tracker's package can be imported here."""
    return importlib.util.find_spec(INSTALL[name]) is not None


def tracker_names(config: SplitstageConfig) -> list[str]:
    """The trackers this run logs to; an explicitly named one that is missing is an error."""
    report_to = config.tracking.report_to
    if report_to == "none":
        return []
    if report_to == "auto":
        names = ["tensorboard"] if installed("tensorboard") else []
        configured = os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE")
        return [*names, "wandb"] if configured and installed("wandb") else names
    missing = [name for name in report_to if not installed(name)]
    if missing:
        raise ConfigError(
            f"tracking.report_to: {', '.join(missing)} is not installed; `pip install "
            f"{' '.join(INSTALL[m] for m in missing)}` (or `pip install splitstage[tracking]`), "
            "or use report_to = 'auto'"
        )
    return list(dict.fromkeys(report_to))


def hyperparameters(config: SplitstageConfig) -> dict[str, Any]:
    """Flat scalar settings a tracker shows next to the run."""
    train, trainable = config.train, config.trainable
    values = {
        "family": config.pipeline.name,
        "trained": ",".join(trainable.models()),
        "lora_rank": trainable.lora_rank if trainable.lora_base_model else 0,
        "learning_rate": train.learning_rate,
        "batch_size": train.batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "mode": train.mode,
        "parallelism": train.parallelism,
        "seed": config.job.seed,
    }
    values.update({f"pipeline.{k}": v for k, v in config.pipeline.settings().items()})
    return {k: v for k, v in values.items() if isinstance(v, int | float | str | bool)}


def quiet_writer_threads() -> None:
    """TensorBoard's writer thread re-raises a failed write (e.g. its folder deleted mid-run) and
    Python prints that thread's traceback; the same error reaches the next log call, where
    `Tracking.guard` says it in one line. So that thread's traceback is not printed; every
    other thread's still is."""
    previous = threading.excepthook
    if getattr(previous, "splitstage_quiet", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)

    hook.splitstage_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class Tracking:
    """The run's trackers (accelerate's), started on the main process."""

    def __init__(self, accelerator, config: SplitstageConfig, log: Callable[[str], None]):
        self.accelerator, self.log = accelerator, log
        self.active = bool(accelerator.log_with)
        if self.active:
            quiet_writer_threads()
            project = config.tracking.project or config.job.name
            self.guard(accelerator.init_trackers, project, config=hyperparameters(config))

    def guard(self, call, *args, **kwargs) -> None:
        """Run a tracker call; a failure is logged once and turns tracking off."""
        try:
            call(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a tracker must never stop training
            self.active = False
            self.log(f"tracking off: {type(error).__name__}: {str(error).splitlines()[0]}")

    def scalars(self, update: int, values: dict[str, float]) -> None:
        """Loss, learning rate, throughput of one update."""
        if self.active:
            self.guard(self.accelerator.log, values, step=update)

    def grid(self, update: int, png: bytes, tag: str = "samples") -> None:
        """A validation grid as an image named `tag` (one per sampled size) in every tracker
        that takes images."""
        if not self.active:
            return
        image = Image.open(io.BytesIO(png)).convert("RGB")
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                array = np.asarray(image)[None]
                self.guard(tracker.log_images, {tag: array}, update, dataformats="NHWC")
            elif hasattr(tracker, "log_images"):
                self.guard(tracker.log_images, {tag: [image]}, update)

    def clips(self, update: int, gifs: list[bytes], tag: str = "samples") -> None:
        """A video family's validation clips (animated GIFs, prompt-major) as `tag/clip-NN`:
        TensorBoard plays a GIF in its image dashboard, W&B in its video panel."""
        if not self.active:
            return
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                self.guard(_tensorboard_gifs, tracker.tracker, update, gifs, tag)
            elif tracker.name == "wandb":
                self.guard(_wandb_gifs, tracker.tracker, update, gifs, tag)

    def end(self) -> None:
        """Flush and close the trackers (not accelerate's end_training: that would also tear
        down the process group the export still needs)."""
        if self.active:
            for tracker in self.accelerator.trackers:
                self.guard(tracker.finish)


def _tensorboard_gifs(writer, update: int, gifs: list[bytes], tag: str) -> None:
    """Each GIF as an encoded image summary (what torch's add_video writes, without moviepy)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    for index, gif in enumerate(gifs):
        with Image.open(io.BytesIO(gif)) as image:
            width, height = image.size
        picture = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=gif)
        summary = Summary(value=[Summary.Value(tag=f"{tag}/clip-{index:02d}", image=picture)])
        writer._get_file_writer().add_summary(summary, update)  # add_video's own path
    writer.flush()


def _wandb_gifs(run, update: int, gifs: list[bytes], tag: str) -> None:
    """Each GIF as a wandb.Video (from bytes: no moviepy or ffmpeg needed)."""
    import wandb

    videos = {
        f"{tag}/clip-{index:02d}": wandb.Video(io.BytesIO(gif), format="gif")
        for index, gif in enumerate(gifs)
    }
    run.log(videos, step=update)
