#!/usr/bin/env bash
# The one-command GPU check (scripts/gpu_check.py does the work): from the repository root, on the machine's own
# Python ($PYTHON, else python3). Arguments go to gpu_check.py (--budget, --out, --logs, --plan).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
