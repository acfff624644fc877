"""float8 training of Linear layers through torchao, registered as the model converter "float8".

``quantize.linear.float8.emulate = "auto"`` (the default) rounds to float8 but multiplies in high precision where
the device has no fast float8 matmul, as ``training.mixed_precision_param = "auto"`` picks a dtype the device
computes fast (distributed/precision.py): on a CPU torch._scaled_mm is a slow reference kernel (a 4 x 128 debug
step took 164-177 s against 0.10 s in bf16), so a default of real float8 matmuls there would be a trap.
"""

import dataclasses

import torch
import torch._inductor.config
from torch import nn

from torchtitan.distributed.device import device_type
from torchtitan.hardware import cpu_model
from torchtitan.log import logger, quiet_torchao_import
from torchtitan.protocols.model_converter import register_model_converter

# AMD Instinct architectures with float8 matmuls that torchao uses: MI300 (gfx940-942) and MI350 (gfx950).
ROCM_FLOAT8_ARCHS = ("gfx940", "gfx941", "gfx942", "gfx950")


def float8_matmul_is_fast(device: str) -> tuple[bool, str]:
    """(whether ``device`` ("cpu" or "cuda") has fast float8 matmuls, the device in words), by torchao's own test:
    NVIDIA GPUs of compute capability 8.9 (Ada) or later, AMD MI300 and MI350; CPUs have none."""
    if device != "cuda":
        return False, f"this CPU ({cpu_model()})"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if torch.version.hip:
        arch = props.gcnArchName.split(":")[0]
        return arch in ROCM_FLOAT8_ARCHS, f"this GPU ({props.name}, {arch})"
    capability = f"compute capability {props.major}.{props.minor}"
    return (props.major, props.minor) >= (8, 9), f"this GPU ({props.name}, {capability})"


def resolve_emulate(requested, fast: bool, where: str) -> tuple[bool, str]:
    """(emulate, why) for ``quantize.linear.float8.emulate = requested`` on a device (``where``, in words) that has
    fast float8 matmuls or not; ValueError for a value that is none of "auto", true, false (the config loader
    refuses those already; this guards a config built in code)."""
    if not (requested is True or requested is False or requested == "auto"):
        raise ValueError(f"quantize.linear.float8.emulate = {requested!r} is invalid; valid: auto, true, false")
    if requested != "auto":
        return requested, "as configured"
    if fast:
        return False, f"auto: {where} has fast float8 matmuls"
    return True, (f"auto: {where} has no fast float8 matmul (torch._scaled_mm would be thousands of times slower); "
                  "emulate = false uses it anyway")


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
        fast, where = float8_matmul_is_fast(device_type())
        emulate, why = resolve_emulate(self.cfg.emulate, fast, where)
        if not (emulate or fast):
            logger.warning(f"float8: emulate = false on {where}, which has no fast float8 matmul: torch._scaled_mm "
                           "will be thousands of times slower than with emulate = auto")
        else:
            logger.info(f"float8: emulate = {str(emulate).lower()} ({why})")
        if self.cfg.recipe_name is not None:
            config = float8.Float8LinearConfig.from_recipe_name(self.cfg.recipe_name)
            self.config = dataclasses.replace(config, emulate=emulate)
        else:
            self.config = float8.Float8LinearConfig(
                enable_fsdp_float8_all_gather=self.cfg.enable_fsdp_float8_all_gather and self.fsdp,
                emulate=emulate,
            )
        if self.cfg.recipe_name == "rowwise" and job_config.compile.enable:
            # Inductor otherwise fuses away the rounding to bf16 between the rowwise scaling ops, so compiled
            # scales differ from eager ones; on an H100 (Llama 3 8B dims) that sent the step-1 grad norm to 365
            # instead of 5.2 and the loss to inf by step 3. Emulating the casts keeps eager's numerics.
            torch._inductor.config.emulate_precision_casts = True
            logger.info("float8 rowwise with compile: torch._inductor.config.emulate_precision_casts = True")
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
