"""Image files -> pixels: each file decodes to the right pixels or raises one DataError line.

`open_image` is the single decode path (used by `data.load_sample`, `data.decode_image` and
`load_metadata(check_images=True)`); it returns a loaded, upright image in one of two modes:

- "RGB" (8 bits a channel) for every 8-bit image: L, 1, P, RGB, RGBX, CMYK, YCbCr, HSV;
- "F" (float32 grayscale in [0, 1]) for high-bit-depth grayscale, keeping its precision.

Choices (the same for every file, so a sample's pixels depend only on its bytes):

- 16-bit grayscale (modes I;16, I;16B, I;16L, I;16N; 16-bit PNG, TIFF, PGM): decoded straight to
  float, full range 0..65535 -> [0, 1] -> [-1, 1], resized in float: no 8-bit step. 32-bit
  integer images (mode I) are read the same way when every value fits 0..65535 (Pillow also uses
  I for 16-bit data); values outside it are refused, since their range cannot be known.
- float images (mode F, e.g. float TIFF): used as-is when every value is in [0, 1]; values outside
  it, NaN or infinity are refused (is it 0..1, 0..255, HDR? the file does not say).
- 16-bit colour PNG/TIFF: Pillow has no 16-bit colour mode and reads them at 8 bits a channel
  (high byte: the scaling is right, only precision is lost); a warning says so, once a process.
- transparency (RGBA, LA, PA, RGBa, P or L/RGB with a transparent colour, 16-bit gray with one):
  composited onto white, so the colour a transparent pixel happens to store never shows and
  half-transparent edges blend as they look on a white page.
- EXIF orientation is applied (`ImageOps.exif_transpose`): a photo stored rotated with an
  Orientation tag is trained upright, as viewers show it.
- multi-frame files (animated GIF/PNG/WebP, multi-page TIFF): the first frame only (video
  families read animated GIF/PNG/WebP as clips instead: `splitstage.data.clips`).
- CMYK is converted with Pillow's formula (Adobe-inverted JPEGs are handled by the decoder); ICC
  profiles are not applied: pixel values are taken as sRGB.
- EPS files are not opened (Pillow would run Ghostscript on them): "unknown image format".
- a file Pillow does not open in which PyAV finds a video stream is named as a video (its
  container), whatever its suffix, not as a corrupt image.
- refused, naming the row, the file and the fix: LAB (Pillow's LAB->RGB is wrong), modes Pillow
  cannot convert, zero width or height, and decompression bombs: a header claiming more than
  `PIL.Image.MAX_IMAGE_PIXELS` pixels is refused before decoding (Pillow warns between 1x and
  2x that limit and raises above; both are refused here), as is a file over
  `MAX_IMAGE_FILE_BYTES`; and any file Pillow warns about while decoding it (truncated data,
  corrupt EXIF or TIFF tags), since its pixels or orientation may be wrong.
"""

from __future__ import annotations

import io
import logging
import re
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from splitstage.data.media_kind import video_container
from splitstage.splitter import UserError

if TYPE_CHECKING:
    import torch

DECODE_VERSION = "splitstage-decode-v3"  # bump when the pixels a file decodes to change
MAX_IMAGE_FILE_BYTES = 1 << 30  # 1 GiB: far above any image within the pixel limit
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")
REEXPORT = "re-export it as an 8- or 16-bit PNG"
NOT_IMAGE = "give an image here, or train clips with a family that takes video (docs/video.md)"

log = logging.getLogger(__name__)
_OPEN_LOCK = threading.Lock()  # warnings.catch_warnings is process-wide: one decode at a time
_warned_16bit_colour = False


class DataError(UserError, ValueError):
    """Bad data set content; the message names the file, the row and the fix."""


def _refuse(where: str, path: Path | str, what: str) -> DataError:
    return DataError(f"{where}: image file {path} {what}")


def _exif(where: str, path: Path | str, reason: object) -> DataError:
    what = f"has corrupt EXIF data ({reason}), so its orientation is unknown; re-save it without "
    return _refuse(where, path, what + "EXIF or remove the row")


def _corrupt(where: str, path: Path | str, exc: BaseException, data: bytes = b"") -> DataError:
    reason = (str(exc) or type(exc).__name__).strip()
    if isinstance(exc, UnidentifiedImageError):
        if container := video_container(data):  # by content, whatever the file's name
            return _refuse(where, path, f"is a video ({container}), not an image; {NOT_IMAGE}")
        reason = "unknown image format"
    if "EXIF" in reason:
        return _exif(where, path, reason)
    what = f"is corrupt or not an image ({reason}); {REEXPORT} or remove the row"
    return _refuse(where, path, what)


def _bomb(where: str, path: Path | str, pixels: int | None, limit: int) -> DataError:
    claimed = f"{pixels:,} pixels" if pixels else f"more than {limit:,} pixels"
    return _refuse(
        where,
        path,
        f"claims {claimed} in its header, over the limit of {limit:,} (PIL.Image.MAX_IMAGE_PIXELS, "
        "a decompression-bomb guard); downscale the image or remove the row",
    )


def check_file_size(where: str, path: Path | str, size: int) -> None:
    """Refuse an image file over MAX_IMAGE_FILE_BYTES before reading it."""
    if size > MAX_IMAGE_FILE_BYTES:
        raise _refuse(
            where,
            path,
            f"is {size:,} bytes, over the {MAX_IMAGE_FILE_BYTES:,}-byte limit for one image; "
            "downscale or recompress it, or remove the row",
        )


def open_image(data: bytes, where: str, path: Path | str) -> Image.Image:
    """Decode image bytes to a loaded, upright first frame: mode "RGB", or "F" in [0, 1].

    `where` ("metadata.csv row 3") and `path` only name the sample in a DataError. Any warning
    Pillow gives while decoding (truncated data, corrupt EXIF or TIFF tags) refuses the file:
    the pixels or the orientation may be wrong. Warnings filters are process-wide, so decoding
    holds a lock: decode in processes, not threads, for parallelism.
    """
    limit = Image.MAX_IMAGE_PIXELS
    with _OPEN_LOCK, warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("default", DeprecationWarning)  # Pillow's API notices: not data
        try:
            img = Image.open(io.BytesIO(data), formats=_formats())
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            found = re.search(r"\((\d+) pixels\)", str(exc))  # Pillow's message has the count
            raise _bomb(where, path, int(found.group(1)) if found else None, limit or 0) from exc
        except Exception as exc:  # Pillow's plugins raise many types on malformed files
            raise _corrupt(where, path, exc, data) from exc
        try:
            return _decode(img, where, path, limit)
        except DataError:
            raise
        except Exception as exc:
            raise _corrupt(where, path, exc) from exc
        finally:
            img.close()


def _formats() -> tuple[str, ...]:
    """Every format Pillow opens but EPS, whose decoder runs Ghostscript on the file."""
    Image.init()
    return tuple(name for name in Image.OPEN if name != "EPS")


def _decode(img: Image.Image, where: str, path: Path | str, limit: int | None) -> Image.Image:
    if img.width <= 0 or img.height <= 0:
        raise _refuse(where, path, f"is {img.width}x{img.height} pixels; {REEXPORT}")
    if limit and img.width * img.height > limit:  # does not rely on the warnings filter
        raise _bomb(where, path, img.width * img.height, limit)
    _note_16bit_colour(img, where, path)
    img.load()  # the first frame: multi-frame files are not seeked
    try:
        ImageOps.exif_transpose(img, in_place=True)
    except Exception as exc:
        raise _exif(where, path, str(exc).strip()) from exc
    result = normalize(img, where, path)
    return result.copy() if result is img else result


def _note_16bit_colour(img: Image.Image, where: str, path: Path | str) -> None:
    """Warn (once a process) that a 16-bit colour file is read at 8 bits a channel."""
    global _warned_16bit_colour
    if _warned_16bit_colour or img.mode in (*SIXTEEN_BIT_MODES, "I", "F"):
        return
    for tile in getattr(img, "tile", None) or ():
        args = getattr(tile, "args", None)
        rawmode = args if isinstance(args, str) else (args or ("",))[0]
        if isinstance(rawmode, str) and ";16" in rawmode and img.format in ("PNG", "TIFF"):
            _warned_16bit_colour = True
            log.warning(
                "%s: image file %s is 16-bit colour; Pillow reads 16-bit colour images at 8 "
                "bits a channel (the scaling is kept, precision is 8 bits); this is said once",
                where,
                path,
            )
            return


def normalize(
    img: Image.Image, where: str = "image", path: Path | str = "(in memory)"
) -> Image.Image:
    """A decoded image in any Pillow mode -> "RGB" (8-bit) or "F" (gray, [0, 1]); see module doc."""
    mode = img.mode
    if mode in SIXTEEN_BIT_MODES or mode == "I":
        raw = np.asarray(img)
        low, high = int(raw.min()), int(raw.max())
        if low < 0 or high > 65535:
            raise _refuse(
                where,
                path,
                f"is an integer image (mode {mode}) with values {low}..{high}, outside the 16-bit "
                f"range 0..65535, so its range cannot be known; {REEXPORT}",
            )
        gray = raw.astype(np.float32) / 65535.0
        key = img.info.get("transparency")
        if isinstance(key, int):  # a transparent gray value: composite onto white
            gray[raw == key] = 1.0
        return Image.fromarray(gray)
    if mode == "F":
        values = np.asarray(img, dtype=np.float32)
        if not np.isfinite(values).all():
            raise _refuse(
                where, path, f"is a float image (mode F) with NaN or infinite values; {REEXPORT}"
            )
        low, high = float(values.min()), float(values.max())
        if low < 0.0 or high > 1.0:
            raise _refuse(
                where,
                path,
                f"is a float image (mode F) with values {low:g}..{high:g}, outside [0, 1], so its "
                f"range cannot be known; scale it to [0, 1] or {REEXPORT}",
            )
        return img.copy()
    if mode == "LAB":
        raise _refuse(
            where, path, "is in LAB colour (mode LAB); re-export it as RGB (sRGB) PNG or JPEG"
        )
    try:
        if img.has_transparency_data:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return img.convert("RGB")
    except ValueError as exc:
        raise _refuse(
            where,
            path,
            f"has image mode {mode}, which cannot be converted to RGB ({exc}); {REEXPORT}",
        ) from exc


def to_rgb8(img: Image.Image) -> Image.Image:
    """A normalized image as 8-bit RGB (float gray is rounded to 8 bits: for 8-bit consumers)."""
    if img.mode == "RGB":
        return img
    gray = np.asarray(img, dtype=np.float32).clip(0.0, 1.0)
    return Image.fromarray(np.rint(gray * 255.0).astype(np.uint8)).convert("RGB")


RESIZE_RULES = ("diffusers", "diffsynth")  # how stage 1 scales an image before the center crop


def center_crop_box(
    source_width: int, source_height: int, height: int, width: int, rule: str = "diffusers"
) -> tuple[int, int, int, int]:
    """(scaled width, scaled height, left, top) of covering height x width, then center-cropping
    where torchvision's `center_crop` cuts (offsets rounded half to even).

    'diffusers': torchvision `Resize(resolution)` as diffusers' text-to-image examples use it
    (the covering side exactly, the other truncated: for a square, the shorter side to the
    resolution); 'diffsynth': DiffSynth's `ImageCropAndResize` (both sides rounded).
    """
    if rule not in RESIZE_RULES:
        raise ValueError(f"resize rule {rule!r}: use one of {', '.join(RESIZE_RULES)}")
    if rule == "diffsynth":
        scale = max(width / source_width, height / source_height)
        new_w, new_h = round(source_width * scale), round(source_height * scale)
    elif height / source_height >= width / source_width:  # the height covers: width follows
        new_w, new_h = int(height * source_width / source_height), height
    else:
        new_w, new_h = width, int(width * source_height / source_width)
    new_w, new_h = max(width, new_w), max(height, new_h)  # a float step below: never short
    return new_w, new_h, int(round((new_w - width) / 2.0)), int(round((new_h - height) / 2.0))


def center_crop_resize(
    img: Image.Image, height: int, width: int, rule: str = "diffusers"
) -> Image.Image:
    """Scale to cover height x width with bilinear filtering (as torchvision resizes a PIL
    image for DiffSynth and diffusers' examples), then crop the center; see center_crop_box."""
    if img.size == (width, height):
        return img
    new_w, new_h, left, top = center_crop_box(img.width, img.height, height, width, rule)
    img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
    return img.crop((left, top, left + width, top + height))


def image_to_tensor(img: Image.Image) -> torch.Tensor:
    """PIL image -> float tensor [3,H,W] in [-1,1].

    8-bit RGB maps x -> x/127.5 - 1; a float "F" image (from a 16-bit or float file) maps
    x in [0, 1] -> 2x - 1 (clipped), replicated to 3 channels. Any other
    mode is first normalized as open_image does (alpha onto white, 16-bit scaled, ...).
    """
    import torch  # the one use here: reading and checking image files needs no torch

    if img.mode not in ("RGB", "F"):
        img = normalize(img)
    if img.mode == "F":
        gray = np.asarray(img, dtype=np.float32).clip(0.0, 1.0)
        return (torch.from_numpy(gray.copy()) * 2.0 - 1.0).unsqueeze(0).repeat(3, 1, 1)
    array = np.asarray(img, dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 127.5 - 1.0
