#!/usr/bin/env bash
# Train on this machine: ./run_train.sh [--section.field value ...]
#   NGPU         processes to start (default: the GPUs present, else 1)
#   CONFIG_FILE  TOML preset (default: train_configs/debug_model.toml)
#   LOG_RANK     ranks whose output is shown, comma-separated (default: 0)
set -euo pipefail

if [ -z "${NGPU:-}" ]; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "${NGPU:-0}" -gt 0 ] || NGPU=1
fi
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python}

for arg in "$@"; do
    if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
        exec "$PYTHON" -m torchtitan.train --help
    fi
done

# Check the config first: a worker's error would otherwise reach the user wrapped in torchrun's traceback.
WORLD_SIZE=$NGPU RANK=0 "$PYTHON" -m torchtitan.config --job.config_file "$CONFIG_FILE" "$@"

# SIGUSR1 is forwarded too (torchrun does not by default): it asks the trainer to checkpoint and stop.
exec torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 120 \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@"
