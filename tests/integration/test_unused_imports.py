"""Processes of one job import no library the job cannot use, and quiet the ones it does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts processes (docs/tests.md)

WORKER_START = (
    "import sys\n"
    "from splitstage.tasks.stage1.preprocess import _worker_start\n"
    "_worker_start(%r)\n"
    "import torch\n"
    "from peft import LoraConfig, inject_adapter_in_model\n"
    "model = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
    "inject_adapter_in_model(LoraConfig(r=2, target_modules=['0']), model)\n"
    "print(sys.modules.get('bitsandbytes', 'unset') is None, end='')\n"
)

USED_QUIETLY = (
    "from splitstage.process.unused_imports import skip_unused_libraries\n"
    "skip_unused_libraries({'train': {'optimizer': 'adamw8bit'}})\n"
    "import bitsandbytes\n"
    "print(bitsandbytes.__name__, end='')\n"
)


def run(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)


def test_a_preprocess_worker_skips_what_the_job_cannot_use():
    """A stage-1 pool worker (one job, then gone) marks bitsandbytes absent before any family
    imports peft or diffusers, unless the job trains with adamw8bit."""
    for optimizer, skipped in (("adamw", "True"), ("adamw8bit", "False")):
        payload = json.dumps({"train": {"optimizer": optimizer}})
        done = run(WORKER_START % payload)
        assert done.returncode == 0, done.stderr
        assert done.stdout == skipped, (optimizer, done.stdout)
        assert "pip install kernels" not in done.stderr, done.stderr


def test_a_job_that_uses_bitsandbytes_shows_none_of_its_install_advice():
    """adamw8bit imports bitsandbytes; on CPUs with avx512_bf16 its import tries a Hub kernel
    for 4-bit matmuls and logs `pip install kernels` advice: not ours, not shown."""
    done = run(USED_QUIETLY)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "bitsandbytes"
    assert "pip install kernels" not in done.stderr, done.stderr
    assert "gemm_4bit_forward" not in done.stderr, done.stderr


FLUX_IMPORT = (
    "from splitstage.process.unused_imports import skip_unused_libraries\n"
    "%s"
    "from diffusers import FluxPipeline\n"
    "import transformers\n"
    "print(transformers.SiglipImageProcessor.__name__, end='')\n"
)


def test_a_flux_process_does_not_relay_the_image_processors_torchvision_notice():
    """FluxPipeline's module names CLIP and SigLIP image processors (IP-adapters, never loaded
    here); without torchvision transformers falls back to their PIL classes and says so on every
    flux command. The fallback is used, the notice is not ours: a job's process drops it."""
    bare = run(FLUX_IMPORT % "")  # the library's own behaviour: the notice is printed
    assert bare.returncode == 0, bare.stderr
    assert "requires torchvision (not installed)" in bare.stderr, bare.stderr
    quiet = run(FLUX_IMPORT % "skip_unused_libraries({})\n")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "SiglipImageProcessorPil"
    assert "torchvision" not in quiet.stderr, quiet.stderr
