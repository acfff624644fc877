"""TrainSpec: everything the trainer builds for one model family, and the registry of specs.

A custom model registers a spec under a new name (from its own package, imported through
``--experimental.custom_import``) and is then selected with ``--model.name``.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchtitan.config import ConfigError
from torchtitan.config.job_config import Model, Parallelism
from torchtitan.data import build_dataloader, build_tokenizer
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.tensor_parallel_plan import BlockPlan
from torchtitan.registry import Registry


@dataclass
class TrainSpec:
    """What a model family provides; what it leaves None, the entry points fill with the standard piece."""

    model_cls: type[nn.Module]
    """Built as ``model_cls(args)`` on the meta device."""
    flavors: dict[str, BaseModelArgs]
    """Named sizes of the family."""
    parallelize_fn: Callable[..., nn.Module] | None = None
    """``parallelize_fn(model, parallel_dims, job_config)`` applies TP, AC, compile and FSDP. None: for a model on
    the shared decoder, distributed/apply_common.parallelize_decoder with ``tp_block_plan``."""
    pipelining_fn: Callable[..., Any] | None = None
    """Splits the model into pipeline stages. None: the shared decoder's split for a model on it (any Decoder
    subclass, so such a family is pipelined), else no PP."""
    tp_block_plan: BlockPlan | None = None
    """A shared-decoder family's tensor-parallel plan of a block (None: grouped-query attention's)."""
    build_optimizer_fn: Callable[..., Any] | None = None
    """None: components/optimizers/optimizer.build_optimizer."""
    build_lr_scheduler_fn: Callable[..., Any] | None = None
    """None: components/optimizers/lr_scheduler.build_lr_scheduler."""
    build_loss_fn: Callable[..., Any] | None = None
    """None: components/objectives/loss.build_cross_entropy_loss."""
    build_dataloader_fn: Callable[..., Any] = build_dataloader
    build_tokenizer_fn: Callable[..., Any] = build_tokenizer
    state_dict_adapter: type | None = None
    """Converts between this family's state dict and Hugging Face names (None: no HF interop)."""


BUILTIN_FAMILIES = ("torchtitan.models.llama3", "torchtitan.models.qwen3", "torchtitan.models.qwen3_moe",
                    "torchtitan.models.deepseek_v3", "torchtitan.models.qwen3_next",
                    "torchtitan.models.gpt_oss", "torchtitan.models.qwen3_vl", "torchtitan.models.qwen3_5",
                    "torchtitan.models.kimi_linear")
"""The modules that register the built-in families when imported; the registry imports them on its first lookup,
so importing a shared piece (say models.shared.moe) does not pull every family in."""
TRAIN_SPECS: Registry[TrainSpec] = Registry("model", builtin_modules=BUILTIN_FAMILIES)


def register_train_spec(name: str, spec: TrainSpec) -> None:
    """Make ``spec`` selectable as ``model.name = name``; registering a name twice is an error."""
    TRAIN_SPECS.register(name, spec)


def get_train_spec(name: str) -> TrainSpec:
    return TRAIN_SPECS.get(name)


def registered_train_specs() -> list[str]:
    return TRAIN_SPECS.names()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


HF_FLAVOR = "hf:"
"""``model.flavor = "hf:<path>"``: the family's model at the dimensions of a Hugging Face config.json (path: a
folder holding it, or the file)."""


def _flavor(spec: TrainSpec, m: Model) -> tuple[Any, str | None]:
    """(model.flavor's args, None), or (None, why there are none, phrased to follow "model.flavor = ...")."""
    if not m.flavor.startswith(HF_FLAVOR):
        if m.flavor not in spec.flavors:
            return None, (f"is not a flavor of '{m.name}'; valid: {', '.join(spec.flavors)}, or "
                          f"\"{HF_FLAVOR}<folder holding a Hugging Face config.json>\"")
        return spec.flavors[m.flavor], None
    reader = getattr(spec.state_dict_adapter, "args_from_hf_file", None)
    if reader is None:
        return None, (f"needs a Hugging Face adapter that reads config.json, which model.name = {m.name!r} has not; "
                      f"valid: {', '.join(spec.flavors)}")
    path = Path(m.flavor[len(HF_FLAVOR):]).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        return None, f"names no config.json: {file} does not exist (give a folder holding config.json, or the file)"
    try:
        return reader(file), None
    except ValueError as e:
        return None, f"cannot be built: {e}"


def flavor_args(spec: TrainSpec, m: Model) -> Any:
    """model.flavor's args, before finalize: the family's named flavor, or for ``hf:<path>`` its adapter's reading
    of that config.json (``args_from_hf_file``: every key that changes the computation, or a refusal naming each
    one the family cannot express). ConfigError (one line, naming model.flavor) when neither gives a model."""
    args, problem = _flavor(spec, m)
    if problem is not None:
        raise ConfigError(f"model.flavor = {m.flavor!r} {problem}")
    return args


def build_model_args(spec: TrainSpec, m: Model, tokenizer_vocab_size: int, seq_len: int, mtp: bool = True) -> Any:
    """The flavor's args for this run (``flavor_args``): finalized for the tokenizer and sequence length, with
    ``model.mtp_depth`` applied where the family builds multi-token prediction blocks; ``mtp=False`` builds without
    them (inference, which never runs them)."""
    args = flavor_args(spec, m).finalize(tokenizer_vocab_size, seq_len)
    if m.mup.base_width:
        args = args.with_mup(m.mup.base_width, m.mup.base_head_dim)
    if args.builds_mtp_blocks:
        depth = args.mtp_depth if m.mtp_depth is None else m.mtp_depth
        args = dataclasses.replace(args, mtp_depth=depth if mtp else 0)
    return args


def _mup_problems(m: Model, flavor: Any) -> list[tuple[str, str]]:
    mup = m.mup
    if mup.base_width < 0 or mup.base_head_dim < 0:
        return [("model.mup", f"base_width = {mup.base_width}, base_head_dim = {mup.base_head_dim}: both must be "
                              ">= 0 (base_width 0: off)")]
    if not mup.base_width:
        return [("model.mup.base_head_dim", "does nothing without model.mup.base_width; set both or neither")
                ] if mup.base_head_dim else []
    try:
        bad = flavor.with_mup(mup.base_width, mup.base_head_dim).check()
    except ValueError as e:
        return [("model.mup.base_width", f"is set, but {e}; valid: 0")]
    return [("model.mup.base_width", reason) for name, reason in bad if name == "mup"]


def model_config_problems(m: Model, seq_len: int, p: Parallelism) -> tuple[list[tuple[str, str]], Any, Any]:
    """The first problem (full config key, reason) with the [model] section for this sequence length and
    layout, or [], with the TrainSpec and the finalized model args when they could be built (else None)."""
    try:
        spec = get_train_spec(m.name)
    except KeyError as e:
        return [("model.name", f"is unknown: {e.args[0]}")], None, None
    flavor, problem = _flavor(spec, m)
    if problem is not None:
        return [("model.flavor", problem)], spec, None
    if m.mtp_depth is not None and m.mtp_depth < 0:
        return [("model.mtp_depth", "is invalid; it must be >= 0 (0: off) or unset (the flavor's)")], spec, None
    if m.mtp_depth and not flavor.builds_mtp_blocks:
        return [("model.mtp_depth", f"needs a model with multi-token prediction blocks, which model.name = "
                                    f"{m.name!r} has not; valid: 0 or unset")], spec, None
    if problems := _mup_problems(m, flavor):
        return problems, spec, None
    if bad := flavor.check():
        return [("model.flavor", f"has an invalid {bad[0][0]}: {bad[0][1]}")], spec, None
    if bad := flavor.check_tensor_parallel(p.tensor_parallel_degree):
        return [("parallelism.tensor_parallel_degree",
                 f"does not fit model.flavor = {m.flavor!r}: its {bad[0][0]} {bad[0][1]}")], spec, None
    folder = Path(m.hf_assets_path)
    if not folder.is_dir():
        return [("model.hf_assets_path", "does not exist; it must be a folder holding a tokenizer")], spec, None
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return [("model.hf_assets_path",
                 f"holds no tokenizer; expected one of {', '.join(TOKENIZER_FILES)} in it")], spec, None
    try:
        tokenizer_vocab = spec.build_tokenizer_fn(m.hf_assets_path).vocab_size
    except Exception as e:  # a corrupt tokenizer file must still give the one-line error
        return [("model.hf_assets_path",
                 f"holds a tokenizer that cannot be loaded: {type(e).__name__}: {e}")], spec, None
    args = build_model_args(spec, m, tokenizer_vocab, seq_len)
    model_vocab = args.vocab_size or tokenizer_vocab
    if model_vocab < tokenizer_vocab:
        return [("model.flavor", f"has vocab_size {model_vocab}, smaller than the tokenizer's {tokenizer_vocab} in "
                                 f"{m.hf_assets_path}")], spec, args
    if p.context_parallel_degree > 1:
        with torch.device("meta"):  # free: no memory is allocated
            model = spec.model_cls(args)
        if not any(hasattr(module, "attention_fn") for module in model.modules()):
            return [("parallelism.context_parallel_degree",
                     f"is not supported by model.name = {m.name!r}: none of its modules has an attention_fn "
                     "(docs/extending.md says what context parallelism needs)")], spec, args
        # A linear-attention layer's conv reads its history from the previous chunk of the 2 * cp (one chunk back).
        history = max((module.conv.weight.shape[-1] - 1 for module in model.modules()
                       if hasattr(module, "recurrence_fn") and hasattr(module, "conv")), default=0)
        chunk = seq_len // (2 * p.context_parallel_degree)
        if chunk < history:
            return [("training.seq_len", f"splits into chunks of {chunk} tokens for context_parallel_degree "
                                         f"= {p.context_parallel_degree} (2 per rank), fewer than the {history} "
                                         f"tokens the linear-attention conv reads back; use seq_len >= "
                                         f"{2 * p.context_parallel_degree * history}")], spec, args
    return [], spec, args
