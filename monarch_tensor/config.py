"""Runtime settings, by Monarch's names: ``configure(...)``, ``configured(...)``, ``get_global_config()``.

>>> from monarch_tensor.config import configure, configured
>>> configure(rdma_allow_tcp_fallback=False)   # a buffer on another host without RDMA: an error, not TCP
>>> with configured(prefix_with_rank=False):
...     procs.spawn("w", W).hello.call().get()  # its output reaches the script without the [rank] prefix

Layers, as in Monarch: the defaults, then the environment (``MONARCH_TENSOR_<NAME>``, which procs inherit),
then what ``configure`` set in this process (the runtime layer). Settings that procs read are handed to the
procs spawned afterwards through their environment. Monarch's keys for its Rust runtime (hyperactor) that
have a counterpart here are mapped to it (``MONARCH_NAMES``, ``default_transport``); the others are ignored
with an ``IgnoredSettingWarning`` that names them.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

from ._settings import REGISTRY, env_flag, env_number, setting, take  # noqa: F401 - the read helpers, here
from .transport import channel

# name: (default, where it acts, what it does), from the registry's declarations (monarch_tensor/_settings.py).
SETTINGS: dict[str, tuple[Any, str, str]] = {s.option: (s.default, s.acts, s.doc) for s in REGISTRY.values()
                                             if s.option}
# Settings in seconds: at least this much (a zero or negative timeout would fail everything at once).
_SECONDS = {s.option: s.least for s in REGISTRY.values() if s.option and s.kind == "seconds"}
# Monarch's names for the Rust runtime's settings that have a counterpart here: Monarch's name -> ours. Their
# durations are humantime strings ("30s", "5m", "1h 30m", "250ms") or seconds.
MONARCH_NAMES = {
    "mesh_proc_spawn_max_idle": "spawn_timeout",
    "host_spawn_ready_timeout": "job_start_timeout",
    "mesh_terminate_timeout": "stop_timeout",
    "process_exit_timeout": "stop_timeout",
    "message_delivery_timeout": "payload_timeout",
    "supervision_watchdog_timeout": "agent_heartbeat_timeout",
}
# Settings that take one of a few words.
_CHOICES = {s.option: s.choices for s in REGISTRY.values() if s.option and s.kind == "choice"}
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
# Monarch's ``monarch.actor.config.prefix_python_logs_with_actor``: log records written in an actor's code start
# with ``[actor=<its identity>] `` (set it in a proc, say in an actor's __init__, to turn that off there).
prefix_python_logs_with_actor = True


class IgnoredSettingWarning(UserWarning):
    """``configure`` was given settings of Monarch's Rust runtime that have no counterpart here: ignored."""


class DurationError(ValueError, TypeError):
    """A duration setting given a string that is not a humantime duration (``"30s"``, ``"1h 30m"``): a
    ``ValueError``, and the ``TypeError`` Monarch raises there, so ``except TypeError`` ported from it holds."""


_UNITS = {"ns": 1e-9, "nsec": 1e-9, "us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "millis": 1e-3,
          "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0, "m": 60.0, "min": 60.0, "mins": 60.0,
          "minute": 60.0, "minutes": 60.0, "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0,
          "hours": 3600.0, "d": 86400.0, "day": 86400.0, "days": 86400.0}


def humantime_seconds(text: str) -> float:
    """Seconds in a humantime duration, as Monarch's settings take them: ``"30s"``, ``"5m"``, ``"1h 30m"``,
    ``"250ms"``, ``"2min 5s"``. Anything else is a ``DurationError`` (a ``ValueError`` and a ``TypeError``)
    saying what is taken."""
    import re

    parts = re.findall(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text.lower())
    if not parts or "".join(f"{n}{u}" for n, u in parts) != re.sub(r"\s+", "", text.lower()) \
            or any(u not in _UNITS for _, u in parts):
        raise DurationError(f"{text!r} is not a duration: give a humantime string such as '30s', '5m', '1h 30m' or "
                         f"'250ms', or a number of seconds")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _seconds(name: str, given: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            secs = humantime_seconds(value)
        except DurationError as e:
            raise DurationError(f"configure({given}=...): {e}") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        secs = float(value)
    else:
        raise TypeError(f"configure({given}=...) takes a duration ('30s') or a number of seconds, got {value!r}")
    least = _SECONDS[name]
    if not (math.isfinite(secs) and secs >= least):
        raise ValueError(f"configure({given}=...) must be at least {least:g} s, got {value!r}")
    return secs
def _env_name(name: str) -> str:
    return f"MONARCH_TENSOR_{name.upper()}"


def _check(name: str, value: Any) -> None:
    if name not in SETTINGS:
        why = ("a setting of Monarch's Rust runtime (hyperactor), which has no counterpart here"
               if name in _HYPERACTOR else "no such setting")
        raise ValueError(f"configure({name}=...): {why}; the settings are {sorted(SETTINGS)}, and Monarch's "
                         f"{sorted(MONARCH_NAMES)}")
    if name in _SECONDS:
        _seconds(name, name, value)
        return
    default = SETTINGS[name][0]
    if type(value) is not type(default):
        raise TypeError(f"configure({name}=...) takes a {type(default).__name__}, got {value!r}")
    if name in _CHOICES and value not in _CHOICES[name]:
        raise ValueError(f"configure({name}=...) takes one of {list(_CHOICES[name])}, got {value!r}")


def get(name: str) -> Any:
    """The value in effect here: the runtime layer's, else the environment's, else the default."""
    if name in _runtime:
        return _runtime[name]
    if name not in SETTINGS:
        raise KeyError(f"no setting {name!r}; the settings are {sorted(SETTINGS)}")
    return setting(_env_name(name))


def configure(**kwargs: Any) -> None:
    """Set runtime settings of this process (Monarch's ``configure``); procs spawned afterwards inherit the
    ones they act on. Monarch's names for its Rust runtime's settings with a counterpart here are taken and
    mapped (``MONARCH_NAMES``: ``message_delivery_timeout="30s"`` sets ``payload_timeout=30.0``;
    ``default_transport`` is ``enable_transport``); those without one are ignored with an
    ``IgnoredSettingWarning`` naming them. Unknown names and wrong types or values are refused before
    anything changes."""
    updates, ignored, transport = _resolve(kwargs)
    if ignored:
        import warnings

        warnings.warn(f"configure(): {', '.join(ignored)}: setting(s) of Monarch's Rust runtime (hyperactor) with "
                      f"no counterpart here, ignored", IgnoredSettingWarning, stacklevel=2)
    if transport is not None:
        channel.enable_transport(transport)
        updates["default_transport"] = channel.enabled_transport
    _runtime.update(updates)


def _resolve(kwargs: dict) -> tuple[dict, list, Any]:
    """``configure``'s arguments checked and mapped: (our settings' values, Monarch's names ignored, the
    ``default_transport`` asked for or None). Raises before anything changes."""
    updates, ignored, transport = {}, [], None
    for given, value in kwargs.items():
        if given == "default_transport":
            saved = channel.enabled_transport
            try:
                channel.enable_transport(value)  # (checks it; set for real once every argument passed)
            except (TypeError, ValueError) as e:
                raise type(e)(f"configure(default_transport=...): {e}") from None
            finally:
                channel.enabled_transport = saved
            transport = value
            continue
        if given in _HYPERACTOR and given not in MONARCH_NAMES:
            ignored.append(given)
            continue
        name = MONARCH_NAMES.get(given, given)
        if name in _SECONDS:
            updates[name] = _seconds(name, given, value)
            continue
        _check(name, value)
        updates[name] = value
    return updates, ignored, transport


def get_runtime_config() -> dict[str, Any]:
    """What ``configure`` set in this process."""
    return dict(_runtime)


def get_global_config() -> dict[str, Any]:
    """Every setting's value in effect here (defaults, environment and runtime layer merged)."""
    out = {name: get(name) for name in SETTINGS}
    if "default_transport" in _runtime:
        out["default_transport"] = _runtime["default_transport"]
    return out


def clear_runtime_config() -> None:
    """Forget what ``configure`` set (the environment and the defaults stay)."""
    _runtime.clear()


@contextlib.contextmanager
def configured(**overrides: Any) -> Iterator[dict[str, Any]]:
    """``configure(**overrides)`` for the block, then the runtime layer as it was; yields the merged view."""
    prev, transport = get_runtime_config(), channel.enabled_transport
    configure(**overrides)
    try:
        yield get_global_config()
    finally:
        clear_runtime_config()
        _runtime.update(prev)
        channel.enabled_transport = transport


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
        run: Callable[..., Any]
        if inspect.iscoroutinefunction(fn):
            async def run_async(_config_overrides, *args, **kwargs):
                with configured(**_config_overrides):
                    return await fn(*args, **kwargs)
            run = run_async
        else:
            def run_sync(_config_overrides, *args, **kwargs):
                with configured(**_config_overrides):
                    return fn(*args, **kwargs)
            run = run_sync
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


__all__ = ["IgnoredSettingWarning", "clear_runtime_config", "configure", "configured", "get_global_config",
           "get_runtime_config", "parametrize_config", "parametrize_config_pointwise"]
