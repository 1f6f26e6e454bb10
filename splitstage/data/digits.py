"""The demo data set: scikit-learn's bundled handwritten digits as captioned PNGs (no download).

`write_digits_dataset` turns the 1,797 8x8 images of `sklearn.datasets.load_digits` into
size x size RGB PNGs (white ink on black, bicubic upscaling) plus a DiffSynth-style
`metadata.csv` with `image,prompt` columns. Output bytes are deterministic: the same call twice
writes identical files.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CAPTION_TEMPLATES = (
    "a handwritten digit {word}",
    "the number {digit} written by hand",
    "a handwritten {word} on a black background",
    "the digit {digit}, handwritten",
    "a scanned handwritten number {word}",
)


def digit_caption(index: int, label: int) -> str:
    """Caption of sample `index` showing digit `label`; the template varies with the index."""
    template = CAPTION_TEMPLATES[index % len(CAPTION_TEMPLATES)]
    return template.format(word=DIGIT_WORDS[label], digit=label)


def digit_image(pixels: np.ndarray, size: int) -> Image.Image:
    """An 8x8 array of 0..16 ink values -> size x size RGB image."""
    gray = np.clip(np.rint(pixels * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    img = Image.fromarray(gray)
    if size != gray.shape[0]:
        img = img.resize((size, size), Image.Resampling.BICUBIC)
    return img.convert("RGB")


def write_digits_dataset(out_dir: str | Path, limit: int | None = None, size: int = 64) -> int:
    """Write images/NNNNN.png and metadata.csv under out_dir; return the number of samples."""
    from sklearn.datasets import load_digits

    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if size < 8:
        raise ValueError(f"size must be >= 8 pixels, got {size}")
    digits = load_digits()
    count = len(digits.images) if limit is None else min(limit, len(digits.images))
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    with (out / "metadata.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["image", "prompt"])
        for i in range(count):
            label = int(digits.target[i])
            name = f"images/{i:05d}.png"
            digit_image(digits.images[i], size).save(out / name, format="PNG", optimize=False)
            writer.writerow([name, digit_caption(i, label)])
    return count
