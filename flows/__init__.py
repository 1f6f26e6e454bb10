"""Prefect flows: split training end to end, preprocess, train, and what they publish."""
