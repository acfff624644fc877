"""Validate a config without training: ``python -m torchtitan.config --job.config_file X.toml [flags]``.

Exit 0 when valid, 2 with a one-line error otherwise. The world size comes from WORLD_SIZE
(default 1), so launch scripts can check a config before starting their workers.
"""

import sys

from torchtitan.config import ConfigError


def main() -> int:
    from torchtitan.config_check import load_and_validate

    try:
        load_and_validate(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
