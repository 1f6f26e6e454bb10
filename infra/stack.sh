#!/usr/bin/env bash
# The local stack: `infra/stack.sh up [--s3]`, `infra/stack.sh status`, `infra/stack.sh down`.
# A Prefect server on 127.0.0.1 (free port), work pools, workers, deployments, optional S3 (moto);
# state under .prefect/stack/. The work is done by infra/stack.py with the project's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" infra/stack.py "$@"
