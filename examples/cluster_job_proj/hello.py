"""Run on each host by examples/cluster_job.py (from the directory mirrored there)."""

import os
import socket

print(f"hello from {socket.gethostname()}, host {os.environ.get('MONARCH_RANK_hosts')} of "
      f"{os.environ.get('MONARCH_SIZE_hosts')}, in {os.path.dirname(os.path.abspath(__file__))}")
