"""Run several trainer jobs one after another in the same torchrun processes (one launch per matrix).

Started as ``torchrun ... -m tests.integration.matrix_worker SPEC.json``; SPEC holds a list of
``{"name": ..., "argv": [...], "entry": "module:function"}``. Each job goes through its entry (default
``torchtitan.train:main``, which returns the exit code) as a launch of its own would, except that the
default process group is kept for the next job (joining a second time in one process can hang on the
launcher's store); each job still builds its own meshes. The exit codes go to
``SPEC.codes.json``; the first job that fails ends the matrix, so every rank stops at the same place.
"""

import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def run(spec_path: Path) -> int:
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    codes, seconds = {}, {}
    for job in json.loads(spec_path.read_text()):
        torch._dynamo.reset()  # a fresh compile per job, as in a launch of its own
        module, function = job.get("entry", "torchtitan.train:main").split(":")
        start = time.perf_counter()
        codes[job["name"]] = code = getattr(importlib.import_module(module), function)(job["argv"])
        seconds[job["name"]] = round(time.perf_counter() - start, 1)
        if os.environ.get("RANK", "0") == "0":  # after each job: a later job's crash keeps the earlier codes
            spec_path.with_suffix(".codes.json").write_text(json.dumps(codes))
            spec_path.with_suffix(".times.json").write_text(json.dumps(seconds, indent=0))
        if code != 0:
            break
    dist.destroy_process_group = destroy
    if dist.is_initialized():
        dist.destroy_process_group()
    return max(codes.values(), default=0)


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
