"""The job config: one TOML file validated by typed groups (torch-free)."""
