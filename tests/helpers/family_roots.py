"""Data sets for the families that take a reference beside each sample: captioned digits with a
reference image per row (FLUX.1 Kontext), and real short clips with an edit_image on one row
(Wan image-to-video)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tests.helpers.video_files import write_video


def add_reference_images(data: Path, size: int = 64) -> None:
    """Give each row of data/metadata.csv an edit_image: its image mirrored, `size` px square."""
    from PIL import Image, ImageOps

    (data / "ref").mkdir()
    with (data / "metadata.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        name = f"ref/{Path(row['image']).stem}.png"
        image = Image.open(data / row["image"]).convert("RGB").resize((size, size))
        ImageOps.mirror(image).save(data / name)
        row["edit_image"] = name
    with (data / "metadata.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["image", "prompt", "edit_image"])
        writer.writeheader()
        writer.writerows(rows)


def write_clips_dataset(data: Path, count: int = 2) -> None:
    """`count` real short videos (PyAV, h264) captioned in data/metadata.jsonl, the second row
    with an edit_image (a PNG) as its conditioning frame instead of its first frame."""
    import torch
    from PIL import Image

    rows = []
    for index in range(count):
        name = f"clips/clip{index}.mp4"
        write_video(data / name, 10 + 2 * index, rate=8 + index)
        rows.append({"video": name, "prompt": f"clip {index} of moving squares"})
    pixels = torch.rand(48, 80, 3, generator=torch.Generator().manual_seed(0))
    Image.fromarray((pixels * 255).byte().numpy()).save(data / "first.png")
    rows[min(1, count - 1)]["edit_image"] = "first.png"
    (data / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
