"""`validation.reference_images`: checked against the family, read and decoded, sized per sample.

Each prompt's reference images are files relative to `data.base_path` or URLs (opened with the
data's storage options). They are refused in one line before any model loads when the family
takes none, takes fewer, or cannot sample with them, or when a file is missing or undecodable;
their content (sha256) goes into the validation-prompts key, so a changed image is encoded again.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

from PIL import Image

from splitstage.config.job import ConfigError
from splitstage.config.monitoring import size_label
from splitstage.data.images import DataError, check_file_size, open_image
from splitstage.data.references import ReferenceImages
from splitstage.data.source import DataSource, open_data_source, relative_key
from splitstage.pipelines.family import Family

FIELD = "validation.reference_images"
Size = tuple[int, int]  # (height, width) pixels


@dataclass(frozen=True)
class Reference:
    """One validation reference image: where it is (as messages name it), its bytes' sha256, and
    the decoded image."""

    shown: str
    digest: str
    image: Image.Image


def check_validation_references(family: Family) -> list[list[Reference]]:
    """Each prompt's reference images, read and decoded (empty when none are given); one
    ConfigError / DataError line for what cannot sample: call it before any model loads."""
    settings = family.config.validation
    given = settings.references()
    if not settings.enabled or not given:
        return []
    family.reference_models()  # refuses a family that takes none or cannot sample with them
    rule = reference_rule(family)
    for index, paths in enumerate(given):
        if len(paths) > rule.most:
            raise ConfigError(
                f"{FIELD}[{index}] names {len(paths)} images; the {family.name} family takes at "
                f"most {rule.most} per prompt: keep {rule.most}"
            )
    source = open_data_source(family.config.data)
    return [
        [read_reference(source, path, f"{FIELD}[{index}]") for path in paths]
        for index, paths in enumerate(given)
    ]


def read_reference(source: DataSource, path: str, where: str) -> Reference:
    """One reference file (relative to the data's base, or a URL / absolute path), decoded;
    DataError naming `where` and the file when it cannot be read or is not an image."""
    if "://" in path or path.startswith("/"):
        source, rel = source.locate(path)
    else:
        rel = relative_key(path)
    shown = source.display(rel)
    try:
        data = source.read(rel)
    except FileNotFoundError:
        raise DataError(
            f"{where}: image file {shown} does not exist; fix the path (relative to "
            "data.base_path) or the URL"
        ) from None
    except Exception as exc:  # noqa: BLE001 - storage errors of any filesystem, named once
        if source.local:
            reason = getattr(exc, "strerror", None) or exc
            raise DataError(f"{where}: cannot read image file {shown}: {reason}") from None
        raise source.failure(f"read image file ({where})", shown, exc) from None
    check_file_size(where, shown, len(data))
    image = open_image(data, where, shown)
    return Reference(shown, hashlib.sha256(data).hexdigest(), image)


def reference_rule(family: Family) -> ReferenceImages:
    """How the family sizes reference images (the target's size when it states no rule)."""
    return family.reference_images or ReferenceImages()


def reference_sizes(family: Family) -> list[Size]:
    """The sample sizes the references are encoded at: `validation.sizes`, else the square."""
    sizes = family.config.validation.sample_sizes() or [None]
    return [family.sample_size(size) for size in sizes]


def reference_key(family: Family, references: list[list[Reference]]) -> dict[str, Any]:
    """What the encoded references depend on (beside their models' fingerprints), for the
    validation-prompts key: the images' content, how they are sized, at which sample sizes, and
    the units that encode them."""
    return {
        "images": [[ref.digest for ref in refs] for refs in references],
        "rule": asdict(reference_rule(family)),
        "sizes": [size_label(*size) for size in reference_sizes(family)],
        "units": [unit.spec.to_dict() for unit in family.reference_units()],
    }


def reference_tensors(
    family: Family, references: list[list[Reference]], target: Size
) -> list[list[Any]]:
    """Each prompt's references as the family's reference step takes them beside a sample of
    `target` size (`Family.validation_reference`: by default [3, H, W] in [-1, 1], sized by
    its rule and cropped to it, as training crops them to the target's bucket)."""
    return [[family.validation_reference(ref.image, target) for ref in refs] for refs in references]
