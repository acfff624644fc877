"""A Hugging Face config.json read as transformers reads it, on the keys that change what the model computes.

Two uses, one reading: a folder whose config.json disagrees with the model its weights are loaded into is refused
naming every key that differs (components/checkpointing/hf_folder.check_hf_config), and a model is built from a
config.json (``model.flavor = "hf:<folder>"``: each family's adapter maps the keys to its args, then checks that
those args would write the same config.json back, so that a key the family cannot express is refused by name).

The rules of ``hf_view``, which both sides of a comparison go through:

- Keys that do not change the computation are left out (``IGNORED``: token ids, dtype, the position limit, caching,
  initialisation, router-loss settings, dropout, multi-token prediction modules transformers does not run); so are
  keys our adapter never writes (they cannot be judged).
- A key config.json leaves out (or sets to null where transformers derives it) reads as transformers' default for
  the family, from the adapter's ``hf_defaults`` table (transformers 5's config classes); a key absent there too is
  compared only where both configs have it.
- RoPE: transformers 5 writes ``rope_parameters`` {rope_type, rope_theta, factor, ...}, 4.x wrote ``rope_theta`` and
  ``rope_scaling`` at the top level (``partial_rotary_factor`` beside them); both read into ``rope_type``,
  ``rope_theta``, ``partial_rotary_factor`` and ``rope_parameters.<name>`` for each parameter the rope type uses,
  with transformers' defaults filled in (YaRN's beta_fast 32, beta_slow 1, truncate true, its attention factor
  derived from mscale, mscale_all_dim and factor where not given; original_max_position_embeddings from
  max_position_embeddings).
- Numbers compare with a relative tolerance of 1e-6; lists element by element.
"""

import json
import math
from collections.abc import Callable
from typing import Any

IGNORED = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "max_position_embeddings", "use_cache", "initializer_range", "output_router_logits",
    "router_aux_loss_coef", "router_z_loss_coef", "attention_dropout", "pretraining_tp", "num_nextn_predict_layers",
    "num_mtp_layers", "_name_or_path", "id2label", "label2id", "tokenizer_class", "return_dict",
    "output_hidden_states", "output_attentions", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
})
# Read into the rope view instead.
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
             "original_max_position_embeddings")
RTOL = 1e-6

Default = Any
"""A value, or a function of the config giving it (applied where the key is missing or null: transformers derives
such a key, e.g. num_key_value_heads from num_attention_heads)."""


def derived(key: str, derive: Callable[[dict], Any], absent: Any = None) -> Callable[[dict], Any]:
    """The default of a key that transformers derives from others where config.json sets it to null (or, without
    ``absent``, leaves it out); ``absent``: its value where the file leaves it out."""
    return lambda config: derive(config) if absent is None or key in config else absent


def heads(config: dict) -> int:
    return config["num_attention_heads"]


def head_dim(config: dict) -> int:
    return config["hidden_size"] // config["num_attention_heads"]


def read_config_json(path) -> dict:
    """The config.json at ``path`` as a dict; ValueError (one line, for the caller to put after the path) when it
    is not a JSON object."""
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not readable as JSON ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"holds a JSON {type(config).__name__}, not an object")
    return config


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_view(config: dict, default_theta: float, default_rope: dict | None = None,
              default_partial: float = 1.0) -> dict:
    """The RoPE settings of ``config`` (with its defaults already filled in) in one layout; see the module doc."""
    params = config.get("rope_scaling") or config.get("rope_parameters")
    params = dict(params if isinstance(params, dict) else default_rope or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    view = {"rope_type": rope_type,
            "rope_theta": params.get("rope_theta", config.get("rope_theta", default_theta)),
            "partial_rotary_factor": params.get("partial_rotary_factor",
                                                config.get("partial_rotary_factor", default_partial))}
    if rope_type == "default":
        return view
    original = (config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                or config.get("max_position_embeddings"))
    factor = params.get("factor")
    if rope_type == "yarn":
        if factor is None and original:  # DeepSeek's form: the stretch from the two lengths
            factor = config.get("max_position_embeddings", original) / original
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = params.get("attention_factor")
        if attention is None and factor is not None:
            attention = (_mscale(factor, mscale) / _mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                         else _mscale(factor))
        extra = {"factor": factor, "original_max_position_embeddings": original,
                 "beta_fast": params.get("beta_fast") or 32.0, "beta_slow": params.get("beta_slow") or 1.0,
                 "truncate": params.get("truncate", True), "attention_factor": attention,
                 "mscale_all_dim": mscale_all_dim or 0.0}
    elif rope_type == "llama3":
        extra = {"factor": factor, "original_max_position_embeddings": original,
                 "low_freq_factor": params.get("low_freq_factor"), "high_freq_factor": params.get("high_freq_factor")}
    else:  # linear, dynamic, longrope, ...: no family here computes them; the rope_type alone refuses them
        extra = {name: value for name, value in params.items() if name not in ("rope_type", "type", "rope_theta")}
    return {**view, **{f"rope_parameters.{name}": value for name, value in extra.items()}}


def hf_view(config: dict, defaults: dict[str, Default], aliases: dict[str, str], default_theta: float,
            default_rope: dict | None = None) -> dict:
    """``config`` reduced to the keys that change the computation, each with transformers' value (see the module
    doc). ``aliases`` renames keys transformers also accepts under another name to the name our adapter writes."""
    config = dict(config)
    for other, ours in aliases.items():
        if other in config:
            value = config.pop(other)
            config.setdefault(ours, value)
    for key, default in defaults.items():
        if callable(default):
            if config.get(key) is None:
                config[key] = default(config)
        elif key not in config:
            config[key] = default
    view = {k: v for k, v in config.items() if k not in IGNORED and k not in ROPE_KEYS}
    default_partial = defaults.get("partial_rotary_factor", 1.0)
    return {**view, **rope_view(config, default_theta, default_rope, default_partial)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=RTOL)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def differences(theirs: dict, ours: dict) -> list[tuple[str, Any, Any]]:
    """(key, config.json's value, ours) for every key both views hold that differs; a list that differs is named
    at its first differing element."""
    found = []
    for key, value in ours.items():
        if key not in theirs or _same(theirs[key], value):
            continue
        other = theirs[key]
        if isinstance(other, list) and isinstance(value, list) and len(other) == len(value):
            i = next(i for i, (x, y) in enumerate(zip(other, value)) if not _same(x, y))
            key, other, value = f"{key}[{i}]", other[i], value[i]
        found.append((key, other, value))
    return found


def show(value: Any) -> str:
    """A value as config.json writes it."""
    return json.dumps(value) if isinstance(value, (str, bool, type(None), list, dict)) else str(value)


def describe(found: list[tuple[str, Any, Any]], ours: str) -> str:
    """'key: config.json has X, <ours> Y; ...' for ``differences``' result."""
    return "; ".join(f"{key}: config.json has {show(theirs)}, {ours} {show(value)}" for key, theirs, value in found)
