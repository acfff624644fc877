import subprocess
import sys

import pytest

# Allocate, touch and free a 256 MiB tensor repeatedly; report the page faults of the last four rounds
# (glibc grows the heap for the first few, until freed blocks coalesce into ones the next request fits).
_SCRIPT = """
import resource, sys, torch
from torchtitan.components.metrics.host_memory import keep_freed_host_memory
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
for _ in range(12):
    torch.ones(64 * 2**20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    torch.ones(64 * 2**20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc settings")
def test_freed_host_memory_is_reused_without_page_faults():
    faults = {mode: int(subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("default", "keep")}
    pages = 4 * 256 * 2**20 // 4096
    assert faults["default"] > pages // 2  # glibc unmapped each free and faulted the pages in again
    assert faults["keep"] < pages // 100
