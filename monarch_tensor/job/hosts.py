"""``HostListJob``: agents you started yourself (``monarch-tensor host``) on a list of machines."""

from __future__ import annotations

from ..transport import _curve
from ._base import JobTrait


class HostListJob(JobTrait):
    """Custom host management: a static list of agent addresses per mesh, and their key file.

    >>> job = HostListJob({"mesh0": ["tcp://h1:26600", "tcp://h2:26600"]}, key_file="job.key")
    >>> job.state().mesh0.spawn_procs(per_host={"gpus": 8}).sizes
    {'hosts': 2, 'gpus': 8}

    ``kill()`` shuts the agents down. (Kubernetes is not supported yet.)
    """

    kind = "hosts"

    def __init__(self, hosts: dict[str, list[str]], *, key_file: str) -> None:
        if not isinstance(hosts, dict) or not all(
                isinstance(a, (list, tuple)) and all(isinstance(x, str) for x in a) for a in hosts.values()):
            # (a str would be split into one "host" per character)
            raise TypeError(f"HostListJob needs a dict of mesh name -> list of agent address strings, e.g. "
                            f"{{'mesh0': ['tcp://h1:26600']}}, got {hosts!r}")
        super().__init__({name: len(addrs) for name, addrs in hosts.items()})
        self.keys = _curve.JobKeys.load(key_file)
        self.addrs = {name: list(a) for name, a in hosts.items()}

    def _start(self) -> dict[str, list[str]]:
        assert self.addrs is not None
        return self.addrs

    def _restore(self, data: dict) -> None:
        pass
