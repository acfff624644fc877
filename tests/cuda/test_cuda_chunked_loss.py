"""The chunked head's compiled loop on the GPU (compile.components "loss"), against the plain path.

Inductor on CUDA (torch 2.11) once compiled this loop's slice writes into all-zero gradients while CPU inductor
was right; the CPU's compiled path is covered by tests/integration/test_chunked_loss_training.py.
"""

import pytest
import torch

from tests.unit.test_chunked_cross_entropy import close, plain_and_chunked

pytestmark = pytest.mark.cuda


def test_the_compiled_chunk_loop_equals_the_plain_path():
    plain, chunked = plain_and_chunked(250, 64, 2003, 64, compiled=True, device="cuda")
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-5, atol=0)
    assert plain[1].abs().sum() > 0 and plain[2].abs().sum() > 0
    close(chunked[1], plain[1])
    close(chunked[2], plain[2])
