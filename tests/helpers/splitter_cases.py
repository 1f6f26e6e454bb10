"""Pipelines shaped like DiffSynth-Studio's, shared by splitter tests and benchmarks."""

from splitstage.splitter import Pipeline, Unit


def qwen_image_like() -> Pipeline:
    """Qwen-Image's training units as DiffSynth-Studio declares them (fields only)."""
    return Pipeline(
        name="qwen-image",
        units=(
            Unit("ShapeChecker", ("height", "width"), output_params=("height", "width")),
            Unit(
                "NoiseInitializer",
                ("height", "width", "seed", "rand_device"),
                output_params=("noise",),
            ),
            Unit(
                "InputImageEmbedder",
                ("input_image", "noise", "tiled", "tile_size", "tile_stride"),
                output_params=("latents", "input_latents"),
                onload_model_names=("vae",),
            ),
            Unit(
                "PromptEmbedder",
                ("edit_image",),
                input_params_posi={"prompt": "prompt"},
                input_params_nega={"prompt": "negative_prompt"},
                output_params=("prompt_emb", "prompt_emb_mask"),
                onload_model_names=("text_encoder",),
            ),
            Unit(
                "EditImageEmbedder",
                ("edit_image", "tiled", "tile_size", "tile_stride"),
                output_params=("edit_latents", "edit_image"),
                onload_model_names=("vae",),
            ),
        ),
        model_fn_params=("latents", "timestep", "prompt_emb", "prompt_emb_mask", "edit_latents"),
        loss_params=("input_latents",),
        in_iteration_models=("dit",),
    )


def demo_like() -> Pipeline:
    """The demo text-to-image pipeline: caption dropout is per-step and acts on embeddings."""
    return Pipeline(
        name="demo",
        units=(
            Unit("ShapeCheck", ("height", "width"), output_params=("height", "width")),
            Unit(
                "PromptEmbedder",
                input_params_posi={"prompt": "prompt"},
                output_params=(
                    "prompt_emb",
                    "prompt_mask",
                    "empty_prompt_emb",
                    "empty_prompt_mask",
                ),
                onload_model_names=("text_encoder",),
            ),
            Unit(
                "ImageEncoder",
                ("image", "height", "width"),
                output_params=("input_latents",),
                onload_model_names=("vae",),
            ),
            Unit(
                "CaptionDropout",
                ("prompt_emb", "prompt_mask", "empty_prompt_emb", "empty_prompt_mask"),
                output_params=("prompt_emb", "prompt_mask"),
                per_step=True,
            ),
        ),
        model_fn_params=("latents", "timestep", "prompt_emb", "prompt_mask"),
        loss_params=("input_latents",),
        in_iteration_models=("dit",),
        step_params=("latents", "timestep", "noise"),
    )
