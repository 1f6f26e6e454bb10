"""Config-only diffusers folders of public models, for memory estimates without a download.

Each subfolder holds what the model's Hub repository holds besides weights and tokenizers:
model_index.json, every component's config.json (values copied from the public configs) and
the scheduler config. `write_config_folder` makes a folder splitstage accepts from one: the
configs, an empty safetensors file per component (a header with no tensors: the memory plan
builds models on the meta device and never reads a weight) and tiny stand-in tokenizers
(`tiny_diffusers`'): every prompt is padded or cut to the family's fixed token count, so the
text tensors have the real models' shapes whatever the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from tests.helpers.tiny_diffusers import clip_tokenizer, qwen_tokenizer, t5_tokenizer

ROOT = Path(__file__).resolve().parent
TOKENIZERS = {  # model_index.json tokenizer class -> the stand-in's builder
    "CLIPTokenizer": clip_tokenizer,
    "T5TokenizerFast": t5_tokenizer,
    "Qwen2Tokenizer": qwen_tokenizer,
}
WEIGHT_FILES = {
    "diffusers": "diffusion_pytorch_model.safetensors",
    "transformers": "model.safetensors",
}


def write_config_folder(model: str, folder: Path) -> Path:
    """`ROOT / model`'s configs at `folder`, with empty weights files and stand-in tokenizers."""
    shutil.copytree(ROOT / model, folder)
    index = json.loads((folder / "model_index.json").read_text())
    for name, entry in index.items():
        if not (isinstance(entry, list) and entry[0] in WEIGHT_FILES):
            continue
        library, class_name = entry
        if (folder / name / "config.json").is_file():
            save_file({}, str(folder / name / WEIGHT_FILES[library]))
        elif class_name in TOKENIZERS:
            TOKENIZERS[class_name]().save_pretrained(folder / name)
    return folder


def configs_digest() -> str:
    """sha256 of every config file here (path and content), first 16 hex digits."""
    digest = hashlib.sha256()
    for path in sorted(ROOT.rglob("*.json")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]
