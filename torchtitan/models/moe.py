"""The import path docs/extending.md gave before torchtitan.models.shared.moe moved into its room: the same module
under its old name, so code written against it keeps working (tests/unit/test_import_graph.py imports each)."""

import sys

from torchtitan.models.shared import moe

sys.modules[__name__] = moe
