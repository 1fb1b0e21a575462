"""The data plane's public names: ``from monarch_tensor.rdma import RDMABuffer``."""

from monarch_tensor.rdma import (  # noqa: F401
    RDMAAction,
    RDMABuffer,
    TensorHandle,
    get_rdma_backend,
    is_ibverbs_available,
    is_rdma_available,
    preferred_backend,
    publish_tensor,
    transfer_stats,
)
from monarch_tensor.rdma.errors import (  # noqa: F401
    BackendUnavailableError,
    BufferDroppedError,
    OwnerDiedError,
    RDMAError,
    RDMAReadTransferWarning,
    RDMATcpFallbackWarning,
    RDMAWriteTransferWarning,
    TransferTimeoutError,
)
