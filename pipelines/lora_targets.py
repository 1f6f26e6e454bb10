"""LoRA target lists that more than one family uses (torch-free: config groups import them).

A family folder never imports another family folder: a list two families share lives here.
"""

from __future__ import annotations

# The source text's Qwen-Image LoRA targets (DiffSynth-Studio's split-training example): both
# attention streams, the image / text MLP outputs and the modulation layers. The diffsynth
# family's QwenImagePipeline and the diffusers `qwenimage` family default to this one list.
QWEN_IMAGE_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_out.0",
    "to_add_out",
    "img_mlp.net.2",
    "img_mod.1",
    "txt_mlp.net.2",
    "txt_mod.1",
)
