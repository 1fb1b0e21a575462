"""The data plane: ``RDMABuffer`` and its verbs / cuda_ipc / cma / tcp backends.

Users import it as ``monarch_tensor.rdma``. See ``rdma/buffer.py`` for the API and
``rdma/backends/`` for the backends (one file each behind ``backends/base.py``).
"""

from .buffer import (  # noqa: F401
    RDMAAction,
    RDMABuffer,
    backends,
    get_rdma_backend,
    is_ibverbs_available,
    is_rdma_available,
    preferred_backend,
    transfer_stats,
)
from .errors import (  # noqa: F401
    BackendUnavailableError,
    BufferDroppedError,
    OwnerDiedError,
    RDMAError,
    RDMAReadTransferWarning,
    RDMATcpFallbackWarning,
    RDMAWriteTransferWarning,
    TransferTimeoutError,
)
from .tensors import TensorHandle, publish_tensor  # noqa: F401
