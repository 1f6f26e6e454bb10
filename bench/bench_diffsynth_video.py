"""DiffSynth's Wan on video files, stage 1: decoding vs the V2 compute, and cache bytes per clip
vs DiffSynth's own `.pth` per sample (tiny Wan models, CPU, one process, side by side).

Run: SPLITSTAGE_DIFFSYNTH_TESTS=1 .venv/diffsynth/bin/python bench/bench_diffsynth_video.py \
    [--clips 4] [--frames 33] [--side 48]

Writes `--clips` h264 clips with PyAV (moving squares, 64x48, 10 fps), then for each clip:
(a) decode: the diffsynth family's `load_sample` (PyAV seek + `[data.video]` frames + DiffSynth's
    ImageCropAndResize rule to `--side`), ms per clip and frames per second;
(b) V2: DiffSynth's own units over that sample (UMT5 prompt encode, Wan VAE encode, noise), ms
    per clip: the work stage 1 caches and unsplit training repeats every step;
(c) bytes: splitstage's cache (`preprocess`: safetensors shards of the boundary params) per clip
    vs what DiffSynth's `sft:data_process` saves per sample (`torch.save` of the inputs after its
    units: every param, the decoded PIL frames included);
(d) stage 1 as a whole (`preprocess`: decoding overlapped with the units, plus model loads and
    shard writes) vs the V2 units alone (noisy on a shared machine: for orientation).
Tiny models make (b) cheap, so the decode share here is far above a real Wan's; the figures to
read are the decode rate and the bytes. Measured (2-core shared box, 4 clips x 33 frames at
48x48): decode + crop 33-82 ms per clip (400-990 frames/s), V2 units 230-410 ms, cache 77 kB
per clip vs DiffSynth's .pth 358 kB (4.6x), stage 1 / V2 alone 0.82-1.05.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DIFFSYNTH_SKIP_DOWNLOAD", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WAN = "WanVideoPipeline"


def workspace(root: Path, clips: int, frames: int) -> dict:
    """Tiny Wan model files and `clips` clips of `frames` + 4 frames in a CSV `video` column."""
    from tests.helpers.tiny_diffsynth import write_tiny_models
    from tests.helpers.video_files import write_video

    info = write_tiny_models(WAN, root / WAN)
    (root / WAN / "info.json").write_text(json.dumps(info))
    lines = ["video,prompt"]
    for index in range(clips):
        write_video(root / "data" / f"clip{index}.mp4", frames + 4 + index, gop=12)
        lines.append(f"clip{index}.mp4,squares moving {index}")
    (root / "data" / "metadata.csv").write_text("\n".join(lines) + "\n")
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--side", type=int, default=48)
    args = parser.parse_args()

    import torch

    from splitstage.config.job import config_from_dict
    from splitstage.data.index import index_data_set
    from splitstage.tasks.job_plan import make_plan
    from splitstage.tasks.stage1.preprocess import preprocess
    from tests.helpers.diffsynth_jobs import fresh, job_document, registered

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        info = workspace(root, args.clips, args.frames)
        document = job_document(root, WAN)
        document["pipeline"] |= {"height": args.side, "width": args.side}
        document["data"]["video"] = {"num_frames": args.frames}
        config = config_from_dict(document)
        family = make_plan(config).family
        data = index_data_set(config)
        with registered([info]):
            pipe = fresh(WAN, info)
        decode_s, v2_s, pth_bytes = [], [], []
        for row in data.rows:
            start = time.perf_counter()
            sample = family.load_sample(row, config.data.base_path)
            decode_s.append(time.perf_counter() - start)
            shared = {k: v for k, v in sample.items() if v is not None}
            inputs = (shared, {"prompt": shared.pop("prompt")}, {})
            shared.pop("negative_prompt", None)
            start = time.perf_counter()
            with torch.no_grad():
                for unit in pipe.units:
                    inputs = pipe.unit_runner(unit, pipe, *inputs)
            v2_s.append(time.perf_counter() - start)
            buffer = io.BytesIO()
            torch.save(inputs, buffer)  # what DiffSynth's sft:data_process writes per sample
            pth_bytes.append(buffer.tell())
        report = preprocess(config, progress=False)
        cache_bytes = report.bytes_written / max(1, report.computed)
    decode, v2 = statistics.median(decode_s), statistics.median(v2_s)
    print(
        f"clips {args.clips} x {args.frames} frames at {args.side}x{args.side} (tiny Wan, CPU, "
        "1 thread)"
    )
    print(
        f"(a) decode + crop: {decode * 1e3:.1f} ms per clip ({args.frames / decode:.0f} frames/s)"
    )
    print(f"(b) V2 units (DiffSynth's, tiny models): {v2 * 1e3:.1f} ms per clip")
    print(
        f"    decode share of stage-1 work per clip if not overlapped: {decode / (decode + v2):.2f}"
    )
    print(
        f"(c) bytes per clip: splitstage cache {cache_bytes / 1e3:.1f} kB, DiffSynth .pth "
        f"{statistics.median(pth_bytes) / 1e3:.1f} kB "
        f"(ratio {statistics.median(pth_bytes) / cache_bytes:.1f}x); preprocess "
        f"{report.computed} clips in {report.seconds:.1f} s"
    )
    print(
        f"(d) stage 1 vs V2 alone: {sum(v2_s):.2f} s of V2 units / {report.seconds:.2f} s of "
        f"preprocess = {sum(v2_s) / report.seconds:.2f} (1.0: decoding fully hidden; model "
        "loads and shard writes count against it)"
    )


if __name__ == "__main__":
    main()
