"""Runtime settings, by Monarch's names: ``configure(...)``, ``configured(...)``, ``get_global_config()``.

>>> from monarch_tensor.config import configure, configured
>>> configure(rdma_allow_tcp_fallback=False)   # a buffer on another host without RDMA: an error, not TCP
>>> with configured(prefix_with_rank=False):
...     procs.spawn("w", W).hello.call().get()  # its output reaches the script without the [rank] prefix

Layers, as in Monarch: the defaults, then the environment (``MONARCH_TENSOR_<NAME>``, which procs inherit),
then what ``configure`` set in this process (the runtime layer). Settings that procs read are handed to the
procs spawned afterwards through their environment. Monarch's other keys configure its Rust runtime
(hyperactor), which this project does not have: ``configure`` refuses them with a clear error rather
than ignoring them.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Iterator

# name: (default, where it acts, what it does)
SETTINGS: dict[str, tuple[Any, str, str]] = {
    "enable_log_forwarding": (True, "procs", "procs' stdout and stderr reach the script (procs spawned "
                                             "afterwards; procs.logging_option() switches a running mesh)"),
    "prefix_with_rank": (True, "client", "forwarded lines start with their proc's [rank]"),
    "fold_repeated_lines": (True, "client", "in a terminal or a notebook, the same line from several ranks within "
                                            "a quarter second prints once, with the ranks that printed it "
                                            "(logging_option(aggregate_window_sec=...) sets another window)"),
    "rdma_allow_tcp_fallback": (True, "procs", "a buffer on another host that no RDMA device serves moves over "
                                               "TCP, with an RDMATcpFallbackWarning; False: that transfer fails"),
    "rdma_disable_ibverbs": (False, "procs", "never use the verbs backend, even where an RDMA device is found"),
    "rdma_backend": ("", "procs", "the data-plane backend every transfer uses: verbs, cuda_ipc, cma or tcp "
                              "(\"\": the best one for each pair of processes)"),
}
# Settings that take one of a few words.
_CHOICES = {"rdma_backend": ("", "verbs", "cuda_ipc", "cma", "tcp")}
# Monarch's keys for its Rust runtime: named in the error, so that a port from Monarch reads why.
_HYPERACTOR = {
    "default_transport", "enable_file_capture", "tail_log_lines", "codec_max_frame_length",
    "message_delivery_timeout", "host_spawn_ready_timeout", "mesh_proc_spawn_max_idle", "process_exit_timeout",
    "message_ack_time_interval", "message_ack_every_n_messages", "message_ttl_default", "split_max_buffer_size",
    "split_max_buffer_age", "stop_actor_timeout", "cleanup_timeout", "default_encoding",
    "channel_net_rx_buffer_full_check_interval", "channel_tcp_congestion", "message_latency_sampling_rate",
    "enable_dest_actor_reordering_buffer", "mesh_bootstrap_enable_pdeathsig", "mesh_terminate_concurrency",
    "mesh_terminate_timeout", "small_write_threshold", "max_cast_dimension_size", "remote_alloc_bind_to_inaddr_any",
    "remote_alloc_bootstrap_addr", "remote_alloc_allowed_port_range", "read_log_buffer", "force_file_log",
    "actor_spawn_max_idle", "get_actor_state_max_idle", "supervision_watchdog_timeout", "proc_stop_max_idle",
    "get_proc_state_max_idle", "mesh_admin_addr", "mesh_attach_config_timeout", "mesh_orphan_timeout", "pyspy_bin",
    "rdma_max_chunk_size_mb", "rdma_ibverbs_target", "rdma_peer_device_affinity", "rdma_max_nics_per_buffer",
    "rdma_min_stripe_size_kb", "rdma_qps_per_cq", "rdma_cq_poller_per_device", "rdma_runtime_worker_threads",
}
_runtime: dict[str, Any] = {}
# How an on/off switch in the environment may be written (any case).
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_name(name: str) -> str:
    return f"MONARCH_TENSOR_{name.upper()}"


def env_number(name: str, default: float, what: str, *, integer: bool = False, least: float = 0) -> Any:
    """The number in environment variable ``name`` (``default`` where it is unset), read where a module
    starts: one that is not a number, or is below ``least``, is an error naming the variable and what it
    takes (``what``: "a number of microseconds (0: block at once)") rather than a bare ``int()`` error or a
    value that breaks things later.

    >>> SPIN_S = env_number("MONARCH_TENSOR_SPIN_US", 200, "a number of microseconds (0: block at once)") * 1e-6
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None
    if not (value >= least and math.isfinite(value)):  # (nan compares false)
        raise ValueError(f"{name} must be {what}, at least {least:g}, got {raw!r}")
    return value


def env_flag(name: str, default: bool) -> bool:
    """Whether the switch in environment variable ``name`` is on (``default`` where it is unset or empty):
    1/0, true/false, yes/no or on/off, in any case. Anything else is an error naming the variable, rather than
    a value read silently as one or the other (``=true`` was read as off where only ``1`` was on).

    >>> COPY_LOCAL = env_flag("MONARCH_TENSOR_SYNC_COPY_LOCAL", True)
    """
    raw = os.environ.get(name, "")
    word = raw.strip().lower()
    if not word:
        return default
    if word in _ON or word in _OFF:
        return word in _ON
    raise ValueError(f"{name} must be 1 or 0 (true or false), got {raw!r}")


def _check(name: str, value: Any) -> None:
    if name not in SETTINGS:
        why = ("a setting of Monarch's Rust runtime (hyperactor), which has no counterpart here"
               if name in _HYPERACTOR else "no such setting")
        raise ValueError(f"configure({name}=...): {why}; the settings are {sorted(SETTINGS)}")
    default = SETTINGS[name][0]
    if type(value) is not type(default):
        raise TypeError(f"configure({name}=...) takes a {type(default).__name__}, got {value!r}")
    if name in _CHOICES and value not in _CHOICES[name]:
        raise ValueError(f"configure({name}=...) takes one of {list(_CHOICES[name])}, got {value!r}")


def _from_env(name: str) -> Any:
    raw = os.environ.get(_env_name(name))
    if raw is None:
        return None
    default = SETTINGS[name][0]
    if isinstance(default, bool):
        if raw.strip().lower() in _ON:
            return True
        if raw.strip().lower() in (*_OFF, ""):
            return False
        raise ValueError(f"{_env_name(name)} must be 1 or 0 (true or false), not {raw!r}")
    return type(default)(raw)


def get(name: str) -> Any:
    """The value in effect here: the runtime layer's, else the environment's, else the default."""
    if name in _runtime:
        return _runtime[name]
    if name not in SETTINGS:
        raise KeyError(f"no setting {name!r}; the settings are {sorted(SETTINGS)}")
    v = _from_env(name)
    return SETTINGS[name][0] if v is None else v


def configure(**kwargs: Any) -> None:
    """Set runtime settings of this process (Monarch's ``configure``); procs spawned afterwards inherit the
    ones they act on. Unknown names and wrong types are refused before anything changes."""
    for name, value in kwargs.items():
        _check(name, value)
    _runtime.update(kwargs)


def get_runtime_config() -> dict[str, Any]:
    """What ``configure`` set in this process."""
    return dict(_runtime)


def get_global_config() -> dict[str, Any]:
    """Every setting's value in effect here (defaults, environment and runtime layer merged)."""
    return {name: get(name) for name in SETTINGS}


def clear_runtime_config() -> None:
    """Forget what ``configure`` set (the environment and the defaults stay)."""
    _runtime.clear()


@contextlib.contextmanager
def configured(**overrides: Any) -> Iterator[dict[str, Any]]:
    """``configure(**overrides)`` for the block, then the runtime layer as it was; yields the merged view."""
    prev = get_runtime_config()
    configure(**overrides)
    try:
        yield get_global_config()
    finally:
        clear_runtime_config()
        _runtime.update(prev)


def parametrize_config(**options: Any):
    """A pytest decorator running the test once per combination of the given settings' values, each run inside
    ``configured(...)`` of that combination (Monarch's test helper). Each value is a collection of values.

    >>> @parametrize_config(prefix_with_rank={True, False}, enable_log_forwarding={True, False})
    ... def test_logs(): ...   # four runs
    """
    import itertools

    keys, values = _sweep("parametrize_config", options)
    return _parametrized(keys, list(itertools.product(*values)))


def parametrize_config_pointwise(**options: Any):
    """As ``parametrize_config``, but the value lists are taken in lockstep (``zip``): one run per position;
    every list must have the same length."""
    keys, values = _sweep("parametrize_config_pointwise", options)
    lengths = {k: len(v) for k, v in zip(keys, values)}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"parametrize_config_pointwise needs as many values for every setting; got {lengths}")
    return _parametrized(keys, list(zip(*values)))


def _sweep(what: str, options: dict) -> tuple[list, list]:
    if not options:
        raise ValueError(f"{what} needs at least one setting")
    keys, values = list(options), []
    for k in keys:
        vs = options[k]
        if isinstance(vs, (str, bytes)) or not hasattr(vs, "__iter__"):
            raise TypeError(f"{what}({k}=...) takes a collection of values, got {vs!r}")
        vs = list(vs)
        for v in vs:
            _check(k, v)  # a wrong name or type fails when the test is collected, not when it runs
        values.append(vs)
    return keys, values


def _parametrized(keys: list, combos: list):
    import functools
    import inspect

    import pytest

    settings = [dict(zip(keys, c)) for c in combos]
    ids = ["-".join(f"{k}={v}" for k, v in s.items()) for s in settings]

    def decorate(fn):
        sig = inspect.signature(fn)
        sig = sig.replace(parameters=[inspect.Parameter("_config_overrides", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                                      *sig.parameters.values()])
        if inspect.iscoroutinefunction(fn):
            async def run(_config_overrides, *args, **kwargs):
                with configured(**_config_overrides):
                    return await fn(*args, **kwargs)
        else:
            def run(_config_overrides, *args, **kwargs):
                with configured(**_config_overrides):
                    return fn(*args, **kwargs)
        functools.update_wrapper(run, fn)
        run.__signature__ = sig
        return pytest.mark.parametrize("_config_overrides", settings, ids=ids)(run)

    return decorate


def proc_env() -> dict[str, str]:
    """The environment that hands this process's procs-side settings to a proc spawned now. Every setting is
    read here, the client's too, so that a bad value in the environment is an error at the spawn, rather than
    one raised later on the thread that prints the procs' output (``prefix_with_rank``)."""
    values = get_global_config()
    out = {}
    for name, (default, where, _) in SETTINGS.items():
        if where == "procs":
            v = values[name]
            if v == "" and default == "":
                continue  # unset here: a proc keeps what its own environment says (a host agent's, say)
            out[_env_name(name)] = ("1" if v else "0") if isinstance(default, bool) else str(v)
    return out


__all__ = ["clear_runtime_config", "configure", "configured", "get_global_config", "get_runtime_config",
           "parametrize_config", "parametrize_config_pointwise"]
