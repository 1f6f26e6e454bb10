"""Stage 2's launcher side: the lean process that holds a run and starts torchrun (no torch)."""
