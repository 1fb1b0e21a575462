"""Distributed checkpoints of mesh models, as ``torch.distributed.checkpoint`` (and its ``state_dict`` module).

>>> from monarch_tensor import checkpoint as dcp
>>> model_sd, optim_sd = dcp.get_state_dict(model, opt)
>>> dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
"""

from monarch_tensor.controller.checkpoint import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "load",
           "save", "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]
