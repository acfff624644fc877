"""The shared RoPE: both channel conventions, forward and hand-written backward against plain autograd."""

import pytest
import torch

from torchtitan.models.shared.rope import apply_rope, rope_frequencies, rope_table


def reference_rope(x: torch.Tensor, table: torch.Tensor, convention: str) -> torch.Tensor:
    """Rotation as a matrix product per channel pair, differentiated by autograd."""
    cos, sin = table[: x.shape[1], None, :, 0], table[: x.shape[1], None, :, 1]
    half = x.shape[-1] // 2
    if convention == "pairs":
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., :half], x[..., half:]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if convention == "pairs":
        return torch.stack([ra, rb], dim=-1).flatten(-2)
    return torch.cat([ra, rb], dim=-1)


@pytest.mark.parametrize("convention", ["pairs", "halves"])
def test_forward_and_backward_match_autograd_through_a_plain_reference(convention):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    table = rope_table(rope_frequencies(32, 10000.0), 64)
    x = torch.randn(2, 48, 3, 32, generator=gen, requires_grad=True)
    grad = torch.randn(2, 48, 3, 32, generator=gen)
    ours = apply_rope(x, table, convention)
    expected = reference_rope(x, table, convention)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    (got,) = torch.autograd.grad(ours, x, grad)
    (want,) = torch.autograd.grad(expected, x, grad)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_conventions_differ_and_a_wrong_backward_sign_would_show():
    table = rope_table(rope_frequencies(8, 10000.0), 16)
    x = torch.randn(1, 16, 1, 8, dtype=torch.float64, requires_grad=True)
    assert not torch.allclose(apply_rope(x, table, "pairs"), apply_rope(x, table, "halves"))
    for convention in ("pairs", "halves"):
        assert torch.autograd.gradcheck(lambda t: apply_rope(t, table.double(), convention), x)


def test_positions_index_the_table_per_token():
    table = rope_table(rope_frequencies(8, 10000.0), 32)
    x = torch.randn(2, 6, 1, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [5, 6, 7, 8, 9, 10]])  # two documents in row 0
    out = apply_rope(x, table, "halves", positions=positions)
    torch.testing.assert_close(out[0, 3:], apply_rope(x[:1, 3:], table, "halves")[0])
    torch.testing.assert_close(out[1], apply_rope(torch.cat([torch.zeros(1, 5, 1, 8), x[1:]], 1), table,
                                                  "halves")[0, 5:])
