"""A module as bytes and back: cloudpickle for Python modules, TorchScript's own format for
scripted and traced ones (``torch.jit.script``/``trace``, ``torch.jit.load``), which no pickle
takes.

The bytes are what executors get and what ``TorchModel.save`` writes; their hash names the model.
"""

from __future__ import annotations

import io
import warnings
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch

__all__ = ["dump_module", "load_module"]

# TorchScript archives are zip files; this header tells them from a pickle (which starts with 0x80).
_TORCHSCRIPT = b"sparkdl-torchscript\n"


def dump_module(module: torch.nn.Module) -> bytes:
    """``module`` as bytes: a TorchScript archive for a ``torch.jit.ScriptModule``, else cloudpickled."""
    import cloudpickle
    import torch

    if isinstance(module, torch.jit.ScriptModule):
        buffer = io.BytesIO()
        with warnings.catch_warnings():  # torch deprecates TorchScript; the user chose it, not sparkdl
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.save(module, buffer)
        return _TORCHSCRIPT + buffer.getvalue()
    return cast(bytes, cloudpickle.dumps(module, protocol=5))


def load_module(data: bytes) -> torch.nn.Module:
    """The module ``data`` holds (see :func:`dump_module`), on the CPU."""
    import cloudpickle
    import torch

    if data.startswith(_TORCHSCRIPT):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = torch.jit.load(io.BytesIO(data[len(_TORCHSCRIPT):]), map_location="cpu")
        return cast("torch.nn.Module", module)
    return cast("torch.nn.Module", cloudpickle.loads(data))
