"""DiffSynth-Studio pipelines executed on the seam: their units, model_fn and loss do the math."""
