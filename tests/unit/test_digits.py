"""The digits demo data set: readable by load_metadata, captioned, byte-for-byte reproducible."""

from PIL import Image

from splitstage.data.dataset import load_metadata, load_sample
from splitstage.data.digits import write_digits_dataset


def _files(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_digits_subset_is_loadable_and_deterministic(tmp_path):
    assert write_digits_dataset(tmp_path / "a", limit=20) == 20
    rows = load_metadata(tmp_path / "a")
    assert len(rows) == 20 and [r.line for r in rows] == list(range(2, 22))
    assert rows[0].prompt == "a handwritten digit zero"
    assert rows[3].prompt == "the digit 3, handwritten"
    assert len({r.prompt.split()[0] for r in rows}) > 1  # captions vary
    with Image.open(tmp_path / "a" / rows[3].image) as img:
        assert (img.size, img.mode) == ((64, 64), "RGB")
    image = load_sample(rows[3], tmp_path / "a")["image"]
    assert image.shape == (3, 64, 64) and image.min() >= -1 and image.max() <= 1

    write_digits_dataset(tmp_path / "b", limit=20)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert write_digits_dataset(tmp_path / "c", limit=3, size=32) == 3
    with Image.open(tmp_path / "c" / "images" / "00000.png") as img:
        assert img.size == (32, 32)
