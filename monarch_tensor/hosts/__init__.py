"""Hosts and host agents: host and proc meshes (``host``, which gathers ``proc_mesh``, ``host_mesh``, ``_spawn``,
``_script_proc``, ``_failures``, ``_supervision`` and ``_shutdown``), the host agent and its protocol (``agent``,
``agent_messages``), the controller's side of agents (``remote_hosts``), and spawns and replies through
trees of agents (``_spawn_tree``, ``_gather``).
"""
