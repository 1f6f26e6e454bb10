#!/usr/bin/env bash
# The prepared GPU check in one command: `bash bench/gpu_check.sh [--cpu-smoke] [--budget S]
# [--only levers]`.
# Runs bench/gpu_check.py with the repo's .venv python when there is one, else python3; it
# prints one markdown table and exits 0 (one line and exit 0 where there is no CUDA).
cd "$(dirname "$0")/.." || exit 1
PYTHON=.venv/bin/python
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" bench/gpu_check.py "$@"
