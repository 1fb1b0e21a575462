"""The data plane (RDMABuffer and its verbs / cma / cuda_ipc / tcp backends).

Not built yet: see the data-plane issue.
"""
