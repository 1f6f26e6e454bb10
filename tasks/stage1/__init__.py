"""Stage 1: run V2 over the data set once and write the cache."""
