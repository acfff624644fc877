"""Activation checkpointing keeps the numbers and holds less memory for backward, in the expected order."""

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.shared.decoder import Decoder
from torchtitan.models.shared.seeded_init import canonical_name


class HeldForBackward(TorchDispatchMode):
    """Remembers every tensor an op produces; afterwards, the bytes of those still alive."""

    def __init__(self):
        super().__init__()
        self.storages = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.storages.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        return out

    def live_bytes(self) -> int:
        seen = {}
        for ref, nbytes in self.storages:
            if not ref.expired():
                seen[ref.cdata] = nbytes
        return sum(seen.values())


def run(mode: str, option: str, tokens: torch.Tensor):
    args = llama3_flavors["debugmodel"].finalize(2048, tokens.shape[1])
    with torch.device("meta"):
        model = Decoder(args)
    apply_ac(model, mode, option, preserve_rng_state=False)
    model.to_empty(device="cpu")
    model.init_weights(0)
    tracker = HeldForBackward()
    with tracker:
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    del logits
    held = tracker.live_bytes()
    loss.backward()
    grads = {canonical_name(n): p.grad for n, p in model.named_parameters()}
    return loss.item(), grads, held


def test_ac_modes_match_and_hold_less_memory():
    tokens = torch.randint(0, 2048, (2, 128), generator=torch.Generator().manual_seed(torch.seed() % 2**31))
    base_loss, base_grads, none_bytes = run("none", "2", tokens)
    held = {}
    for mode, option in [("selective", "2"), ("selective", "op"), ("full", "1")]:
        loss, grads, held[(mode, option)] = run(mode, option, tokens)
        assert loss == pytest.approx(base_loss, rel=1e-6), (mode, option)
        for name, grad in base_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=f"{mode}/{option} {name}")
    full = held[("full", "1")]
    assert none_bytes > held[("selective", "2")] > full
    assert none_bytes > held[("selective", "op")] > full
