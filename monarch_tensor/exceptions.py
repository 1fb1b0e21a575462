"""The runtime's exceptions under the seeds' module name: ``from monarch_tensor.exceptions import
DeviceMeshError``. (They are defined in ``monarch_tensor.errors``.)"""

from .errors import (
    ActorError,
    ActorFailedError,
    DeviceMeshError,
    HostUnreachableError,
    MeshFailure,
    MeshStoppedError,
    ProtocolError,
    SupervisionError,
)

__all__ = ["ActorError", "ActorFailedError", "DeviceMeshError", "HostUnreachableError", "MeshFailure", "MeshStoppedError",
           "ProtocolError", "SupervisionError"]
