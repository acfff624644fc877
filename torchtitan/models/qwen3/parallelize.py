"""Apply parallelism to a Qwen3 model: TP, then CP, AC, compile and FSDP/DDP."""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.apply_common import apply_ac_compile_and_data_parallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import apply_decoder_tp, enable_async_tp
from torchtitan.models.qwen3.model import Qwen3Model

# The heads dimension of the (batch, seq, heads, head_dim) tensors that QK-norm sees.
_HEADS_DIM = 2


def apply_tp(model: Qwen3Model, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """The shared decoder plan plus QK-norm.

    QK-norm acts on each rank's local heads with the full (replicated) head_dim weight. Declaring
    its input as sharded on the heads dimension makes the weight a replicated DTensor, so its
    gradient, a partial sum over each rank's heads, is all-reduced over the TP ranks. A plain
    weight would keep a different partial gradient on every rank (and, being the only non-DTensor
    parameter, make grad-norm clipping fail on the mix).
    """
    qk_norm = {name: SequenceParallel(sequence_dim=_HEADS_DIM, use_local_output=True)
               for name in ("attention.q_norm", "attention.k_norm")}
    apply_decoder_tp(model, tp_mesh, loss_parallel, extra_block_plan=qk_norm)


def parallelize_qwen3(model: Qwen3Model, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    parallelism = job_config.parallelism
    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.submesh("tp")
        apply_tp(model, tp_mesh, loss_parallel=not parallelism.disable_loss_parallel)
        if parallelism.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)

    return apply_ac_compile_and_data_parallel(model, parallel_dims, job_config)
