"""Monarch's telemetry names: spans (in the script, in actors, in PyTorch profiler traces) and meters."""

import asyncio

import pytest
import torch

from monarch_tensor.actor import Actor, endpoint, get_meter, span, telemetry, this_host, traced

pytestmark = pytest.mark.timeout(60)


class Worker(Actor):
    @endpoint
    def work(self, n: int) -> int:
        with span("inner"):
            total = sum(range(n))
        get_meter().create_counter("items").add(n, {"kind": "range"})
        return total

    @endpoint
    def report(self) -> tuple:
        return telemetry.recent_spans(clear=True), telemetry.metrics()


@traced
def _double(x):
    return 2 * x


@traced(name="custom")
async def _later(x):
    await asyncio.sleep(0)
    return x + 1


def test_spans_in_the_script_record_name_duration_and_errors():
    telemetry.recent_spans(clear=True)
    with span("outer"):
        assert _double(3) == 6
    assert asyncio.run(_later(1)) == 2
    with pytest.raises(ZeroDivisionError):
        with span("fails"):
            raise ZeroDivisionError("division by zero")
    got = telemetry.recent_spans(clear=True)
    assert [s["name"] for s in got] == ["_double", "outer", "custom", "fails"]  # in the order they ended
    assert all(s["actor"] == "client" and s["rank"] == 0 and s["seconds"] >= 0 for s in got)
    assert got[3]["error"] == "ZeroDivisionError('division by zero')" and got[0]["error"] is None
    assert _double.__name__ == "_double" and telemetry.recent_spans() == []
    with pytest.raises(TypeError, match="non-empty string"):
        span("")


def test_spans_in_actors_are_kept_by_their_procs_with_their_actor_and_rank():
    procs = this_host().spawn_procs({"gpus": 2})
    try:
        w = procs.spawn("telemetry_worker", Worker)
        assert w.work.call(1000).get(timeout=30).values() == [499500, 499500]
        w.work.call(10).get(timeout=30)
        reports = w.report.call().get(timeout=30).values()
    finally:
        procs.stop()
    for rank, (spans, metrics) in enumerate(reports):
        assert [(s["name"], s["actor"], s["rank"]) for s in spans] == [("inner", "telemetry_worker", rank)] * 2
        assert metrics["items"] == {"kind": "counter", "unit": "", "values": {(("kind", "range"),): 1010}}


def test_a_span_is_a_range_in_a_pytorch_profiler_trace():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with span("my_block"):
            torch.ones(8) @ torch.ones(8)
    assert "my_block" in [e.name for e in prof.events()]


def test_meters_keep_values_by_attributes():
    m = get_meter()
    c = m.create_counter("test_requests", unit="1")
    assert m.create_counter("test_requests") is c
    c.add(2, {"route": "a"})
    c.add(3, {"route": "a"})
    c.add(1)
    ud = m.create_up_down_counter("test_inflight")
    ud.add(5)
    ud.add(-2)
    h = m.create_histogram("test_latency", unit="s")
    for v in (0.5, 0.1, 0.3):
        h.record(v, {"op": "read"})
    got = telemetry.metrics()
    assert got["test_requests"]["values"] == {(("route", "a"),): 5, (): 1}
    assert got["test_inflight"]["values"] == {(): 3}
    lat = got["test_latency"]["values"][(("op", "read"),)]
    assert lat["count"] == 3 and lat["min"] == 0.1 and lat["max"] == 0.5 and abs(lat["sum"] - 0.9) < 1e-9
    with pytest.raises(ValueError, match="only grows"):
        c.add(-1)
    with pytest.raises(ValueError, match="already a counter"):
        m.create_histogram("test_requests")
    with pytest.raises(TypeError, match="attributes are a dict"):
        c.add(1, ["route"])
    with pytest.raises(NotImplementedError, match="not supported"):
        m.create_observable_gauge("g", callbacks=[])
