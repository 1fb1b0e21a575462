"""Smoke test of bench/actor_bench.py: every workload runs at a tiny size and reports a number.

Each bench takes 20-50 s alone on 2 cores; the timeouts leave room for the suite's other workers (pytest-xdist)
sharing the cores."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "actor_bench.py")
# The benches of the tensor engine run as a user runs them, with the warm-up that tests/conftest.py turns off for
# the tests' own procs: their procs then fork with torch._dynamo loaded once instead of each importing it.
AS_A_USER = {k: v for k, v in os.environ.items() if k != "MONARCH_TENSOR_NO_WARMUP"}


@pytest.mark.timeout(300)
def test_actor_bench_tiny(tmp_path):
    out = tmp_path / "tiny.json"
    proc = subprocess.run([sys.executable, BENCH, "--tiny", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["env"]["tiny"] is True
    assert "ours" not in data["errors"], data["errors"]
    ours = data["median"]["ours"]
    for key in data["workloads"]:
        assert key in ours, f"no result for workload {key}: {proc.stdout[-2000:]}"
        # (CPU time is counted in clock ticks: a tiny run's few calls may take less than one in the proc)
        assert ours[key] >= 0 if key.endswith("_cpu_us") else ours[key] > 0, (key, ours[key])
    for key in ("bcast_1_us", "bcast_2_us", "rtt_us", "pipelined_per_s", "call_both_us", "echo_gib_s", "spawn_s",
                "pipe_ctl_cpu_us", "pipe_proc_cpu_us"):
        assert key in ours
    floor = data["median"]["floor"]
    for key in ("zmq_reqrep_us", "zmq_pipelined_per_s", "zmq_echo_gib_s", "unix_rtt_us"):
        assert floor.get(key, 0) > 0, (key, data["errors"].get("floor"))
    assert "kernel floor: a blocking Unix-socket round trip" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.timeout(300)
def test_compare_runs_the_working_tree_against_a_revision(tmp_path):
    """bench/compare.py: a scratch worktree of the revision, both trees' actor bench in turns, a table with
    the ratio, the worktree removed after."""
    out = tmp_path / "cmp.json"
    before = _compare_worktrees()  # (another checkout's compare.py may run at the same time)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "compare.py"), "HEAD", "--bench", "actor",
                           "--tiny", "--runs", "1", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert sorted(data["trees"]) == ["HEAD", "work"]
    actor = data["actor"]
    assert actor["errors"] == {}, actor["errors"]
    for tree in ("work", "HEAD"):
        assert actor["median"][tree]["pipelined_per_s"] > 0, actor["median"][tree]
    assert "work vs HEAD" in proc.stdout
    assert _compare_worktrees() <= before, _compare_worktrees()


def _compare_worktrees() -> set[str]:
    """The scratch worktrees of bench/compare.py that git lists."""
    out = subprocess.run(["git", "-C", ROOT, "worktree", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if "mt-compare-" in line}


DISPATCH = os.path.join(ROOT, "bench", "dispatch_bench.py")


@pytest.mark.timeout(300)
def test_dispatch_bench_tiny(tmp_path):
    out = tmp_path / "tiny.json"
    proc = subprocess.run([sys.executable, DISPATCH, "--tiny", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["env"]["tiny"] is True
    assert data["errors"] == {}, data["errors"]
    for kind in ("ours", "eager"):
        for key in data["workloads"]:
            assert data["median"][kind].get(key, 0) > 0, (kind, key, proc.stdout[-2000:])
    assert "ours/eager" in proc.stdout


@pytest.mark.timeout(300)
def test_sync_bench_tiny(tmp_path):
    out = tmp_path / "sync.json"
    bench = os.path.join(ROOT, "bench", "sync_bench.py")
    proc = subprocess.run([sys.executable, bench, "--tiny", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["env"]["tiny"] is True
    r = data["results"]
    for key in ("changed_1_ms", "first_small_s", "first_big_mb_s", "first_big_messages_mb_s", "first_big_copied_mb_s",
                "data_plane_mb_s", "file_writes_mb_s", "file_writes_2_lanes_mb_s", "call_all_ms",
                "first_big_bound_mb_s", "transport_mb_s", "memcpy_mb_s", "copies_2_lanes_mb_s",
                "first_big_copied_bound_mb_s"):
        assert r[key] > 0, (key, r)
    assert len(r["changed_1_runs_ms"]) == data["settings"]["REPEATS"]
    assert "one changed file of 200, 2 procs" in proc.stdout
    for how in ("pulled", "messages", "copied"):
        assert sorted(r["first_big_phases_ms"][how]) == ["diff", "reload", "roots", "write"]
    assert "where a first full sync of 2 MB went" in proc.stdout
    assert "best any first sync could do here" in proc.stdout
    assert "best a copying sync could do here" in proc.stdout


@pytest.mark.timeout(300)
def test_scale_bench_tiny(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "scale_bench.py"), "--tiny", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {(r["agents"], r["procs"], r["fanout"]) for r in data["rows"]} == {(1, 1, 8), (1, 2, 8), (1, 4, 8), (2, 4, 8),
                                                                          (2, 4, 1)}
    assert all(r["spawn_s"] > 0 and r["gather_us"] > 0 and r["direct_us"] > 0 and r["fold_us"] > 0
               for r in data["rows"])
    m = data["model"]
    assert m["depth"] == 4 and m["target"] == "1024 hosts x 8 procs"
    assert m["gather_us"] > 0 and m["direct_us"] > 0 and m["spawn_s"] > 0 and m["agent_level_us"] > 0
    assert m["fold_us"] > 0 and m["agent_fold_level_us"] > 0 and m["controller_fold_us"] > 0
    assert "Accumulator (max, folded in the agents)" in proc.stdout
    assert m["spawn_plan"]["ctl_ms"] > 0 and m["spawn_plan"]["agent_ms"] > 0 and m["spawn_level_s"] >= 0
    assert "root agents' passes" in proc.stdout
    eq = data["equal_load"]  # the same 4 procs up: calls to all, to 2, a broadcast to 2 and a call to 2, ...
    assert eq["procs"] == 4 and eq["slice_procs"] == 2
    assert all(eq[k]["cpu_us"] > 0 and eq[k]["wall_us"] > 0
               for k in ("all", "fold", "slice", "bcast_slice", "bcast", "burner"))
    assert eq["all"]["chunks"] >= 1 and eq["slice"]["chunks"] >= 1
    assert data["controller_entry"]["call_us"] > 0 and data["controller_entry"]["read_us"] > 0
    ce = data["controller_entry"]
    assert m["entry_model_us"] == max(m["entry_fold_us"], ce["read_us"]) + ce["call_us"] and m["gather_raw_us"] > 0
    assert "the same 4 procs up on one agent" in proc.stdout and "with the raw slope" in proc.stdout


@pytest.mark.timeout(300)
def test_sharded_bench_tiny(tmp_path):
    # --no-tp: tp_step's 4 procs per side (a torchrun of 4 ranks on 2 cores) add about 35 s; `--tiny` alone runs it
    out = tmp_path / "sharded.json"
    bench = os.path.join(ROOT, "bench", "sharded_bench.py")
    proc = subprocess.run([sys.executable, bench, "--tiny", "--no-tp", "--json", str(out)],
                          cwd=ROOT, env=AS_A_USER, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["env"]["tiny"] is True
    assert "ours" not in data["errors"], data["errors"]
    assert set(data["workloads"]) == {"matmul_ms", "full_ms", "fsdp_step_ms"}
    for kind in ("ours", "local", "spmd"):
        for key in data["workloads"]:
            assert data["median"][kind].get(key, 0) > 0, (kind, key, data["errors"], proc.stdout[-2000:])
    assert data["median"]["fsdp2"].get("fsdp_step_ms", 0) > 0, (data["errors"], proc.stdout[-2000:])
    # the same seed and data: ours computes what local torch and the SPMD script compute
    match = data["loss_match"]["fsdp"]
    assert match["ours_vs_spmd"] and match["ours_vs_local"] and match["ours_vs_fsdp2"], data["losses"]
    assert data["value_match"]["ours_vs_spmd"] and data["value_match"]["ours_vs_local"], data["value_match"]
    assert "ours/spmd" in proc.stdout


@pytest.mark.timeout(300)
def test_payload_bench_tiny(tmp_path):
    out = tmp_path / "payload.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "payload_bench.py"), "--tiny", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["env"]["tiny"] is True
    assert {r["way"] for r in data["results"]} == {"frames", "dp", "tcp"}
    assert all(r["gib_s"] > 0 for r in data["results"])
    # Each way really went its way: no pulls in the frames; pulls over cma, then over tcp, otherwise.
    p = data["pulled"]
    assert p["frames"]["payloads"] == 0
    assert p["dp"]["payloads"] > 0 and p["dp"]["cma"] == p["dp"]["payloads"] and p["dp"]["tcp"] == 0
    assert p["tcp"]["payloads"] > 0 and p["tcp"]["tcp"] > 0 and p["tcp"]["cma"] == 0
    assert "data plane / frames" in proc.stdout


@pytest.mark.timeout(300)
def test_ddp_bench_tiny(tmp_path):
    out = tmp_path / "ddp.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ddp_bench.py"), "--tiny", "--json", str(out)],
                          cwd=ROOT, env=AS_A_USER, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["env"]["tiny"] is True and data["errors"] == {}, data["errors"]
    for key in ("after_ms", "bucket_ms", "overlap_ms", "ddp_ms"):
        assert data["median"].get(key, 0) > 0, (key, proc.stdout[-2000:])
    # both of ours train exactly as DDP does
    assert data["loss_match"] == {"after": True, "bucket": True, "overlap": True}, data["losses"]
    assert "overlap / after" in proc.stdout and "bucket / after" in proc.stdout


@pytest.mark.timeout(300)
def test_train_bench_tiny(tmp_path):
    # ours FSDP, DDP compiled (with --fused) and local eager (the reference): the torchrun launches and the 4-proc
    # layouts (--no-tp) would add a minute on 2 cores
    out = tmp_path / "train.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "train_bench.py"), "--tiny", "--no-tp", "--fused", "--json",
           str(out)]
    for kind in ("fsdp", "ddp_c"):
        cmd += ["--only", kind]
    proc = subprocess.run(cmd, cwd=ROOT, env=AS_A_USER, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["env"]["tiny"] is True and data["errors"] == {}, data["errors"]
    assert data["kinds"] == ["local", "fsdp", "ddp_c"] and data["settings"]["FUSED"] is True
    for kind in data["kinds"]:
        assert data["median"][kind]["step_ms"] > 0 and data["median"][kind]["first_s"] > 0, (kind, proc.stdout[-2000:])
        assert data["median"][kind]["cpu_ms"] > 0, (kind, proc.stdout[-2000:])  # (ours: the controller and its procs)
        assert len(data["losses"][kind]) >= data["settings"]["CHECK_STEPS"]
    # the data-parallel paths train exactly as local torch; a layout that unties lm_head from wte does not
    assert data["loss_match"]["ddp_c"] is True, data["losses"]
    assert data["tied"]["ddp_c"] and data["tied"]["local"]
    assert data["loss_match"]["fsdp"] == data["tied"]["fsdp"], data["losses"]
    assert data["replays"]["ddp_c"][0] >= 1, proc.stdout[-2000:]  # the compiled step was replayed, not re-recorded
    assert "| ours {dp: 2} DDP, compiled" in proc.stdout and "losses match" in proc.stdout


@pytest.mark.timeout(300)
def test_first_op_bench_tiny(tmp_path):
    out = tmp_path / "first_op.json"
    bench = os.path.join(ROOT, "bench", "first_op_bench.py")
    proc = subprocess.run([sys.executable, bench, "--tiny", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["env"]["tiny"] is True
    assert data["errors"] == {}, data["errors"]
    for key in ("setup_s", "first_s", "second_s"):
        assert data["median"]["warm"][key] > 0, (key, proc.stdout[-2000:])


COMPILE = os.path.join(ROOT, "bench", "compile_bench.py")


@pytest.mark.timeout(300)
def test_compile_bench_tiny(tmp_path):
    out = tmp_path / "tiny.json"
    proc = subprocess.run([sys.executable, COMPILE, "--tiny", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["env"]["tiny"] is True
    for key, r in data["results"].items():
        assert r["ctl_us"] > 0 and r["step_ms"] > 0, (key, r)
        if key.endswith("/compiled"):
            assert 0 < r["msgs"] <= 2, (key, r)  # one message per proc per step, and the loop's fetch
            assert r["guard_us"] > 0, (key, r)  # (the function replayed: it has a program whose guards held)
    assert "compiled" in proc.stdout


@pytest.mark.timeout(300)
def test_compile_bench_peers_rows_or_a_note_that_says_why_not(tmp_path):
    # PyTorch Monarch's compile on its own 1-proc mesh, where torchmonarch is installed aside (MT_BENCH_PEER_PATH);
    # elsewhere (CI) a note under the table says it is not installed, and the bench still finishes.
    out = tmp_path / "tiny.json"
    proc = subprocess.run([sys.executable, COMPILE, "--tiny", "--peers", "--modes", "compiled", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    peer = {k: r for k, r in results.items() if k.endswith("/Monarch compiled")}
    if peer:
        ran = {k: r for k, r in peer.items() if "error" not in r}
        assert ran, peer  # (its MLP and GPT steps compile there: 2026-12-01, torchmonarch 0.7.0)
        for key, r in ran.items():
            assert r["ctl_us"] > 0 and r["step_ms"] > 0 and r["msgs"] is None, (key, r)
        assert "Monarch compiled" in proc.stdout, proc.stdout[-2000:]
    else:
        assert "not installed" in results.get("error", ""), (results, proc.stdout[-2000:])
        assert "Monarch: torchmonarch is not installed" in proc.stdout, proc.stdout[-2000:]
