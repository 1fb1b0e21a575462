"""The tensor engine's client side: the mesh ``Tensor``, op recording, batching, fetch, remote, streams.

Users import from ``monarch_tensor`` (``from monarch_tensor import fetch_shard, remote, Stream``).
"""
