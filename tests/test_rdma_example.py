"""examples/weight_sync.py and bench/rdma_bench.py run (tiny), and report what they should."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(150)
def test_weight_sync_example_keeps_generators_in_sync():
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join("examples", "weight_sync.py"),
                        "--steps", "3", "--width", "256"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = [ln for ln in p.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 3, p.stdout
    for ln in steps:
        rates = [float(x) for x in re.findall(r"gen\d: +([\d.]+) GiB/s", ln)]
        assert len(rates) == 2, ln  # (a rate, not checked: a loaded machine may print 0.00)
        assert "in sync: True" in ln, ln
    assert "weights in sync after every step: True" in p.stdout
    assert "generators agree: True" in p.stdout


@pytest.mark.timeout(120)
def test_rdma_bench_tiny(tmp_path):
    out = tmp_path / "rdma.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "rdma_bench.py"), "--tiny", "--json", str(out),
                        "--plot", str(tmp_path / "rdma.png")],
                       cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["settings"]["tiny"] is True and data["ctrl_rtt_us"] > 0
    assert data["owner_thp_env"] == os.environ.get("THP_MEM_ALLOC_ENABLE", "1")  # the owner proc's THP switch
    for row in data["seconds"]:
        for col in ("memcpy", "copy_ (all cores)", "raw tcp stream", "pyzmq copy", "gloo send/recv",
                    "cma read", "cma write", "tcp read", "tcp write"):
            assert row[col] > 0, (row["size"], col)
    # every backend is listed, the unavailable ones with why
    assert set(data["backends"]) == {"verbs", "cuda_ipc", "cma", "tcp"}
    for name, state in data["backends"].items():
        assert state == "available" or state.startswith("unavailable: "), (name, state)
        assert f"{name:>8}: {state}" in p.stdout
    assert data["backends"]["tcp"] == "available"
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "rdma.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "no plot: matplotlib is not installed" in p.stdout


def _bench_tiny(tmp_path, mode: str) -> tuple[str, dict]:
    """``rdma_bench.py --tiny MODE --json``: its stdout and its JSON (it must exit 0)."""
    out = tmp_path / f"{mode.strip('-')}.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "rdma_bench.py"), "--tiny", mode, "--json",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout, json.loads(out.read_text())


@pytest.mark.timeout(120)
def test_rdma_bench_layers_tiny(tmp_path):
    stdout, data = _bench_tiny(tmp_path, "--layers")
    assert data["settings"]["LAYER_SIZES"] == [4096]
    for layer in ("raw tcp stream", "our reader, minimal owner", "our reader and owner", "read_into().get()"):
        assert data["seconds"][layer]["4096"] > 0, layer
    assert "where a tcp read's time goes" in stdout


@pytest.mark.timeout(120)
def test_rdma_bench_distance_tiny(tmp_path):
    stdout, data = _bench_tiny(tmp_path, "--distance")
    assert data["settings"]["DISTANCE_SIZES"] == [65536] and isinstance(data["string_copies"], bool)
    for kind in ("read", "write"):
        for col in ("same page offset", "16 B apart, direct", "16 B apart, staged"):
            assert data["seconds"][f"{kind} {col}"]["65536"] > 0, (kind, col)
    assert "16 bytes away" in stdout
