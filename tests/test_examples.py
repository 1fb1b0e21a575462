"""Every example runs to completion as a script and prints what it promises."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str, timeout: float = 90, args: tuple = ()) -> subprocess.CompletedProcess:
    # An example runs as a user runs it, with the warm-up (tests/conftest.py turns it off for this process's own
    # procs): its procs fork with torch._dynamo loaded once in their template instead of each importing it.
    env = {k: v for k, v in os.environ.items() if k != "MONARCH_TENSOR_NO_WARMUP"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, os.path.join("examples", name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.mark.timeout(120)
def test_actors_basics():
    out = run_example("actors_basics.py").stdout
    lines = out.splitlines()
    # spawn on a {"gpus": 4} mesh
    assert "proc mesh {'gpus': 4}" in out
    for r in range(4):
        assert any(ln.startswith(f"  gpus={r}: rank {r} of {{'gpus': 4}}") for ln in lines), out
    # adverbs
    assert "call()            -> [1, 1, 1, 1]" in lines
    assert "after broadcast   -> [11, 11, 11, 11]" in lines
    assert "slice(gpus=2)     -> 111" in lines
    assert "slice(gpus=0:2)   -> ValueMesh({'gpus': 2}, [11, 11])" in lines
    assert re.search(r"^choose\(\)          -> rank [0-3] of", out, re.M)
    stream = re.search(r"^stream\(\) arrivals -> (.*)$", out, re.M).group(1)
    assert sorted(stream.split(", ")) == [f"rank {r}: 49" for r in range(4)]
    # ping-pong: every actor of each mesh reached its peer on the other mesh
    for r in range(2):
        assert f"  pong:{r} got <ping:{r} says 'ping!'>" in lines
        assert f"  ping:{r} got <pong:{r} says 'pong!'>" in lines
    # ActorError
    assert ("caught ActorError from counter.divide on rank 3: ZeroDivisionError('float division by zero')"
            in lines)
    assert "the actor keeps serving: divide(1, 4) -> 0.25" in lines
    # supervision
    assert "pending call raised SupervisionError (rank 1: exited with code 1)" in lines
    assert "fault hook recorded a failure (rank 2: killed by signal SIGKILL)" in lines
    assert sum(ln.startswith("fault hook recorded") for ln in lines) == 1
    assert re.search(r"^later call on the whole mesh raised SupervisionError \(rank [12]: ", out, re.M)
    assert re.search(r"^slice\(gpus=0\) without the dead procs still works -> pid \d+$", out, re.M)
    assert re.search(r"^all meshes stopped; done in [\d.]+ s$", out, re.M)


@pytest.mark.timeout(120)
def test_trainer_loss_decreases():
    out = run_example("trainer.py").stdout
    steps = re.findall(r"^step +(\d+) \| loss ([\d.]+) \| per rank ((?:[\d.]+ ?){4}) \|", out, re.M)
    assert [int(s) for s, _, _ in steps] == list(range(30)), out
    losses = [float(v) for _, v, _ in steps]
    assert all(len(per.split()) == 4 for _, _, per in steps)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses  # it learns
    assert out.count("weights averaged") == 6
    final = re.search(r"^final loss per rank: (.*)$", out, re.M).group(1)
    assert [p.split(":")[0] for p in final.split(", ")] == [f"gpus={r}" for r in range(4)]
    assert re.search(r"^done in [\d.]+ s$", out, re.M)


@pytest.mark.timeout(120)
def test_mesh_tensors():
    out = run_example("mesh_tensors.py").stdout
    lines = out.splitlines()
    for r in range(4):
        h, g = divmod(r, 2)
        assert f"x on hosts={h}, gpus={g}: {[float(r + 1)] * 4}" in lines, out
    assert "reduce over all ranks, sum     -> [10.0, 10.0, 10.0, 10.0]" in lines
    assert "reduce over gpus, avg (hosts=1) -> [3.5, 3.5, 3.5, 3.5]" in lines
    assert "reduce over gpus, stack shape   -> (2, 4)" in lines
    assert "to_mesh hosts=0 -> hosts=1, gpus=1 now holds [2.0, 2.0, 2.0, 2.0]" in lines
    for r in range(4):
        v = 2.0 * (r + 1)
        assert f"actor got rank {r}: Tensor {[v] * 4}, norm {2 * v:.1f}" in lines, out
    # d(sum(W x + b))/dW has x in every row: rank 3's x is [4, 4, 4, 4]
    assert "OpaqueModule: same weights on every rank: True; weight.grad row on hosts=1, gpus=1: " \
           "[4.0, 4.0, 4.0, 4.0]" in lines, out
    assert any(ln.startswith("shape error raised at once:") for ln in lines), out
    # the RemoteException names the op, the rank, and the example's own line
    i = lines.index("fetch raised RemoteException:")
    assert "aten::_linalg_check_errors failed on rank 0" in lines[i + 1] and "not positive-definite" in lines[i + 1]
    assert re.search(r"issued at .*mesh_tensors\.py:\d+ in <module>", lines[i + 2])
    assert "factor = torch.linalg.cholesky(-torch.eye(2))" in lines[i + 3]
    assert "the mesh is still usable: [2.0, 2.0, 2.0, 2.0]" in lines


@pytest.mark.timeout(150)
def test_iterate_and_debug():
    out = run_example("iterate_and_debug.py", timeout=140).stdout  # stdin not a terminal: the script inspects
    lines = out.splitlines()
    assert re.search(r"^first sync: 6 files to 1 root\(s\)", out, re.M), out
    assert "config synced (titan_ws/train_configs/debug_model.toml)" in out
    run2 = re.search(r"^run 2 \(lr 1e-2, 8 steps\): loss ([\d.]+) -> ([\d.]+); edit \+ sync \+ run in ([\d.]+) s",
                     out, re.M)
    assert float(run2.group(2)) < float(run2.group(1)), out  # the new config trains
    assert "code synced; reloaded on every rank: ['titan_lite.train']" in lines
    assert "[0] titan_lite: clipping gradients at 1.0" in lines  # the running actors ran the new code
    assert "RANK per rank: ['0', '1', '2', '3']" in lines
    assert "mismatches: NCCL_SOCKET_IFNAME: 'eth0' on ranks [0, 1, 2]; 'eth1' on ranks [3]" in lines
    assert re.search(r"^paused: trainer rank 0 at train\.py:\d+ in titan_lite\.train\.train$", out, re.M), out
    assert re.search(r"^  \(Pdb\) p step, round\(loss\.item\(\), 3\) -> \(2, [\d.]+\)$", out, re.M), out
    assert "continued" in lines and re.search(r"^run 4 finished after the breakpoint", out, re.M)
    assert re.search(r"^done in [\d.]+ s$", out, re.M)


@pytest.mark.timeout(120)
def test_cluster_job():
    lines = run_example("cluster_job.py").stdout.splitlines()
    assert any(ln.startswith("hosts: {'hosts': 2} mounted at") and "'hello.py'" in ln for ln in lines), lines
    for h in (0, 1):
        assert any(ln.startswith(f"[hosts_{h}_procs_0] hello from ") and f"host {h} of 2" in ln for ln in lines)
        assert f"[hosts_1_gpus_{h}] host 1 gpu {h}" in lines
    assert lines.count("exit status: 0") == 2
