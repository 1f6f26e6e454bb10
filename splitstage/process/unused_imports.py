"""What a process that serves one job may skip importing: a library the job cannot use.

Only for processes that run one job and end (a rank, the set-up child, the `splitstage` console
script): a long-lived process (a Prefect worker, a notebook, a test session) may run another job
next that needs what this one skips.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any


def trains_with_adamw8bit(config: Mapping[str, Any]) -> bool:
    """bitsandbytes' one use here: `train.optimizer = "adamw8bit"`."""
    return config.get("train", {}).get("optimizer", "adamw") == "adamw8bit"


def quantizes_the_base(config: Mapping[str, Any]) -> bool:
    """torchao's one use here: `train.base_quantization` other than "none", or a LoRA job
    whose `train.fit = "auto"` may choose (or recorded) a quantized base."""
    train = config.get("train", {})
    may_choose = train.get("fit", "off") == "auto" and config.get("trainable", {}).get(
        "lora_base_model"
    )
    return train.get("base_quantization", "none") != "none" or bool(may_choose)


def names_a_credentials_block(config: Any) -> bool:
    """boto3's one use here: a Prefect AWS block (`credentials_block`, anywhere in the config or
    in options handed on) is read through prefect-aws, which builds boto3 sessions; s3fs itself
    runs on aiobotocore and botocore."""
    if isinstance(config, Mapping):
        return any(
            (key == "credentials_block" and value) or names_a_credentials_block(value)
            for key, value in config.items()
        )
    if isinstance(config, list | tuple):
        return any(names_a_credentials_block(value) for value in config)
    return False


# library -> whether a job (its config as a dict) can use it
USED_WHEN: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "bitsandbytes": trains_with_adamw8bit,
    "torchao": quantizes_the_base,
    "boto3": names_a_credentials_block,
}


# library -> the loggers that speak when it is imported, about things this job does not use
# (torchao: kernels built for other Pythons and GPUs; torch's pytree: its Enum registrations;
# diffusers: torchao tensor classes of older releases, for loading torchao checkpoints;
# bitsandbytes: on CPUs with avx512_bf16 a 4-bit matmul kernel from the Hub, with install advice
# for the `kernels` package: 4-bit layers are not what adamw8bit uses, the advice not ours)
IMPORT_TIME_LOGGERS = {
    "bitsandbytes": ("bitsandbytes.backends.cpu.ops", "kernels"),
    "torchao": ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"),
}


# transformers' line when a pipeline module names an image processor whose default backend needs
# torchvision (FluxPipeline's CLIP / SigLIP processors, for IP-adapters this job never loads):
# torchvision stays out of the environment on purpose, and the PIL fallback it names is used.
TORCHVISION_FALLBACK = "requires torchvision (not installed); falling back to"


class _DropTorchvisionFallback(logging.Filter):
    """Drops transformers' torchvision-fallback notice; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return TORCHVISION_FALLBACK not in record.getMessage()


def quiet_torchvision_fallback() -> None:
    """Transformers' import-machinery logger stops saying the image processors fall back to PIL."""
    logger = logging.getLogger("transformers.utils.import_utils")
    if not any(isinstance(f, _DropTorchvisionFallback) for f in logger.filters):
        logger.addFilter(_DropTorchvisionFallback())


def skip_unused_libraries(config: Mapping[str, Any]) -> None:
    """Mark absent each library the job (a config dict) cannot use, though a library it imports
    would load it whenever it is installed: peft, diffusers and transformers import bitsandbytes
    (~1.5 s of each process start here) and torchao (~5 s and log lines about its kernels),
    accelerate imports boto3 for its SageMaker settings
    (~0.1-0.3 s, ~9 MB). `sys.modules[name] = None` is Python's way to say so: every
    `find_spec` then answers "not installed" and an import fails, so no library half-uses it.
    A library the job uses is imported quietly: its import-time warnings are not ours to show."""
    quiet_torchvision_fallback()
    for library, used in USED_WHEN.items():
        if not used(config):
            sys.modules.setdefault(library, None)  # type: ignore[arg-type]
        else:
            for name in IMPORT_TIME_LOGGERS.get(library, ()):
                logging.getLogger(name).setLevel(logging.ERROR)
