"""The transport: messages (``messages``), their wire format (``_wire``, ``_shm`` for large buffers within a host),
mailboxes (``mailbox``), routing through trees of host agents (``_fanout``), ports that gather replies
into futures (``_ports``), CURVE keys (``_curve``), addresses (``_net``), procs' log forwarding (``logs``) and
Monarch's transport choice (``channel``).

It imports nothing above it (the proc runtime, actors, hosts, tools): tests/test_layers.py checks this.
"""
