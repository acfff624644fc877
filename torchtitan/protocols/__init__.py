from torchtitan.protocols.model import BaseModelArgs, count_params
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec, registered_train_specs

__all__ = [
    "BaseModelArgs",
    "TrainSpec",
    "count_params",
    "get_train_spec",
    "register_train_spec",
    "registered_train_specs",
]
