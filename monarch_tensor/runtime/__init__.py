"""The proc runtime: what runs inside every proc (``_proc``), the template process procs fork from (``_zygote``),
the tools' hooks in every proc (``_hooks``), the actor's identity on log records (``_actor_logs``), shutdown
(``_proc_exit``, ``_exit_status``), threads and CPU binding (``_threads``, ``_bind``), and who is running right
now (``_context``).
"""
