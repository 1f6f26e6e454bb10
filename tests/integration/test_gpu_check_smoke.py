"""bench/gpu_check.sh's lever rows at tiny sizes on this CPU (the GPU path itself needs a GPU):
FLUX.1-dev-size and Qwen-Image-size transformers, shrunk, through stage 2's own build for a bf16
base, each base_quantization, offload = "cpu" and an int8 base with half its blocks swapped
(offload = N); every row reports its step time and frozen bytes, the quantized bases hold fewer
bytes than the bf16 one, and the swapped int8 base fewer on the device than the int8 one.
Run: .venv/bin/pytest -m slow tests/integration/test_gpu_check_smoke.py
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LEVERS = ("bf16 base", "int8", "fp8", "nf4", "offload cpu", "int8 + offload half the blocks")
MODELS = ("flux (FLUX.1-dev size)", "qwenimage (Qwen-Image size)")
RESULT = re.compile(r"(\d+\.\d+) s/step \(median of \d\), frozen (\d+\.\d+) MiB (on|in) ")


def test_cpu_smoke_reports_every_lever_row():
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--cpu-smoke", "--only", "levers"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = dict(
        line.strip("| ").split(" | ", 1)
        for line in done.stdout.splitlines()
        if line.startswith("| ") and " | " in line
    )
    for model in MODELS:
        frozen = {}
        for lever in LEVERS:
            name = f"{model}: LoRA step 64 px, checkpointing, {lever}"
            result = table.get(name, "missing")
            found = RESULT.search(result)
            assert found, f"{name}: {result}"
            assert float(found[1]) > 0
            frozen[lever] = float(found[2])
        assert frozen["offload cpu"] == frozen["bf16 base"], frozen
        assert frozen["int8"] <= 0.55 * frozen["bf16 base"], frozen
        assert frozen["fp8"] <= 0.55 * frozen["bf16 base"], frozen
        assert frozen["nf4"] <= 0.3 * frozen["bf16 base"], frozen
        assert frozen["int8 + offload half the blocks"] < frozen["int8"], frozen


ESTIMATE = re.compile(r"estimate (\d+\.\d) MiB / tracked (\d+\.\d) MiB = (\d+\.\d+) \(CPU\)")


def test_cpu_smoke_compares_the_memory_plan_with_the_measured_step():
    """The GPU check's memory-plan row (estimate vs torch.cuda.max_memory_allocated on a GPU)
    runs its whole path on this CPU at tiny SD 1.5 sizes: the estimate against torch's tracker
    on the real stage-2 micro-step, within the 15% the plan promises on CPUs."""
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--cpu-smoke", "--only", "sd"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    row = next(
        (line for line in done.stdout.splitlines() if "memory plan estimate / measured" in line),
        "missing",
    )
    found = ESTIMATE.search(row)
    assert found, row
    assert float(found[2]) > 0 and abs(float(found[3]) - 1) <= 0.15, row
