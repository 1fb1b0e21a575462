"""The proc runtime: what runs inside every proc (``_proc``), the template process procs fork from (``_zygote``),
their start hooks for the tools (``_proc_ext``), shutdown (``_proc_exit``, ``_exit_status``), threads and
CPU binding (``_threads``, ``_bind``), and who is running right now (``_context``).
"""
