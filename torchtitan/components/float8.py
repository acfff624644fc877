"""float8 training of Linear layers through torchao, registered as the model converter "float8"."""

import dataclasses

import torch._inductor.config
from torch import nn

from torchtitan.distributed.device import device_type
from torchtitan.log import logger, quiet_torchao_import
from torchtitan.protocols.model_converter import register_model_converter


def _import_torchao_float8():
    quiet_torchao_import()
    from torchao import float8
    from torchao.float8.float8_linear import Float8Linear

    return float8, Float8Linear


class Float8Converter:
    """Swaps nn.Linear for torchao's Float8Linear, except modules named in filter_fqns."""

    def __init__(self, job_config, parallel_dims):
        self.cfg = job_config.quantize.linear.float8
        self.fsdp = parallel_dims.fsdp_enabled
        float8, self._float8_linear = _import_torchao_float8()
        if self.cfg.recipe_name is not None:
            config = float8.Float8LinearConfig.from_recipe_name(self.cfg.recipe_name)
            self.config = dataclasses.replace(config, emulate=self.cfg.emulate)
        else:
            self.config = float8.Float8LinearConfig(
                enable_fsdp_float8_all_gather=self.cfg.enable_fsdp_float8_all_gather and self.fsdp,
                emulate=self.cfg.emulate,
            )
        if self.cfg.recipe_name == "rowwise" and job_config.compile.enable:
            # Inductor otherwise fuses away the rounding to bf16 between the rowwise scaling ops, so compiled
            # scales differ from eager ones; on an H100 (Llama 3 8B dims) that sent the step-1 grad norm to 365
            # instead of 5.2 and the loss to inf by step 3. Emulating the casts keeps eager's numerics.
            torch._inductor.config.emulate_precision_casts = True
            logger.info("float8 rowwise with compile: torch._inductor.config.emulate_precision_casts = True")
        if device_type() == "cpu" and not self.cfg.emulate:
            logger.warning("float8 on CPU: torch._scaled_mm has no fast CPU kernel (about 10^4 times slower than a "
                           "bf16 matmul here); set quantize.linear.float8.emulate = true to keep float8 numerics "
                           "with fast matmuls")
        self.precompute_scales = (
            self.cfg.precompute_float8_dynamic_scale_for_fsdp and self.config.enable_fsdp_float8_all_gather
        )
        self._float8 = float8

    def _keep(self, module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        # float8 matmuls need both dimensions divisible by 16.
        if module.in_features % 16 or module.out_features % 16:
            return False
        if fqn.endswith(("router.gate", "in_proj_a", "in_proj_b")):
            # A MoE router's scores choose the experts, a linear attention's decay and write-strength inputs set
            # how long it remembers: kept in high precision, as the field does.
            return False
        return not any(fqn == f or fqn.startswith(f + ".") or fqn.endswith("." + f) for f in self.cfg.filter_fqns)

    def convert(self, model: nn.Module) -> None:
        self._float8.convert_to_float8_training(model, config=self.config, module_filter_fn=self._keep)
        converted = sum(isinstance(m, self._float8_linear) for m in model.modules())
        logger.info(f"float8: converted {converted} Linear layers (recipe {self.cfg.recipe_name or 'tensorwise'}, "
                    f"kept in high precision: {', '.join(self.cfg.filter_fqns) or 'none'})")

    def init_weights(self, model_part: nn.Module, seed: int) -> None:
        pass  # Float8Linear keeps the Linear's weight; nothing new to initialise

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        if self.precompute_scales:
            for part in model_parts:
                self._float8.precompute_float8_dynamic_scale_for_fsdp(part)


register_model_converter("float8", Float8Converter)
