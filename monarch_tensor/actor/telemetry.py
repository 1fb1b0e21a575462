"""Telemetry by Monarch's names: ``span``, ``traced``, ``get_meter`` (also in ``monarch_tensor.actor``).

>>> with span("load_batch"):                  # times the block, in any actor or the script
...     batch = next(loader)
>>> @traced                                   # a function (sync or async) in a span of its name
... def step(batch): ...
>>> steps = get_meter().create_counter("steps")
>>> steps.add(1, {"phase": "train"})
>>> recent_spans()[-1]["name"], metrics()["steps"]["values"]
('step', {(('phase', 'train'),): 1})

Each process keeps its own record: the last ``MAX_SPANS`` spans (name, actor,
rank, start, seconds, the error that ended one) and every instrument's
values by attribute set. Read another proc's with
``procs.execute(telemetry.recent_spans)`` or ``procs.execute(telemetry.metrics)``.
While a PyTorch profiler runs, a span is also a ``record_function`` range, so
it shows in the profiler's trace (Perfetto, TensorBoard) next to the ops it
ran. Monarch sends spans to its Rust tracing backends instead; what its
meters do not implement (gauges, observable instruments) is refused here too.
"""

from __future__ import annotations

import collections
import functools
import inspect
import sys
import threading
import time
from typing import Any, Callable, Literal

from ..runtime import _context

MAX_SPANS = 10_000

_spans: collections.deque = collections.deque(maxlen=MAX_SPANS)


class Span:
    """A timed block: ``with span("name"):``. Exceptions pass through; the span records their repr."""

    __slots__ = ("name", "_start", "_wall", "_range")

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"a span's name is a non-empty string, got {name!r}")
        self.name = name
        self._range: Any = None  # torch.autograd.profiler.record_function, while the profiler records

    def __enter__(self) -> Span:
        torch = sys.modules.get("torch")
        if torch is not None and torch.autograd.profiler._is_profiler_enabled:
            self._range = torch.autograd.profiler.record_function(self.name)
            self._range.__enter__()
        self._wall = time.time()
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        seconds = time.perf_counter() - self._start
        if self._range is not None:
            self._range.__exit__(exc_type, exc, tb)
            self._range = None
        ctx = _context.current()
        actor = "client" if _context.in_client() else ctx.name
        _spans.append({"name": self.name, "actor": actor, "rank": ctx.rank.rank, "start": self._wall,
                       "seconds": seconds, "error": None if exc is None else repr(exc)})
        return False


def span(name: str) -> Span:
    """A span named ``name`` in the running actor (Monarch's ``span``)."""
    return Span(name)


def traced(fn: Callable | None = None, *, name: str | None = None):
    """``@traced`` or ``@traced(name="...")``: every call of the function (sync or async) runs in a span."""

    def decorator(f: Callable) -> Callable:
        if not callable(f):
            raise TypeError(f"@traced decorates a function, got {f!r}")
        span_name = name if name is not None else f.__name__
        if inspect.iscoroutinefunction(f):
            @functools.wraps(f)
            async def async_wrapper(*args, **kwargs):
                with Span(span_name):
                    return await f(*args, **kwargs)

            return async_wrapper

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            with Span(span_name):
                return f(*args, **kwargs)

        return wrapper

    return decorator(fn) if fn is not None else decorator


def recent_spans(clear: bool = False) -> list[dict[str, Any]]:
    """This process's recorded spans, oldest first (``clear``: and forget them)."""
    out = list(_spans)
    if clear:
        _spans.clear()
    return out


# ---- metrics --------------------------------------------------------------------------------
def _key(attributes) -> tuple:
    if attributes is None:
        return ()
    if not isinstance(attributes, dict):
        raise TypeError(f"attributes are a dict of names to values, got {attributes!r}")
    return tuple(sorted(attributes.items()))


class _Instrument:
    kind = "?"

    def __init__(self, name: str, unit: str = "", description: str = "") -> None:
        self.name, self.unit, self.description = name, unit, description
        self._values: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def values(self) -> dict[tuple, Any]:
        with self._lock:
            return {k: dict(v) if isinstance(v, dict) else v for k, v in self._values.items()}


class Counter(_Instrument):
    """A total that only grows: ``add(amount, attributes)``."""

    kind = "counter"
    grows_only = True

    def add(self, amount: int | float, attributes: dict | None = None, context: Any = None) -> None:
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ValueError(f"{self.kind} {self.name!r}: add() takes a number, got {amount!r}")
        if self.grows_only and amount < 0:
            raise ValueError(f"counter {self.name!r} only grows: add() takes a number >= 0, got {amount!r}")
        key = _key(attributes)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount


class UpDownCounter(Counter):
    """A total that goes both ways: ``add(-1)``."""

    kind = "up_down_counter"
    grows_only = False


class Histogram(_Instrument):
    """A distribution of recorded values: count, sum, min and max per attribute set."""

    kind = "histogram"

    def record(self, amount: int | float, attributes: dict | None = None, context: Any = None) -> None:
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ValueError(f"histogram {self.name!r}: record() takes a number, got {amount!r}")
        key = _key(attributes)
        with self._lock:
            s = self._values.get(key)
            if s is None:
                self._values[key] = {"count": 1, "sum": amount, "min": amount, "max": amount}
            else:
                s["count"] += 1
                s["sum"] += amount
                s["min"] = min(s["min"], amount)
                s["max"] = max(s["max"], amount)


class Meter:
    """OpenTelemetry's ``Meter`` interface over this process's record (``get_meter()``); an instrument
    asked for twice by the same name is the same one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._instruments: dict[str, _Instrument] = {}
        self._lock = threading.Lock()

    def _make(self, cls, name: str, unit: str, description: str):
        if not isinstance(name, str) or not name:
            raise TypeError(f"an instrument's name is a non-empty string, got {name!r}")
        with self._lock:
            got = self._instruments.get(name)
            if got is None:
                got = self._instruments[name] = cls(name, unit, description)
            elif type(got) is not cls:
                raise ValueError(f"instrument {name!r} is already a {got.kind}, not a {cls.kind}")
            return got

    def create_counter(self, name: str, unit: str = "", description: str = "") -> Counter:
        return self._make(Counter, name, unit, description)

    def create_up_down_counter(self, name: str, unit: str = "", description: str = "") -> UpDownCounter:
        return self._make(UpDownCounter, name, unit, description)

    def create_histogram(self, name: str, unit: str = "", description: str = "", **_bounds) -> Histogram:
        return self._make(Histogram, name, unit, description)

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("gauges and observable instruments are not supported (nor by Monarch's meter): "
                                  "use a counter, an up-down counter or a histogram")

    create_gauge = create_observable_counter = create_observable_gauge = _unsupported
    create_observable_up_down_counter = _unsupported

    def metrics(self) -> dict[str, dict]:
        with self._lock:
            instruments = list(self._instruments.values())
        return {i.name: {"kind": i.kind, "unit": i.unit, "values": i.values()} for i in instruments}


_meter = Meter("monarch_tensor")


def get_meter() -> Meter:
    """This process's meter (Monarch's ``get_meter``)."""
    return _meter


def metrics() -> dict[str, dict]:
    """Every instrument of ``get_meter()`` and its values by attribute set."""
    return _meter.metrics()
