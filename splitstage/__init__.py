"""splitstage: two-stage split training for diffusion models, orchestrated by Prefect."""

__version__ = "0.1.0"
