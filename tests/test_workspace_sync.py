"""Workspace sync: file-tree rules (unit and property tests), then real procs with two distinct roots."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pathlib
import shutil
import time
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monarch_tensor import Workspace
from monarch_tensor import workspace_sync as ws_sync
from monarch_tensor.actor import Actor, endpoint, this_host
from monarch_tensor.debugger import messages as debug_messages
from monarch_tensor.env import messages as env_messages
from monarch_tensor.runtime import _hooks
from monarch_tensor.tools.config import Workspace as WorkspaceFromToolsPath
from monarch_tensor.transport import _wire
from monarch_tensor.transport.mailbox import SYSTEM_HANDLERS
from monarch_tensor.transport.messages import PortRef
from monarch_tensor.workspace_sync import _Batcher, _filetree, _Pulls, local_manifest, plan
from monarch_tensor.workspace_sync import _proc as _sync_proc
from monarch_tensor.workspace_sync import messages as sync_messages

pytestmark = pytest.mark.timeout(90)
_hooks.load()  # the procs' handlers, in this process too


# ---- protocol ---------------------------------------------------------------------------------
def _protocol():
    for mod in (sync_messages, env_messages, debug_messages):
        for obj in vars(mod).values():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == mod.__name__:
                yield obj


SAMPLES = {  # a value per annotated field type of the protocol modules
    "str": "x", "int": 3, "bool": True, "dict": {"a/b.py": (1, 2, 420)}, "tuple": (("d", "a/b.py"),),
    "PortRef": PortRef("ipc:///tmp/x", 4), "PortRef | None": PortRef("ipc:///tmp/x", 5),
    "tuple[str, ...]": ("a", "b"), "tuple[str, ...] | None": ("PATH",), "str | None": "tcp://10.0.0.2:26600",
}


@pytest.mark.parametrize("cls", list(_protocol()), ids=lambda c: c.__name__)
def test_every_message_round_trips_and_has_a_handler(cls):
    msg = cls(**{f.name: SAMPLES[f.type] for f in dataclasses.fields(cls)})
    assert _wire.decode(_wire.encode(msg)) == msg
    if cls.__name__ != "WorkspaceDiff":  # a reply value, not a message
        assert cls in SYSTEM_HANDLERS, f"no handler for {cls.__name__}"


def test_workspace_config_paths_and_errors(tmp_path):
    assert Workspace is WorkspaceFromToolsPath
    ws = Workspace(dirs=[tmp_path / "proj", str(tmp_path / "lib")])
    assert list(ws.dirs.values()) == ["proj", "lib"]
    assert list(Workspace(dirs={tmp_path: "code/x"}).dirs.values()) == ["code/x"]
    with pytest.raises(ValueError, match="without '.' or '..'"):
        Workspace(dirs={tmp_path: "../escape"})
    with pytest.raises(ValueError, match="same remote dir"):
        Workspace(dirs=[tmp_path / "a" / "proj", tmp_path / "b" / "proj"])
    with pytest.raises(ValueError, match="must not nest"):
        Workspace(dirs={tmp_path / "a": "", tmp_path / "b": "b"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Workspace(dirs=[tmp_path / "missing"]).check()


def test_merge_lays_the_dirs_out_as_a_root_gets_them(tmp_path):
    (tmp_path / "proj" / "pkg").mkdir(parents=True)
    (tmp_path / "proj" / "pkg" / "m.py").write_text("X = 1\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "data.txt").write_text("d")
    Workspace(dirs={tmp_path / "proj": "code", tmp_path / "lib": "lib"}).merge(tmp_path / "out")
    assert (tmp_path / "out" / "code" / "pkg" / "m.py").read_text() == "X = 1\n"
    assert (tmp_path / "out" / "lib" / "data.txt").read_text() == "d"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Workspace(dirs=[tmp_path / "missing"]).merge(tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("how", ["messages", "pull", "copy"])
def test_symlinks_are_followed_to_files_and_directories_but_not_round_a_loop(tmp_path, how):
    """A symlinked directory outside the synced dir arrives as a directory of copies, as a symlinked file
    arrives as a copy; a link to a directory inside it (whose files come at their own path: a venv's
    ``lib64 -> lib``), a link back to a directory that holds it (a loop), a dangling link and an empty
    directory bring nothing; and ``Workspace.merge`` lays out exactly what a sync writes."""
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "w.bin").write_bytes(b"w" * 5000)
    (outside / "v.py").write_text("V = 1\n")
    src = tmp_path / "src"
    (src / "sub" / "empty").mkdir(parents=True)
    (src / "sub" / "a.py").write_text("A = 1\n")
    (src / "linked").symlink_to(outside)
    (src / "sub" / "loop").symlink_to(src)  # holds sub: followed, it would repeat the tree for ever
    (src / "sub" / "self").symlink_to(src / "sub")
    (src / "alias").symlink_to(src / "sub")
    (src / "file_link.py").symlink_to(src / "sub" / "a.py")
    (src / "dangling").symlink_to(tmp_path / "nowhere")
    want = {"sub/a.py": b"A = 1\n", "linked/deep/w.bin": b"w" * 5000, "linked/v.py": b"V = 1\n",
            "file_link.py": b"A = 1\n"}
    assert tree(str(src)) == want
    root = str(tmp_path / "root")
    with mock.patch.object(ws_sync, "PULL_MIN", 1), mock.patch.object(ws_sync, "INBAND", 1):
        sync_in_process(str(src), root, how == "pull", how == "copy")
    assert tree(os.path.join(root, "ws")) == want
    assert not any(os.path.islink(os.path.join(d, n)) for d, ds, fs in os.walk(root) for n in ds + fs)
    Workspace(dirs={src: "ws"}).merge(tmp_path / "merged")
    assert tree(str(tmp_path / "merged" / "ws")) == want
    assert sorted(os.listdir(tmp_path / "merged" / "ws")) == ["file_link.py", "linked", "sub"]


def test_module_names_and_bad_paths(tmp_path):
    assert _filetree.module_name("proj/pkg/mod.py", ["proj"]) == "pkg.mod"
    assert _filetree.module_name("proj/pkg/__init__.py", ["proj"]) == "pkg"
    assert _filetree.module_name("top.py", [""]) == "top"
    assert _filetree.module_name("proj/config.toml", ["proj"]) is None
    assert _filetree.module_name("proj/my-dir/mod.py", ["proj"]) is None
    w = _filetree.Writer(str(tmp_path))
    for bad in ("../x", "/etc/passwd", "a/../../b", "", "a//b", "a/\0b"):
        with pytest.raises(ValueError, match="bad workspace path"):
            w.path(bad)
    for odd in ("back\\slash.txt", "..\\x", "tab\tand space", "new\nline", "ünï/cödé.py"):  # Linux's names
        assert w.path(odd) == os.path.join(str(tmp_path), *odd.split("/"))


class _Outbox:
    """A writer's mailbox in handler tests: keeps what is sent (the replies)."""

    def __init__(self):
        self.sent = []

    def send(self, addr, msg):
        self.sent.append(msg)


# ---- the sync rules, in-process ------------------------------------------------------------------
def sync_in_process(src: str, root: str, pull: bool = False, copy: bool = False) -> list[str]:
    """One sync of ``src`` into ``root`` through the same diff/plan/apply code the procs run.

    ``pull``: files of ``PULL_MIN`` bytes and more go through ``RDMABuffer``s, as to procs.
    ``copy``: whole files of ``INBAND`` bytes and more are copied by the writer from ``src``.
    """
    ws = Workspace(dirs={src: "ws"})
    scan_ns = time.time_ns()
    manifest, sources = local_manifest(ws)
    diff = _sync_proc.diff(root, ("ws",), manifest)
    msgs = []
    b = _Batcher(msgs.append, "t", "k", ("ws",), scan_ns)
    pulls = _Pulls() if pull else None
    changed = plan(b, diff, manifest, sources, pulls, copy)
    if not copy:
        assert b.copied == 0
    b.flush(last=True, reply=None)
    w = _filetree.Writer(root)
    try:
        for m in msgs:
            _sync_proc.apply_ops(w, m.ops)
    finally:
        if pulls is not None:
            pulls.drop()
    _sync_proc.commit(root, ("ws",), w.ops, scan_ns)
    big = sum(manifest[k][0] for k in changed if k in manifest and manifest[k][0] >= ws_sync.PULL_MIN)
    if not pull:
        assert b.pulled == 0
    elif diff.blocks == {} and not diff.verify:  # whole files only: every big one was pulled
        assert b.pulled == big, (b.pulled, big)
    return changed, b.bytes


def tree(base: str) -> dict[str, bytes]:
    out = {}
    for key in _filetree.scan(base):
        with open(os.path.join(base, key), "rb") as f:
            out[key] = f.read()
    return out


# "k" and "k/l/m.py": a file becomes a directory and back
names = st.sampled_from(["a.py", "b.txt", "d/c.py", "d/e/f.bin", "g/h.cfg", "d/__init__.py", "k", "k/l/m.py",
                         "d/back\\slash.txt", "ünï code.txt"])
contents = st.binary(max_size=64) | st.just(b"same-size-1") | st.just(b"same-size-2")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.dictionaries(names, st.none() | contents, max_size=4), min_size=1, max_size=4),
       how=st.sampled_from(["messages", "pull", "copy"]))
def test_root_mirrors_source_after_every_sync(tmp_path_factory, steps, how):
    """Hypothesis: after any edits, the root equals the source, with file data in messages, pulled, or
    copied by the writer from the source."""
    src, root = str(tmp_path_factory.mktemp("src")), str(tmp_path_factory.mktemp("root"))
    for step in steps:
        for name, data in step.items():
            path = os.path.join(src, name)
            if data is None:
                if os.path.isfile(path):
                    os.unlink(path)
                continue
            parent = os.path.dirname(path)
            while parent != src:  # a file where a directory is now wanted
                if os.path.isfile(parent):
                    os.unlink(parent)
                parent = os.path.dirname(parent)
            if os.path.isdir(path):  # a directory where a file is now wanted
                shutil.rmtree(path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:  # same size, same clock tick: only the racy rule catches this
                f.write(data)
        # every non-empty file pulled or copied; a pulled one of more than 16 bytes in pieces of 8
        with mock.patch.object(ws_sync, "PULL_MIN", 1), mock.patch.object(ws_sync, "INBAND", 1), \
                mock.patch.object(_sync_proc, "PULL_PIECE", 8):
            sync_in_process(src, root, how == "pull", how == "copy")
        assert tree(os.path.join(root, "ws")) == tree(src)
        assert set(os.listdir(root)) <= {"ws"}  # nothing of ours in the synced tree


def test_small_files_ride_in_the_message_body_and_large_ones_in_their_own_frames(tmp_path):
    """One frame for many small files (not one per file); a large file's bytes are a frame of their own."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(50):
        (src / f"m{i}.py").write_bytes(b"x = %d\n" % i)
    big = os.urandom(ws_sync.INBAND)
    (src / "big.bin").write_bytes(big)
    ws = Workspace(dirs={str(src): "ws"})
    manifest, sources = local_manifest(ws)
    msgs = []
    b = _Batcher(msgs.append, "t", "k", ("ws",), time.time_ns())
    plan(b, _sync_proc.diff(str(tmp_path / "root"), ("ws",), manifest), manifest, sources)
    b.flush(last=True, reply=None)
    (msg,) = msgs
    frames = _wire.encode(msg)
    assert [bytes(f) for f in frames[1:]] == [big]  # the body holds the 50 small files
    w = _filetree.Writer(str(tmp_path / "root"))
    _sync_proc.apply_ops(w, _wire.decode(frames).ops)
    assert tree(str(tmp_path / "root" / "ws")) == tree(str(src))


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 12 * _filetree.BLOCK), blocks=st.sets(st.integers(0, 13)))
def test_block_ranges_cover_exactly_the_changed_blocks(size, blocks):
    """Hypothesis: the pulled ranges are the changed blocks' bytes inside the file, merged when adjacent."""
    ranges = ws_sync._ranges(sorted(blocks), size)
    B = _filetree.BLOCK
    covered = {j for o, n in ranges for j in range(o // B, (o + n - 1) // B + 1)}
    assert covered == {i for i in blocks if i * B < size}
    assert all(o % B == 0 and ((o + n) % B == 0 or o + n == size) for o, n in ranges)
    assert all(n > 0 and o + n <= size for o, n in ranges)
    assert all(o1 + n1 < o2 for (o1, n1), (o2, _) in zip(ranges, ranges[1:]))  # sorted, never adjacent


@pytest.mark.parametrize("pull,copy", [(False, False), (True, False), (False, True)])
def test_only_changed_content_moves_and_large_files_patch_by_blocks(tmp_path, pull, copy):
    src, root = tmp_path / "src", str(tmp_path / "root")
    src.mkdir()
    (src / "a.py").write_text("x = 1\n")
    big = bytearray(os.urandom(6 * _filetree.BLOCK + 123))
    (src / "big.bin").write_bytes(big)
    changed, nbytes = sync_in_process(str(src), root, pull, copy)
    assert sorted(changed) == ["ws/a.py", "ws/big.bin"] and nbytes == len(big) + 6
    old = time.time_ns() - 10 * _filetree.RACY_COARSE_NS + 7  # age the files past the racy window
    for p in (src / "a.py", src / "big.bin"):
        os.utime(p, ns=(old, old))
    changed, nbytes = sync_in_process(str(src), root, pull, copy)  # metadata only
    assert changed == [] and nbytes == 0
    os.utime(src / "a.py", ns=(old + 5, old + 5))  # touched, same content: verified by hash, nothing moves
    changed, nbytes = sync_in_process(str(src), root, pull, copy)
    assert changed == [] and nbytes == 0
    big[3 * _filetree.BLOCK + 10] ^= 0xFF  # one byte of one block
    (src / "big.bin").write_bytes(big)
    changed, nbytes = sync_in_process(str(src), root, pull, copy)
    assert changed == ["ws/big.bin"] and nbytes == _filetree.BLOCK
    assert (tmp_path / "root" / "ws" / "big.bin").read_bytes() == bytes(big)
    (src / "a.py").unlink()
    changed, nbytes = sync_in_process(str(src), root, pull, copy)
    assert changed == ["ws/a.py"] and not (tmp_path / "root" / "ws" / "a.py").exists()


# ---- real procs ------------------------------------------------------------------------------------
class Probe(Actor):
    @endpoint
    def run(self):
        import helper

        if not hasattr(self, "thing"):
            self.thing = helper.Thing()  # made before a reload: must run the new code after it
        return helper.value(), self.thing.f(), helper.__file__

    @endpoint
    def read(self, rel: str):
        path = os.path.join(os.environ["WORKSPACE_DIR"], rel)
        return open(path).read() if os.path.exists(path) else None


class Stats(Actor):
    @endpoint
    def reads(self, backend: str) -> int:
        from monarch_tensor.rdma import transfer_stats

        return transfer_stats().get(backend, {}).get("reads", 0)


HELPER = "def value():\n    return {v}\n\nclass Thing:\n    def f(self):\n        return 'version {v}'\n"


@pytest.mark.timeout(120)
def test_sync_to_two_roots_with_hot_reload(tmp_path):
    proj = tmp_path / "proj"
    (proj / "conf").mkdir(parents=True)
    (proj / "helper.py").write_text(HELPER.format(v=1))
    (proj / "conf" / "train.toml").write_text("lr = 0.1\n")
    (proj / "old.txt").write_text("to be deleted\n")
    roots = [tmp_path / "host0", tmp_path / "host1"]
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    try:
        # Two "hosts": ranks 0-1 and 2-3 get distinct workspace roots, as host agents would set them.
        procs.env.set("WORKSPACE_DIR", [str(roots[0])] * 2 + [str(roots[1])] * 2).get(timeout=30)
        ws = Workspace(dirs=[proj])
        first = procs.sync_workspace(ws, auto_reload=True).get(timeout=60)
        assert sorted(first.roots) == sorted(str(r) for r in roots)
        assert first.files_sent == 3 * 2  # every file, to each of the two roots
        assert list(first.phases) == ["roots", "diff", "write", "reload"]
        assert all(v >= 0 for v in first.phases.values())
        assert sum(first.phases.values()) == pytest.approx(first.seconds)
        for r in roots:
            assert (r / "proj" / "conf" / "train.toml").read_text() == "lr = 0.1\n"
            assert os.listdir(r) == ["proj"] and os.path.isdir(_filetree.meta_dir(str(r)))  # (records beside it)
        probes = procs.spawn("probe", Probe)
        vals = probes.run.call().get(timeout=30).values()
        assert [v[:2] for v in vals] == [(1, "version 1")] * 4
        assert [v[2] for v in vals] == [str(roots[i // 2] / "proj" / "helper.py") for i in range(4)]

        (proj / "helper.py").write_text(HELPER.format(v=22))  # code change
        (proj / "conf" / "train.toml").write_text("lr = 0.01\n")
        (proj / "old.txt").unlink()
        second = procs.sync_workspace(ws, auto_reload=True).get(timeout=60)
        assert second.changed == ["proj/conf/train.toml", "proj/helper.py", "proj/old.txt"]
        assert second.files_sent == 2 * 2 and second.deleted == 1
        assert all(r == ("helper",) for r in second.reloaded.values()), second.reloaded
        vals = probes.run.call().get(timeout=30).values()
        assert [v[:2] for v in vals] == [(22, "version 22")] * 4  # same procs, same actors, new code
        assert probes.read.call("proj/conf/train.toml").get(timeout=30).values() == ["lr = 0.01\n"] * 4
        assert probes.read.call("proj/old.txt").get(timeout=30).values() == [None] * 4

        async def sync_again():  # the seeds' form: awaited
            return await asyncio.wait_for(procs.sync_workspace(ws, auto_reload=True), 60)

        third = asyncio.run(sync_again())  # nothing changed
        assert third.changed == [] and third.bytes_sent == 0 and sorted(third.reloaded) == [0, 1, 2, 3]
    finally:
        procs.stop()


class Uses(Actor):
    @endpoint
    def f(self):
        import ua

        return ua.f()


@pytest.mark.timeout(120)
def test_a_renamed_module_and_a_failed_reload_leave_no_module_stale(tmp_path):
    """A module renamed away leaves the procs' imports rather than failing the reload; a reload that fails
    says which module failed, and the module is reloaded by a later sync that has it, even one whose own
    changes are elsewhere or that came without auto_reload."""
    from monarch_tensor.errors import SyncError

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "ua.py").write_text("import old\ndef f():\n    return 'a1'\n")
    (proj / "old.py").write_text("X = 1\n")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        procs.env.set("WORKSPACE_DIR", str(tmp_path / "root")).get(timeout=30)
        ws = Workspace(dirs=[proj])
        procs.sync_workspace(ws, auto_reload=True).get(timeout=60)
        uses = procs.spawn("uses", Uses)
        assert uses.f.call().get(timeout=30).values() == ["a1", "a1"]

        (proj / "old.py").rename(proj / "new.py")
        (proj / "ua.py").write_text("import new\ndef f():\n    return 'a2'\n")
        res = procs.sync_workspace(ws, auto_reload=True).get(timeout=60)
        assert res.changed == ["proj/new.py", "proj/old.py", "proj/ua.py"]
        assert list(res.reloaded.values()) == [("ua",), ("ua",)]
        assert uses.f.call().get(timeout=30).values() == ["a2", "a2"]

        (proj / "ua.py").write_text("def f(:\n")
        with pytest.raises(SyncError, match=r"ua: SyntaxError"):
            procs.sync_workspace(ws, auto_reload=True).get(timeout=60)
        assert uses.f.call().get(timeout=30).values() == ["a2", "a2"]  # the old code, until a reload succeeds
        (proj / "ua.py").write_text("import new\ndef f():\n    return 'a3'\n")
        procs.sync_workspace(ws).get(timeout=60)  # no auto_reload: ua stays stale
        (proj / "notes.txt").write_text("elsewhere\n")
        res = procs.sync_workspace(ws, auto_reload=True).get(timeout=60)
        assert res.changed == ["proj/notes.txt"] and list(res.reloaded.values()) == [("ua",), ("ua",)]
        assert uses.f.call().get(timeout=30).values() == ["a3", "a3"]
    finally:
        procs.stop()


class Busy(Actor):
    @endpoint
    def wait_for(self, path: str) -> str:
        with open(path + ".started", "w"):
            pass
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        return "done"


@pytest.mark.timeout(120)
def test_a_sync_whose_reload_waits_behind_a_running_endpoint_says_so(tmp_path, monkeypatch):
    # A proc takes a sync's reload between its actors' calls: behind a long endpoint the sync failed with
    # "no workspace reload within N s", naming neither the proc nor why, although the files were written.
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "conf.txt").write_text("lr=0.1\n")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        procs.env.set("WORKSPACE_DIR", str(tmp_path / "root")).get(timeout=30)
        ws = Workspace(dirs=[proj])
        procs.sync_workspace(ws).get(timeout=60)
        gate = tmp_path / "gate"
        running = procs.spawn("busy", Busy).slice(gpus=1).wait_for.call_one(str(gate))
        deadline = time.monotonic() + 30
        while not (tmp_path / "gate.started").exists() and time.monotonic() < deadline:  # (it runs: the
            time.sleep(0.02)                                                            # reload waits behind it)
        (proj / "conf.txt").write_text("lr=0.01\n")
        monkeypatch.setattr(ws_sync, "SYNC_TIMEOUT", 6.0)  # (every wait of the sync: not 2 s, which the diff took on a loaded VM)
        with pytest.raises(TimeoutError, match=r"no workspace reload from the proc\(s\) of rank \[1\] within 6.0 s"
                                               r".*the files are written on every host.*still run one"):
            procs.sync_workspace(ws).get(timeout=60)
        assert (tmp_path / "root" / "proj" / "conf.txt").read_text() == "lr=0.01\n"
        gate.write_text("")
        assert running.get(timeout=60) == "done"
    finally:
        procs.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["cma", "tcp"])
def test_large_files_are_pulled_over_the_data_plane(tmp_path, monkeypatch, backend):
    """Big files reach two roots over the data plane, whole then by changed blocks; small ones in messages.

    The writers are on this host, which by default gets every file in the messages: the test makes
    them pull as writers on other hosts do (the tcp backend is what those use), then turns that off.
    """
    from monarch_tensor.rdma._registry import registry
    from monarch_tensor.rdma.buffer import ENV_BACKEND

    proj = tmp_path / "proj"
    proj.mkdir()
    big = bytearray(os.urandom(5 * _filetree.BLOCK + 4321))
    (proj / "weights.bin").write_bytes(big)
    (proj / "mid.bin").write_bytes(os.urandom(ws_sync.PULL_MIN + 1))
    (proj / "small.py").write_text("X = 1\n")
    roots = [tmp_path / "host0", tmp_path / "host1"]
    monkeypatch.setattr(ws_sync, "PULL_SAME_HOST", True)
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        procs.env.set("WORKSPACE_DIR", [str(r) for r in roots]).get(timeout=30)
        procs.env.set(ENV_BACKEND, backend).get(timeout=30)  # the writers pull with this backend
        ws = Workspace(dirs=[proj])
        before = len(registry().by_id)
        first = procs.sync_workspace(ws).get(timeout=60)
        assert first.bytes_pulled == 2 * (len(big) + ws_sync.PULL_MIN + 1)
        assert first.bytes_sent == first.bytes_pulled + 2 * len("X = 1\n")
        for r in roots:
            assert tree(str(r / "proj")) == tree(str(proj))
        old = time.time_ns() - 10 * _filetree.RACY_COARSE_NS  # out of the racy window: blocks are compared
        for p in proj.iterdir():
            os.utime(p, ns=(old, old))
        procs.sync_workspace(ws).get(timeout=60)
        big[1 * _filetree.BLOCK + 5] ^= 0xFF  # blocks 1 and 2 (consecutive: one range), and the short last one
        big[2 * _filetree.BLOCK + 7] ^= 0xFF
        big[-1] ^= 0xFF
        (proj / "weights.bin").write_bytes(big)
        second = procs.sync_workspace(ws).get(timeout=60)
        assert second.changed == ["proj/weights.bin"]
        assert second.bytes_pulled == second.bytes_sent == 2 * (2 * _filetree.BLOCK + 4321)
        for r in roots:
            assert (r / "proj" / "weights.bin").read_bytes() == bytes(big)
        assert len(registry().by_id) == before, "the sync's buffers were not dropped"
        reads = procs.spawn("stats", Stats).reads.call(backend).get(timeout=30).values()
        assert all(n >= 3 for n in reads), reads  # each writer pulled with the backend asked for

        monkeypatch.setattr(ws_sync, "PULL_SAME_HOST", False)  # the default: this host's writers get messages
        big[7] ^= 0xFF
        (proj / "weights.bin").write_bytes(big)
        third = procs.sync_workspace(ws).get(timeout=60)
        assert third.bytes_pulled == 0 and third.bytes_sent == 2 * _filetree.BLOCK
        for r in roots:
            assert (r / "proj" / "weights.bin").read_bytes() == bytes(big)
    finally:
        procs.stop()


def test_a_writer_copies_by_path_only_the_sources_it_sees_and_fails_cleanly(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    st_ = os.stat(src)
    assert _sync_proc.sees_sources(((str(src), st_.st_dev, st_.st_ino),))
    assert not _sync_proc.sees_sources(((str(src), st_.st_dev, st_.st_ino + 1),))  # another directory there
    assert not _sync_proc.sees_sources(((str(tmp_path / "nowhere"), st_.st_dev, st_.st_ino),))
    assert not _sync_proc.sees_sources(())
    root = tmp_path / "root"
    (root / "ws").mkdir(parents=True)
    (root / "ws" / "keep.bin").write_bytes(b"old")
    w = _filetree.Writer(str(root))
    with pytest.raises(FileNotFoundError):  # the file went away after the client planned the copy
        _sync_proc.apply_ops(w, [("C", "ws/keep.bin", str(src / "gone.bin"), 10, 0, 0o644)])
    w.abort()
    assert (root / "ws" / "keep.bin").read_bytes() == b"old"
    assert sorted(os.listdir(root / "ws")) == ["keep.bin"]  # no temp file left behind


def test_a_commit_marks_its_root_and_rewrites_records_only_when_they_change(tmp_path):
    """Every commit leaves the root's records directory (a mount refuses a root without it), even one with
    nothing racy and no dirs to record (an environment); a record is rewritten only when it changes."""
    root = str(tmp_path / "root")
    os.makedirs(root)
    _sync_proc.commit(root, (), [], time.time_ns(), env=True)
    meta = _filetree.meta_dir(root)
    assert meta == str(tmp_path / ".root.monarch-tensor")  # beside the root: the root holds synced files only
    assert os.path.isdir(meta) and _filetree.read_meta(root, "racy.json", None) == [] and os.listdir(root) == []
    _sync_proc.check_mount_point(root)  # a root that syncs wrote: no complaint
    _sync_proc.commit(root, ("ws",), [], time.time_ns())
    stamps = {n: os.stat(os.path.join(meta, n)).st_mtime_ns for n in os.listdir(meta)}
    assert sorted(stamps) == ["dirs.json", "racy.json"]
    time.sleep(0.01)
    _sync_proc.commit(root, ("ws",), [], time.time_ns())  # nothing changed: nothing rewritten
    assert {n: os.stat(os.path.join(meta, n)).st_mtime_ns for n in os.listdir(meta)} == stamps
    _sync_proc.commit(root, ("ws", "other"), [("f", "ws/a.py", 1, time.time_ns(), 0o644, False)], time.time_ns())
    assert _filetree.read_meta(root, "dirs.json", None) == ["ws", "other"]
    assert _filetree.read_meta(root, "racy.json", None) == ["ws/a.py"]
    assert os.listdir(root) == []


def test_records_an_earlier_version_kept_inside_a_root_move_beside_it(tmp_path):
    """A root synced or mounted by an earlier version holds its records in ``root/.monarch-tensor``: they move
    to ``meta_dir`` (the mount then knows the root as ours, and its tree holds the source's files only); where
    records of the new kind exist already, the old ones are dropped."""
    root = tmp_path / "mnt"
    (root / ".monarch-tensor").mkdir(parents=True)
    (root / ".monarch-tensor" / "racy.json").write_text('["a.py"]')
    (root / "a.py").write_text("x")
    with pytest.raises(FileExistsError):  # (without the move: files and no records)
        _sync_proc.check_mount_point(str(root))
    _filetree.adopt_inner_records(str(root))
    assert os.listdir(root) == ["a.py"] and _filetree.read_meta(str(root), "racy.json", None) == ["a.py"]
    _sync_proc.check_mount_point(str(root))
    (root / ".monarch-tensor").mkdir()
    (root / ".monarch-tensor" / "racy.json").write_text('["old.py"]')
    _filetree.adopt_inner_records(str(root))
    assert os.listdir(root) == ["a.py"] and _filetree.read_meta(str(root), "racy.json", None) == ["a.py"]
    _filetree.adopt_inner_records(str(tmp_path / "nowhere"))  # (no root: nothing to do)
    (root / ".monarch-tensor" / "slurm").mkdir(parents=True)  # a SlurmJob's logs, not records: left alone
    _filetree.adopt_inner_records(str(root))
    assert (root / ".monarch-tensor" / "slurm").is_dir()


def test_a_roots_records_go_to_this_users_directory_where_its_parent_is_not_writable(tmp_path, monkeypatch):
    """A root whose parent this user cannot write (``/workspace``, an environment's prefix in ``/opt``) keeps
    its records in the user's directory of this host, one per root's real path; a root named through a
    symlink finds the same records; the root itself still holds only synced files."""
    parent = tmp_path / "ro"
    (parent / "root").mkdir(parents=True)
    (tmp_path / "link").symlink_to(parent)
    real_access = os.access
    monkeypatch.setattr(_filetree.os, "access", lambda p, mode: False if str(p) in (str(parent), str(
        tmp_path / "link")) else real_access(p, mode))
    root, other = str(parent / "root"), str(tmp_path / "link" / "root")
    meta = _filetree.meta_dir(root)
    assert meta.startswith(os.path.join(_filetree.socket_dir(), "roots") + os.sep) and _filetree.meta_dir(other) == meta
    assert _filetree.meta_dir(str(tmp_path / "elsewhere")) == str(tmp_path / ".elsewhere.monarch-tensor")
    try:
        (parent / "root" / "mine.txt").write_text("x")
        with pytest.raises(FileExistsError):  # files, no records: a mount refuses it
            _sync_proc.check_mount_point(root)
        os.unlink(parent / "root" / "mine.txt")
        _sync_proc.commit(root, ("ws",), [("f", "ws/a.py", 1, time.time_ns(), 0o644, False)], time.time_ns())
        assert _filetree.read_meta(other, "racy.json", None) == ["ws/a.py"]
        assert _filetree.read_meta(root, "dirs.json", None) == ["ws"] and os.path.isdir(meta)
        (parent / "root" / "ws").mkdir()
        _sync_proc.check_mount_point(root)  # a root that syncs wrote: no complaint
        assert os.listdir(parent) == ["root"] and os.listdir(parent / "root") == ["ws"]
    finally:
        shutil.rmtree(meta, ignore_errors=True)


def test_a_writers_first_message_goes_early_and_copies_do_not_split_the_rest():
    """A writer's first message goes once it holds FIRST_CHUNK bytes (so the writer starts while the rest is
    planned); after it, carried bytes cut messages at CHUNK, but whole-file copies do not (the writer's
    lanes take them without waiting for them)."""
    sent = []
    b = _Batcher(sent.append, "s", "k", ("ws",), 0)
    piece = ws_sync.FIRST_CHUNK // 2
    for i in range(4 * ws_sync.CHUNK // piece):  # 4 CHUNKs of copies
        b.add(("C", f"ws/c{i}", f"/src/c{i}", piece, 0, 0o644), piece, copy=True)
    assert [len(m.ops) for m in sent] == [2]
    for i in range(2 * ws_sync.CHUNK // piece):  # then 2 CHUNKs carried
        b.add(("w", f"ws/w{i}", 0, b"", False), piece)
    b.flush(last=True, reply=None)
    sizes = [sum(op[3] if op[0] == "C" else piece for op in m.ops) for m in sent]
    # the first; the rest of the copies with the first CHUNK carried; the second CHUNK; the last (commit)
    assert sizes == [ws_sync.FIRST_CHUNK, 4 * ws_sync.CHUNK - ws_sync.FIRST_CHUNK + ws_sync.CHUNK, ws_sync.CHUNK, 0]
    assert [m.last for m in sent] == [False, False, False, True]
    assert b.bytes == 6 * ws_sync.CHUNK and sum(len(m.ops) for m in sent) == 6 * ws_sync.CHUNK // piece


def test_a_syncs_copies_run_on_across_messages_and_deletes_wait_for_them(tmp_path):
    """``("C", ...)`` ops are handed to the lane threads and left running while the writer takes the sync's
    next message; a delete (which may remove a directory) and the last message wait for them; the commit
    records them as finished files; a copy that fails fails the sync, leaving no temp file."""
    src = tmp_path / "src"
    src.mkdir()
    data = {f"f{i}.bin": os.urandom(100_000 + i) for i in range(6)}
    for name, d in data.items():
        (src / name).write_bytes(d)
    root = tmp_path / "root"
    (root / "ws" / "old").mkdir(parents=True)
    (root / "ws" / "old" / "x.py").write_text("x = 1\n")
    now = time.time_ns()

    def copy(name, mtime_ns=now - 10**10):
        return ("C", f"ws/{name}", str(src / name), len(data[name]), mtime_ns, 0o640)

    names = sorted(data)
    handed = []
    real = _sync_proc._LaneJobs.add
    with mock.patch.object(_sync_proc._LaneJobs, "add", lambda self, w, ops: handed.append(len(self._futs)) or real(self, w, ops)):
        mb, port = _Outbox(), PortRef("ipc:///tmp/x", 1)
        msgs = [sync_messages.WriteFiles("s1", "k", ("ws",), tuple(copy(n) for n in names[:3]), now, False, None),
                sync_messages.WriteFiles("s1", "k", ("ws",), (copy(names[3]), copy(names[4], now)), now, False, None),
                sync_messages.WriteFiles("s1", "k", ("ws",), (copy(names[5]), ("d", "ws/old/x.py")), now, True, port)]
        with mock.patch.dict(os.environ, {"WORKSPACE_DIR": str(root)}):
            for m in msgs:
                _sync_proc.handle_write(mb, m)
    assert handed[0] == 0 and handed[1] > 0  # the second message found the first one's copies still handed out
    reply = mb.sent.pop()
    assert reply.error is None and reply.value == str(root)
    assert sorted(os.listdir(root / "ws")) == names  # the emptied directory went with the delete
    for name in names:
        st_ = os.stat(root / "ws" / name)
        assert (root / "ws" / name).read_bytes() == data[name] and st_.st_mode & 0o777 == 0o640
    assert _filetree.read_meta(str(root), "racy.json", None) == [f"ws/{names[4]}"]  # modified at the scan

    (src / names[2]).unlink()  # gone after the client planned its copy
    mb.sent.clear()
    with mock.patch.dict(os.environ, {"WORKSPACE_DIR": str(tmp_path / "root2")}):
        _sync_proc.handle_write(mb, sync_messages.WriteFiles("s2", "k", ("ws",), tuple(copy(n) for n in names),
                                                             now, True, port))
    assert isinstance(mb.sent[-1].error, Exception) and "No such file" in str(mb.sent[-1].error)
    assert not [n for n in os.listdir(tmp_path / "root2" / "ws") if n.startswith(".sync")]


def _refuse(err):
    def call(*a, **k):
        raise OSError(err, os.strerror(err))
    return call


@pytest.mark.parametrize("how", ["as is", "no copy_file_range", "copy_file_range reads nothing",
                                 "copy_file_range stops midway", "neither call here", "a file that shrank"])
def test_a_copy_falls_back_call_by_call_and_lands_every_byte(tmp_path, monkeypatch, how):
    """``_copy_file`` tries copy_file_range (which clones where the file system can), then sendfile for
    what is left, then reads and writes: whichever refuses or stops short, every byte lands once, at its
    offset, and the count returned is what was copied. A refusal other than "not between these files"
    is an error."""
    import errno

    data = os.urandom(3 * 4096 + 123)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    size = len(data)
    real_cfr = os.copy_file_range
    patches = {
        "as is": {},
        "no copy_file_range": {"copy_file_range": _refuse(errno.ENOSYS)},
        "copy_file_range reads nothing": {"copy_file_range": lambda *a: 0},  # as some special files do
        "copy_file_range stops midway": {"copy_file_range": lambda s, d, n, i, o: real_cfr(s, d, min(n, 5000), i, o)
                                         if i == 0 else 0},
        "neither call here": {"copy_file_range": _refuse(errno.EXDEV), "sendfile": _refuse(errno.EINVAL)},
        "a file that shrank": {},
    }[how]
    if how == "a file that shrank":
        size += 5000  # the size the client saw; the file is shorter now
    fd = os.open(tmp_path / "dst.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for name, fn in patches.items():
            monkeypatch.setattr(os, name, fn)
        got = _sync_proc._copy_file(str(src), fd, size)
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert got == len(data)
    assert (tmp_path / "dst.bin").read_bytes() == data
    fd = os.open(tmp_path / "dst2.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        with mock.patch.object(os, "copy_file_range", _refuse(errno.EIO)), pytest.raises(OSError, match="Input/output"):
            _sync_proc._copy_file(str(src), fd, len(data))
    finally:
        os.close(fd)


def test_a_lane_held_up_by_one_file_leaves_the_others_to_the_other_lane(tmp_path):
    """The lanes take a sync's copies one at a time from a shared queue: while one lane is held up by a
    file, the other copies every other file (lanes dealt half of the files each up front waited here until
    the held one's copy timed out)."""
    import threading

    src = tmp_path / "src"
    src.mkdir()
    data = {f"f{i}.bin": os.urandom(50_000) for i in range(6)}
    for name, d in data.items():
        (src / name).write_bytes(d)
    release, others = threading.Event(), []
    real_copy = _sync_proc._copy_file

    def copy(src_path, fd, size):
        if src_path.endswith("f0.bin"):
            assert release.wait(20), "the other lane did not copy the other files meanwhile"
            return real_copy(src_path, fd, size)
        n = real_copy(src_path, fd, size)
        others.append(src_path)
        if len(others) == len(data) - 1:
            release.set()
        return n

    now = time.time_ns()
    ops = tuple(("C", f"ws/{n}", str(src / n), len(d), now - 10**10, 0o644) for n, d in sorted(data.items()))
    mb, root = _Outbox(), tmp_path / "root"
    with mock.patch.object(_sync_proc, "_copy_file", copy), mock.patch.dict(os.environ, {"WORKSPACE_DIR": str(root)}):
        _sync_proc.handle_write(mb, sync_messages.WriteFiles("s1", "k", ("ws",), ops, now, True,
                                                             PortRef("ipc:///tmp/x", 1)))
    reply = mb.sent.pop()
    assert reply.error is None, reply.error
    for name, d in data.items():
        assert (root / "ws" / name).read_bytes() == d


def test_a_pulled_file_in_pieces_lands_whole_and_a_failed_piece_leaves_no_temp_file(tmp_path, monkeypatch):
    """A pull of more than two ``PULL_PIECE`` goes in pieces that both lanes take, and the lane that
    finishes the last one places the file; when a piece fails, the sync fails and neither that file's temp
    file nor any other remains (pieces still queued are never run)."""
    from monarch_tensor.rdma import RDMABuffer

    monkeypatch.setattr(_sync_proc, "PULL_PIECE", 4096)
    data = {"big.bin": os.urandom(10 * 4096 + 123), "mid.bin": os.urandom(3 * 4096), "small.bin": os.urandom(5000)}
    bufs = {name: RDMABuffer(bytearray(d)) for name, d in data.items()}

    now = time.time_ns()
    ops = tuple(("P", f"ws/{n}", bufs[n], len(d), now - 10**10, 0o640) for n, d in data.items())
    port = PortRef("ipc:///tmp/x", 1)
    try:
        mb, root = _Outbox(), tmp_path / "root"
        with mock.patch.dict(os.environ, {"WORKSPACE_DIR": str(root)}):
            _sync_proc.handle_write(mb, sync_messages.WriteFiles("s1", "k", ("ws",), ops, now, True, port))
        assert mb.sent[-1].error is None, mb.sent[-1].error
        for name, d in data.items():
            assert (root / "ws" / name).read_bytes() == d
            assert os.stat(root / "ws" / name).st_mode & 0o777 == 0o640

        real = _sync_proc._pull_piece

        def piece(buf, offset, n, fd):
            if buf is bufs["big.bin"] and offset == 2 * 4096:
                raise OSError("the owner went away")
            return real(buf, offset, n, fd)

        monkeypatch.setattr(_sync_proc, "_pull_piece", piece)
        root2 = tmp_path / "root2"
        with mock.patch.dict(os.environ, {"WORKSPACE_DIR": str(root2)}):
            _sync_proc.handle_write(mb, sync_messages.WriteFiles("s2", "k", ("ws",), ops, now, True, port))
        assert "the owner went away" in str(mb.sent[-1].error)
        assert not [n for n in os.listdir(root2 / "ws") if n.startswith(".sync")]
        assert not (root2 / "ws" / "big.bin").exists()
    finally:
        for b in bufs.values():
            b.drop()


def test_pulled_pieces_left_at_a_timeout_or_a_failed_open_leave_no_temp_file(tmp_path, monkeypatch):
    """A writer whose lanes do not finish within ``SYNC_TIMEOUT`` fails the sync, drops the jobs not started,
    and places none of the files still being written when their lanes finish (a failed sync leaves the old
    versions): a file pulled in pieces and a whole one. A temp file that cannot be opened fails the sync
    before any lane starts, and the files opened for that message are removed."""
    import threading

    from monarch_tensor.rdma import RDMABuffer

    monkeypatch.setattr(_sync_proc, "PULL_PIECE", 4096)
    data, small = os.urandom(8 * 4096), os.urandom(5000)
    buf, small_buf = RDMABuffer(bytearray(data)), RDMABuffer(bytearray(small))
    release, started = threading.Event(), []
    real = _sync_proc._pull_piece

    def piece(b, offset, n, fd):
        if offset == 0:  # the first piece of each file waits
            started.append(b)
            assert release.wait(20)
        return real(b, offset, n, fd)

    now = time.time_ns()
    port = PortRef("ipc:///tmp/x", 1)
    op = ("P", "ws/big.bin", buf, len(data), now - 10**10, 0o644)
    try:
        monkeypatch.setattr(_sync_proc, "_pull_piece", piece)
        monkeypatch.setattr(_sync_proc, "SYNC_TIMEOUT", 3.0)  # (ample for the lanes to reach both files)
        mb, root = _Outbox(), tmp_path / "root"
        ops = (op, ("P", "ws/small.bin", small_buf, len(small), now - 10**10, 0o644))
        with mock.patch.dict(os.environ, {"WORKSPACE_DIR": str(root)}):
            _sync_proc.handle_write(mb, sync_messages.WriteFiles("s1", "k", ("ws",), ops, now, True, port))
        assert isinstance(mb.sent[-1].error, Exception) and "did not finish within" in str(mb.sent[-1].error)
        assert len(started) == 2  # both lanes held: one in the parted file, one in the whole one
        release.set()  # the running pieces end: their files go
        deadline = time.monotonic() + 20
        while [n for n in os.listdir(root / "ws") if n.startswith(".sync")] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.listdir(root / "ws") == []

        monkeypatch.setattr(_sync_proc, "SYNC_TIMEOUT", 30.0)
        monkeypatch.setattr(_sync_proc, "_pull_piece", real)
        real_open, opened = _filetree.open_new, []

        def open_new(tmp):
            if opened:
                raise OSError(28, "No space left on device")
            opened.append(tmp)
            return real_open(tmp)

        monkeypatch.setattr(_filetree, "open_new", open_new)
        ops = (op, ("P", "ws/big2.bin", buf, len(data), now - 10**10, 0o644))
        root2 = tmp_path / "root2"
        with mock.patch.dict(os.environ, {"WORKSPACE_DIR": str(root2)}):
            _sync_proc.handle_write(mb, sync_messages.WriteFiles("s2", "k", ("ws",), ops, now, True, port))
        assert "No space left" in str(mb.sent[-1].error)
        assert opened and not os.path.exists(opened[0]) and os.listdir(root2 / "ws") == []
    finally:
        release.set()
        buf.drop()
        small_buf.drop()


@contextlib.contextmanager
def _sync_events():
    """Record what this client does in a sync: the kind of each message it sends, and "client scan" when it
    scans its dirs."""
    from monarch_tensor.transport.mailbox import current_mailbox

    events: list = []
    mb = current_mailbox()
    real_send, real_manifest = mb.send, ws_sync.local_manifest

    def send(addr, msg, *a, **k):
        events.append(type(msg).__name__)
        return real_send(addr, msg, *a, **k)

    def manifest(ws):
        events.append("client scan")
        return real_manifest(ws)

    with mock.patch.object(mb, "send", send), mock.patch.object(ws_sync, "local_manifest", manifest):
        yield events


def test_a_new_sync_into_a_root_lets_an_earlier_ones_copies_land_first(tmp_path):
    """A sync whose client went away may leave copies running on the lanes; the next sync into that root
    waits for them before it writes, so an old version never lands over a newer one."""
    import threading

    src = tmp_path / "src"
    src.mkdir()
    (src / "old.bin").write_bytes(b"old" * 40_000)
    (src / "new.bin").write_bytes(b"new" * 40_000)
    release = threading.Event()
    real_copy = _sync_proc._copy_file

    def copy(src_path, fd, size):
        if src_path.endswith("old.bin"):
            assert release.wait(30)  # the abandoned sync's copy is slow
        return real_copy(src_path, fd, size)

    def op(name):
        return ("C", "ws/x.bin", str(src / name), 120_000, time.time_ns() - 10**10, 0o644)

    mb, port = _Outbox(), PortRef("ipc:///tmp/x", 1)
    with mock.patch.object(_sync_proc, "_copy_file", copy), \
            mock.patch.dict(os.environ, {"WORKSPACE_DIR": str(tmp_path / "root")}):
        # the first sync's client sends one message and is gone: no last message ever comes
        _sync_proc.handle_write(mb, sync_messages.WriteFiles("gone", "k", ("ws",), (op("old.bin"),), 0, False, None))
        second = threading.Thread(target=_sync_proc.handle_write, args=(mb, sync_messages.WriteFiles(
            "next", "k", ("ws",), (op("new.bin"),), time.time_ns(), True, port)))
        second.start()
        second.join(0.3)
        assert second.is_alive()  # it waits for the abandoned sync's copy into the same root
        release.set()
        second.join(30)
    _sync_proc._writers.pop("gone", None)
    assert mb.sent[-1].error is None
    assert (tmp_path / "root" / "ws" / "x.bin").read_bytes() == b"new" * 40_000


def test_env_set_of_a_root_variable_tells_the_next_sync_where_the_roots_are(tmp_path):
    """``env.set("WORKSPACE_DIR" or "CONDA_PREFIX", ...)`` answers what ``DescribeWorkspace`` would, so the next
    sync asks no proc; a sync of procs not told asks them while it scans its dirs."""
    import socket

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "a.py").write_text("a = 1\n")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        addrs = [p.addr for p in procs._procs]
        roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
        procs.env.set("WORKSPACE_DIR", roots).get(timeout=30)
        host = socket.gethostname()
        assert [ws_sync._roots[(a, "")] for a in addrs] == [(host, r) for r in roots]
        procs.env.set("CONDA_PREFIX", str(tmp_path / "env")).get(timeout=30)
        assert [ws_sync._roots[(a, "CONDA_PREFIX")] for a in addrs] == [(host, str(tmp_path / "env"))] * 2
        procs.env.set("WORKSPACE_DIR", {1: None}).get(timeout=30)  # unset: the default root, as a proc says
        told = ws_sync._roots[(addrs[1], "")]
        ws_sync.forget_roots(addrs)
        ws_sync._describe(list(procs._procs), "")
        assert ws_sync._roots[(addrs[1], "")] == told and ws_sync._roots[(addrs[0], "")] == (host, roots[0])
        procs.env.set("SOMETHING_ELSE", "1").get(timeout=30)
        assert ws_sync._roots[(addrs[1], "")] == told

        ws_sync.forget_roots(addrs)
        with _sync_events() as events:
            first = procs.sync_workspace(Workspace(dirs=[proj])).get(timeout=60)
            procs.env.set("WORKSPACE_DIR", roots[::-1]).get(timeout=30)
            del events[:]
            again = procs.sync_workspace(Workspace(dirs=[proj])).get(timeout=60)
        assert sorted(first.roots) == sorted([roots[0], told[1]]) and sorted(again.roots) == sorted(roots)
        assert "DescribeWorkspace" not in events  # told by env.set
        assert os.path.exists(os.path.join(roots[0], "proj", "a.py")) and os.path.exists(os.path.join(roots[1], "proj", "a.py"))
    finally:
        procs.stop()


@pytest.mark.timeout(120)
def test_writers_on_this_host_copy_large_files_from_the_source(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    files = {f"w{i}.bin": os.urandom(ws_sync.INBAND + 1000 * i) for i in range(5)}
    for name, data in files.items():
        (proj / name).write_bytes(data)
    (proj / "small.py").write_text("X = 1\n")
    roots = [tmp_path / "host0", tmp_path / "host1"]
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        procs.env.set("WORKSPACE_DIR", [str(r) for r in roots]).get(timeout=30)
        first = procs.sync_workspace(Workspace(dirs=[proj])).get(timeout=60)
        big = sum(len(d) for d in files.values())
        assert first.bytes_copied == 2 * big and first.bytes_pulled == 0
        assert first.bytes_sent == 2 * (big + len("X = 1\n"))
        for r in roots:
            assert tree(str(r / "proj")) == tree(str(proj))
            assert [n for n in os.listdir(r / "proj") if n.startswith(".sync")] == []
    finally:
        procs.stop()


def test_bad_input(tmp_path):
    from monarch_tensor.workspace_sync import sync_workspace

    with pytest.raises(TypeError, match="needs a Workspace"):
        sync_workspace([], "not a workspace")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sync_workspace([], Workspace(dirs=[tmp_path / "nope"]))


@pytest.mark.timeout(120)
def test_host_sync_before_procs_then_procs_import_it(tmp_path):
    proj = tmp_path / "early"
    proj.mkdir()
    (proj / "early_mod.py").write_text("ANSWER = 42\n")
    res = this_host().sync_workspace(Workspace(dirs=[proj])).get(timeout=60)  # no proc runs: written here
    assert res.files_sent == 1 and os.path.isfile(os.path.join(res.roots[0], "early", "early_mod.py"))
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        early = procs.spawn("early", Early)
        assert early.answer.call().get(timeout=30).values() == [42, 42]  # on sys.path from the start
        again = this_host().sync_workspace(Workspace(dirs=[proj])).get(timeout=60)  # now through the procs
        assert again.changed == [] and sorted(again.reloaded) == [0, 1]
    finally:
        procs.stop()


@pytest.mark.timeout(120)
def test_host_sync_reaches_the_procs_of_two_meshes(tmp_path, monkeypatch):
    # The procs of two meshes share ranks (0 and 0): their replies were keyed by rank, so the second of
    # each was dropped and the host's sync waited for it until SYNC_TIMEOUT.
    monkeypatch.setattr(ws_sync, "SYNC_TIMEOUT", 30.0)
    proj = tmp_path / "two"
    proj.mkdir()
    (proj / "helper.py").write_text(HELPER.format(v=1))
    ws = Workspace(dirs=[proj])
    a = this_host().spawn_procs(per_host={"gpus": 1})
    b = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        first = this_host().sync_workspace(ws, auto_reload=True).get(timeout=60)
        assert first.files_sent == 1 and set(first.reloaded) == {(a, 0), (b, 0)}  # (ranks repeat: by mesh)
        probes = [m.spawn("probe", Probe) for m in (a, b)]
        assert [p.run.call_one().get(timeout=30)[:2] for p in probes] == [(1, "version 1")] * 2

        (proj / "helper.py").write_text(HELPER.format(v=2))
        second = this_host().sync_workspace(ws, auto_reload=True).get(timeout=60)
        assert second.reloaded == {(a, 0): ("helper",), (b, 0): ("helper",)}
        assert [p.run.call_one().get(timeout=30)[:2] for p in probes] == [(2, "version 2")] * 2
        assert sorted(a.sync_workspace(ws).get(timeout=60).reloaded) == [0]  # one mesh's: by rank, as before
    finally:
        a.stop()
        b.stop()


def _agents_live_procs(besides: tuple | list = ()) -> list:
    """The procs of host agents this process holds alive, but for ``besides``: those it held before the test's job
    started (another test's procs, still stopping after its job was killed, which this process learns a moment
    later)."""
    from monarch_tensor.hosts.host import _live_meshes

    return [p for m in list(_live_meshes) for p in m._procs if p.alive and getattr(p, "agent", None) is not None
            and not any(p is q for q in besides)]


@pytest.mark.timeout(240)
def test_a_local_jobs_hosts_have_roots_of_their_own(tmp_path):
    from monarch_tensor.job import LocalJob

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "helper.py").write_text(HELPER.format(v=3))
    (proj / "data.txt").write_text("x\n")
    ws = Workspace(dirs=[proj])
    others = _agents_live_procs()
    job = LocalJob(meshes={"m": 2}, root_dir=str(tmp_path / "job"), ttl=120)
    try:
        hosts = job.state().m
        roots = [os.path.join(w, "workspace") for w in hosts.workdirs]
        # No proc runs on these hosts yet: the host mesh syncs through a proc on each, stopped after.
        # (longer than the sync's own waits, SYNC_TIMEOUT: a step that never answers fails with its name)
        first = hosts.sync_workspace(ws).get(timeout=200)
        assert sorted(first.roots) == sorted(roots)
        assert first.files_sent == 2 * 2  # both files, to each host's root
        for r in roots:
            assert open(os.path.join(r, "proj", "data.txt")).read() == "x\n"
        assert _agents_live_procs(others) == []
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        assert procs.env.get("WORKSPACE_DIR").get(timeout=30).values() == roots
        probes = procs.spawn("probe", Probe)
        vals = probes.run.call().get(timeout=60).values()  # on sys.path from the start, each from its root
        assert vals == [(3, "version 3", os.path.join(r, "proj", "helper.py")) for r in roots]

        (proj / "helper.py").write_text(HELPER.format(v=4))
        second = hosts.sync_workspace(ws, auto_reload=True).get(timeout=60)  # now through the running procs
        assert second.changed == ["proj/helper.py"] and sorted(second.roots) == sorted(roots)
        assert sorted(second.reloaded) == [0, 1]
        assert [v[:2] for v in probes.run.call().get(timeout=60).values()] == [(4, "version 4")] * 2
        assert asyncio.run(hosts.sync_workspace(ws)).changed == []  # (a coroutine, as Monarch's async def)

        # This host's own mesh syncs to this host only, not to the procs of the job's agents.
        other = tmp_path / "other"
        other.mkdir()
        (other / "o.txt").write_text("o\n")
        mine = this_host().sync_workspace(Workspace(dirs=[other])).get(timeout=60)
        assert not set(mine.roots) & set(roots)
        assert not any(os.path.exists(os.path.join(r, "other")) for r in roots)
    finally:
        job.kill()


@pytest.mark.timeout(240)
def test_a_jobs_host_sync_with_procs_on_one_host_reaches_both(tmp_path, monkeypatch):
    # Procs on host 0 only: the sync spawned a helper proc on host 1, of another mesh, and both were rank 0;
    # their replies were keyed by rank, so one was dropped, the sync timed out and host 1 got nothing.
    from monarch_tensor.job import LocalJob

    monkeypatch.setattr(ws_sync, "SYNC_TIMEOUT", 30.0)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "helper.py").write_text(HELPER.format(v=1))
    ws = Workspace(dirs=[proj])
    others = _agents_live_procs()
    job = LocalJob(meshes={"m": 2}, root_dir=str(tmp_path / "job"), ttl=120)
    try:
        hosts = job.state().m
        roots = [os.path.join(w, "workspace") for w in hosts.workdirs]
        first_procs = hosts.slice(hosts=0).spawn_procs(per_host={"gpus": 1})
        first = hosts.sync_workspace(ws, auto_reload=True).get(timeout=120)
        assert sorted(first.roots) == sorted(roots)
        assert len(first.reloaded) == 2 and (first_procs, 0) in first.reloaded  # (and the helper's rank 0)
        assert len(_agents_live_procs(others)) == 1  # the helper proc was stopped
        second_procs = hosts.slice(hosts=1).spawn_procs(per_host={"gpus": 1})
        probes = [m.spawn("probe", Probe) for m in (first_procs, second_procs)]
        vals = [p.run.call_one().get(timeout=60) for p in probes]
        assert vals == [(1, "version 1", os.path.join(r, "proj", "helper.py")) for r in roots]

        (proj / "helper.py").write_text(HELPER.format(v=2))
        second = hosts.sync_workspace(ws, auto_reload=True).get(timeout=120)  # two meshes, both of rank 0
        assert second.reloaded == {(first_procs, 0): ("helper",), (second_procs, 0): ("helper",)}
        assert [p.run.call_one().get(timeout=60)[:2] for p in probes] == [(2, "version 2")] * 2
    finally:
        job.kill()


@pytest.mark.timeout(120)
def test_sync_workspace_is_a_coroutine_as_monarchs_async_def(tmp_path):
    """``asyncio.run(mesh.sync_workspace(ws))`` works, as for Monarch's ``async def``; so do ``await`` and
    ``.get()``."""
    proj = tmp_path / "coro"
    proj.mkdir()
    (proj / "coro_mod.py").write_text("X = 1\n")
    ws = Workspace(dirs=[proj])
    assert asyncio.run(this_host().sync_workspace(ws)).files_sent == 1  # no proc runs: written here
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        (proj / "coro_mod.py").write_text("X = 2\n")
        assert asyncio.run(procs.sync_workspace(ws)).changed == ["coro/coro_mod.py"]
        assert asyncio.run(this_host().sync_workspace(ws)).changed == []

        async def awaited():
            return await procs.sync_workspace(ws)

        assert asyncio.run(awaited()).changed == []
        assert procs.sync_workspace(ws).get(timeout=60).changed == []
    finally:
        procs.stop()


class Early(Actor):
    @endpoint
    def answer(self):
        import early_mod

        return early_mod.ANSWER


def test_racy_window_follows_timestamp_granularity():
    now = 10 * _filetree.RACY_COARSE_NS + 123  # a fine-grained clock (not a whole millisecond)
    assert _filetree.racy(now - _filetree.RACY_NS // 2, now)
    assert not _filetree.racy(now - 2 * _filetree.RACY_NS - 1, now)
    coarse = now - now % 1_000_000_000  # whole seconds: a coarse filesystem
    assert _filetree.racy(coarse - 1_000_000_000, now)
    assert not _filetree.racy(coarse - 3_000_000_000, now)


def test_a_writer_scans_its_root_once_while_the_client_scans(tmp_path, monkeypatch):
    """``ScanWorkspace`` makes the scan of the root that the ``DiffWorkspace`` of the same sync then uses
    (a file added in between is not seen: the diff did not scan again); a diff without its scan, or whose
    root or dirs differ from the scan's, scans itself; only the last KEEP_SCANS scans are kept."""
    root = tmp_path / "root"
    (root / "ws").mkdir(parents=True)
    (root / "ws" / "a.py").write_text("a = 1\n")
    monkeypatch.setenv("WORKSPACE_DIR", str(root))
    monkeypatch.setattr(_sync_proc, "_scans", {})
    scans = []
    real = _sync_proc.scan_root
    monkeypatch.setattr(_sync_proc, "scan_root", lambda r, d: scans.append((r, tuple(d))) or real(r, d))

    mb, port = _Outbox(), PortRef("ipc:///tmp/x", 1)

    def diff(sync_id, dirs=("ws",)):
        _sync_proc.handle_diff(mb, sync_messages.DiffWorkspace(sync_id, "k", dirs, {}, port))
        reply = mb.sent.pop()
        assert reply.error is None, reply.error
        return reply.value

    _sync_proc.handle_scan(mb, sync_messages.ScanWorkspace("s1", "k", ("ws",)))
    (root / "ws" / "b.py").write_text("b = 1\n")
    assert diff("s1").delete == ("ws/a.py",) and len(scans) == 1 and not mb.sent  # the scan of s1, reused
    assert sorted(diff("s2").delete) == ["ws/a.py", "ws/b.py"] and len(scans) == 2  # no scan came: it scans
    _sync_proc.handle_scan(mb, sync_messages.ScanWorkspace("s3", "k", ("ws",)))
    assert diff("s3", ("other",)).delete == () and scans[-1] == (str(root), ("other",)) and len(scans) == 4
    for i in range(_sync_proc.KEEP_SCANS + 3):
        _sync_proc.handle_scan(mb, sync_messages.ScanWorkspace(f"t{i}", "k", ("ws",)))
    assert list(_sync_proc._scans) == [f"t{i}" for i in range(3, _sync_proc.KEEP_SCANS + 3)]


def test_writers_are_asked_to_scan_before_the_client_scans(tmp_path):
    """The client sends each writer its ``ScanWorkspace`` before it scans its own dirs, and the diff after."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "a.py").write_text("a = 1\n")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        procs.env.set("WORKSPACE_DIR", [str(tmp_path / "r0"), str(tmp_path / "r1")]).get(timeout=30)
        kinds = ("DescribeWorkspace", "ScanWorkspace", "client scan", "DiffWorkspace")
        with _sync_events() as events:
            res = procs.sync_workspace(Workspace(dirs=[proj])).get(timeout=60)
        assert res.files_sent == 2
        sync_events = [e for e in events if e in kinds]
        assert sync_events == ["ScanWorkspace", "ScanWorkspace", "client scan", "DiffWorkspace", "DiffWorkspace"]
        # Procs whose roots are not known are asked first; the client scans while they answer, and their
        # diffs scan the roots.
        ws_sync.forget_roots([p.addr for p in procs._procs])
        (proj / "b.py").write_text("b = 1\n")
        with _sync_events() as events:
            res = procs.sync_workspace(Workspace(dirs=[proj])).get(timeout=60)
        assert res.files_sent == 2 and res.changed == ["proj/b.py"]
        sync_events = [e for e in events if e in kinds]
        assert sync_events == ["DescribeWorkspace", "DescribeWorkspace", "client scan", "DiffWorkspace", "DiffWorkspace"]
    finally:
        procs.stop()


# ---- the conda environment (sync_workspace(..., conda=True)) -----------------------------------------
def _fake_env(base) -> dict[str, bytes]:
    """A small conda-like environment at ``base``: text files naming its prefix, a binary that names it
    too, a large file; returns {relative path: original content}."""
    prefix = str(base)
    files = {
        "bin/tool": f"#!{prefix}/bin/python\nprint('hi')\n".encode(),
        "lib/python3.11/site-packages/envpkg/__init__.py": b"VALUE = 1\n",
        "lib/python3.11/site-packages/extra.pth": f"{prefix}/src\n".encode(),
        "lib/libbin.so": b"\x7fELF\0\x01" + prefix.encode() + b"\0" * 16,
        "share/big.dat": os.urandom(200_000),
    }
    for rel, data in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    os.chmod(base / "bin/tool", 0o755)
    return files


@pytest.mark.timeout(180)
def test_conda_env_is_mirrored_onto_each_hosts_prefix_with_text_files_rewritten(tmp_path, monkeypatch):
    env = tmp_path / "env"
    files = _fake_env(env)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "main.py").write_text("X = 1\n")
    monkeypatch.setenv("CONDA_PREFIX", str(env))
    prefixes = [tmp_path / "host0-env", tmp_path / "host1-env"]
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    try:
        procs.env.set("WORKSPACE_DIR", str(tmp_path / "ws")).get(timeout=30)
        procs.env.set("CONDA_PREFIX", [str(prefixes[0])] * 2 + [str(prefixes[1])] * 2).get(timeout=30)
        ws = Workspace(dirs=[proj])
        first = procs.sync_workspace(ws, conda=True).get(timeout=120)
        assert first.files_sent == 1 and first.conda is not None
        assert first.conda.files_sent == 2 * len(files) and sorted(first.conda.roots) == sorted(map(str, prefixes))
        for p in prefixes:
            for rel, data in files.items():
                got = (p / rel).read_bytes()
                if rel in ("bin/tool", "lib/python3.11/site-packages/extra.pth"):  # text naming the prefix
                    assert got == data.replace(str(env).encode(), str(p).encode()), rel
                else:  # no mention, or binary: as it is
                    assert got == data, rel
            assert os.stat(p / "bin/tool").st_mode & 0o777 == 0o755
        assert not (tmp_path / "ws" / "bin").exists()  # the environment is not the workspace

        again = procs.sync_workspace(ws, conda=True).get(timeout=120)
        assert again.conda.files_sent == 0 and again.conda.changed == []  # rewritten files stay unchanged

        (env / "lib/python3.11/site-packages/envpkg/__init__.py").write_text("VALUE = 2\n")
        (env / "share/big.dat").unlink()
        third = procs.sync_workspace(ws, conda=True).get(timeout=120)
        assert third.conda.changed == ["lib/python3.11/site-packages/envpkg/__init__.py", "share/big.dat"]
        assert third.conda.files_sent == 2 and third.conda.deleted == 1
        for p in prefixes:
            assert (p / "lib/python3.11/site-packages/envpkg/__init__.py").read_text() == "VALUE = 2\n"
            assert not (p / "share/big.dat").exists()

        # A host whose procs' prefix is this very environment has nothing to do; nothing there is touched.
        before = {rel: os.stat(env / rel).st_mtime_ns for rel in files if (env / rel).exists()}
        procs.env.set("CONDA_PREFIX", [str(env)] * 2 + [str(prefixes[1])] * 2).get(timeout=30)
        (env / "bin/tool").write_text(f"#!{env}/bin/python\nprint('hello')\n")
        same = procs.sync_workspace(ws, conda=True).get(timeout=120)
        assert str(env) in same.conda.roots and same.conda.files_sent == 1  # bin/tool, to host 1 only
        assert (prefixes[1] / "bin/tool").read_text() == f"#!{prefixes[1]}/bin/python\nprint('hello')\n"
        assert {rel: os.stat(env / rel).st_mtime_ns for rel in before if rel != "bin/tool"} == \
               {rel: t for rel, t in before.items() if rel != "bin/tool"}

        # A file whose mtime alone changed is compared as rewritten for the host: it does not move.
        os.utime(env / "bin/tool", ns=(time.time_ns() - 10**9, time.time_ns() - 10**9))
        touched = procs.sync_workspace(ws, conda=True).get(timeout=120)
        assert touched.conda.files_sent == 0 and touched.conda.changed == []
        assert os.stat(prefixes[1] / "bin/tool").st_mtime_ns == os.stat(env / "bin/tool").st_mtime_ns
        assert procs.sync_workspace(ws, conda=True).get(timeout=120).conda.files_sent == 0  # and stays so
    finally:
        procs.stop()


@pytest.mark.timeout(120)
def test_conda_sync_errors_are_clear(tmp_path, monkeypatch):
    import sys

    from monarch_tensor.errors import SyncError
    from monarch_tensor.tools.config.environment import CondaEnvironment

    env = tmp_path / "env"
    _fake_env(env)
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        with pytest.raises(ValueError, match="no conda environment is active"):
            procs.sync_workspace(Workspace(dirs=[]), conda=True)
        with pytest.raises(TypeError, match="must be a CondaEnvironment"):
            procs.sync_workspace(Workspace(dirs=[], env="conda"), conda=True)
        with pytest.raises(FileNotFoundError, match="does not exist"):
            procs.sync_workspace(Workspace(dirs=[], env=CondaEnvironment(str(tmp_path / "nope"))), conda=True)
        named = Workspace(dirs=[], env=CondaEnvironment(str(env)))
        procs.env.set("CONDA_PREFIX", None).get(timeout=30)
        with pytest.raises(SyncError, match=r"\$CONDA_PREFIX is not set in this proc"):
            procs.sync_workspace(named, conda=True).get(timeout=60)
        procs.env.set("CONDA_PREFIX", sys.prefix).get(timeout=30)  # this interpreter's own environment
        with pytest.raises(ValueError, match="the environment this script runs in"):
            procs.sync_workspace(named, conda=True).get(timeout=60)
        assert os.path.isdir(os.path.join(sys.prefix, "lib"))  # (untouched)
        procs.env.set("CONDA_PREFIX", str(tmp_path / "there")).get(timeout=30)
        res = procs.sync_workspace(named, conda=True).get(timeout=60)  # the named environment, anywhere else
        assert (tmp_path / "there" / "bin" / "tool").read_text().startswith(f"#!{tmp_path / 'there'}/bin/python")
        assert res.conda.files_sent == 5
    finally:
        procs.stop()


@pytest.mark.timeout(120)
def test_conda_env_named_through_a_symlink_rewrites_both_of_its_paths(tmp_path, monkeypatch):
    real = tmp_path / "real-env"
    real.mkdir()
    link = tmp_path / "env"
    link.symlink_to(real)
    files = _fake_env(link)  # its text files name the path as activated: the link
    (real / "etc").mkdir()
    (real / "etc" / "where.txt").write_text(f"{real}/lib\n")  # ... and one names the resolved path
    monkeypatch.setenv("CONDA_PREFIX", str(link))
    there = tmp_path / "there"
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        procs.env.set("CONDA_PREFIX", str(there)).get(timeout=30)
        res = procs.sync_workspace(Workspace(dirs=[]), conda=True).get(timeout=60)
        assert res.conda.files_sent == len(files) + 1
        assert (there / "bin" / "tool").read_text().startswith(f"#!{there}/bin/python")
        assert (there / "etc" / "where.txt").read_text() == f"{there}/lib\n"
    finally:
        procs.stop()


@pytest.mark.timeout(60)
def test_conda_sync_to_this_host_before_any_proc(tmp_path, monkeypatch):
    from monarch_tensor.hosts.host import _live_meshes
    from monarch_tensor.tools.config.environment import CondaEnvironment

    assert not any(p.alive for m in _live_meshes for p in m._procs if getattr(p, "agent", None) is None)
    env, other = tmp_path / "env", tmp_path / "other"
    _fake_env(env)
    _fake_env(other)
    monkeypatch.setenv("CONDA_PREFIX", str(env))
    monkeypatch.setenv("WORKSPACE_DIR", str(tmp_path / "root"))
    res = this_host().sync_workspace(Workspace(dirs=[]), conda=True).get(timeout=30)
    assert res.conda.roots == [str(env)] and res.conda.files_sent == 0  # the procs to come run in it already
    with pytest.raises(ValueError, match="no proc runs on this host yet"):
        this_host().sync_workspace(Workspace(dirs=[], env=CondaEnvironment(str(other))), conda=True).get(timeout=30)


@pytest.mark.timeout(120)
def test_conda_envs_editable_installs_sync_as_workspace_dirs_the_env_points_at(tmp_path, monkeypatch):
    env, proj = tmp_path / "env", tmp_path / "myproj"
    _fake_env(env)
    proj.mkdir()
    (proj / "myproj_mod.py").write_text("VALUE = 7\n")
    site = env / "lib/python3.11/site-packages"
    dist = site / "myproj-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myproj\nVersion: 0.1\n")
    (dist / "direct_url.json").write_text(f'{{"url": "file://{proj}", "dir_info": {{"editable": true}}}}')
    (site / "__editable__.myproj-0.1.pth").write_text(f"{proj}\n")
    monkeypatch.setenv("CONDA_PREFIX", str(env))
    assert ws_sync.editable_installs(str(env)) == [("myproj", str(proj))]
    ws_root, there = tmp_path / "ws", tmp_path / "there"
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        procs.env.set("WORKSPACE_DIR", str(ws_root)).get(timeout=30)
        procs.env.set("CONDA_PREFIX", str(there)).get(timeout=30)
        res = procs.sync_workspace(Workspace(dirs=[]), conda=True).get(timeout=60)
        assert res.changed == ["__editable__.myproj/myproj_mod.py"]
        remote_proj = ws_root / "__editable__.myproj"
        assert (remote_proj / "myproj_mod.py").read_text() == "VALUE = 7\n"
        assert (there / "lib/python3.11/site-packages/__editable__.myproj-0.1.pth").read_text() == f"{remote_proj}\n"
        assert procs.execute(lambda: __import__("myproj_mod").__file__).values() == \
            [str(remote_proj / "myproj_mod.py")] * 2
    finally:
        procs.stop()


@pytest.mark.timeout(240)
def test_a_local_jobs_hosts_get_the_conda_env_at_their_own_prefix(tmp_path, monkeypatch):
    """Through the hosts' agents (a proc made on each for the sync, stopped after), each host's procs
    having $CONDA_PREFIX where the job put it."""
    from monarch_tensor.job import LocalJob

    env = tmp_path / "env"
    files = _fake_env(env)
    monkeypatch.setenv("CONDA_PREFIX", str(env))
    there = tmp_path / "there"
    others = _agents_live_procs()
    job = LocalJob(meshes={"m": 2}, env={"CONDA_PREFIX": str(there)}, root_dir=str(tmp_path / "job"), ttl=120)
    try:
        hosts = job.state().m
        res = hosts.sync_workspace(Workspace(dirs=[]), conda=True).get(timeout=200)
        assert res.conda.roots == [str(there)]  # (one machine: the two hosts share that directory, one writes)
        assert (there / "bin" / "tool").read_text() == files["bin/tool"].decode().replace(str(env), str(there))
        assert (there / "share" / "big.dat").read_bytes() == files["share/big.dat"]
        assert _agents_live_procs(others) == []
    finally:
        job.kill()


def test_a_sync_step_to_a_proc_that_died_fails_at_once(monkeypatch):
    # A proc that died between two steps of a sync (not the writer) made the next step wait its whole
    # timeout (120 s), and the error did not name it.
    import signal

    import monarch_tensor.actor as actor_mod
    from monarch_tensor import workspace_sync
    from monarch_tensor.errors import SupervisionError
    from monarch_tensor.transport.mailbox import current_mailbox
    from monarch_tensor.workspace_sync.messages import ReloadWorkspace

    monkeypatch.setattr(actor_mod, "unhandled_fault_hook", lambda failure: None)
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        pid = procs.execute(os.getpid).item(gpus=1)
        os.kill(pid, signal.SIGKILL)
        dead = procs._procs[1].addr
        deadline = time.monotonic() + 30
        while current_mailbox().death_of(dead) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        fut = workspace_sync._ask_start(procs._procs, lambda port, slot: ReloadWorkspace("k", (), (), False, port, slot),
                                        "workspace reload")
        with pytest.raises(SupervisionError, match="rank 1"):
            fut.get(timeout=30)
    finally:
        procs.stop().get(timeout=30)


_SYNC_AND_EXIT = """
import os, sys
from monarch_tensor import Workspace, this_host
from monarch_tensor.hosts.remote_hosts import attach_to_workers
hosts = attach_to_workers([sys.argv[2]], key_file=sys.argv[3]) if len(sys.argv) > 2 else this_host()
procs = hosts.spawn_procs(per_host={"gpus": 2})
print(*procs.sync_workspace(Workspace(dirs=[sys.argv[1]])).get(timeout=60).roots, flush=True)
procs.stop().get(timeout=30)
if os.environ.get("KILL_ME"):
    os.kill(os.getpid(), 9)
"""


def _run_sync_script(tmp_path, *args, kill: bool = False) -> list[str]:
    """Run ``_SYNC_AND_EXIT`` (its own TMPDIR: its socket directory); the roots it synced to."""
    import subprocess
    import sys

    (tmp_path / "client").mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp_path / "client"), PYTHONPATH=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), **({"KILL_ME": "1"} if kill else {}))
    env.pop("WORKSPACE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _SYNC_AND_EXIT, *args], env=env, capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == (-9 if kill else 0), r.stderr
    roots = r.stdout.split()
    assert roots and all(os.path.basename(root).startswith("workspace-") for root in roots), r.stdout
    return roots


@pytest.fixture
def short_tmp():
    """A directory with a short path (socket paths under it stay within the 107 characters of a socket's)."""
    import tempfile

    d = tempfile.mkdtemp(prefix="mt-ws-")
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _gone(paths, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while any(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(os.path.exists(p) for p in paths)


@pytest.mark.timeout(120)
def test_a_sessions_default_roots_go_when_it_ends_or_is_killed(short_tmp):
    """The default root (no ``$WORKSPACE_DIR``) of a script's session on this host is removed when the script
    exits, and by its template when the script is killed."""
    proj = short_tmp / "proj"
    proj.mkdir()
    (proj / "m.py").write_text("X = 1\n")
    for kill in (False, True):
        roots = _run_sync_script(short_tmp, str(proj), kill=kill)
        assert _gone(roots + [_filetree.meta_dir(r) for r in roots]), (kill, roots)  # and their records


@pytest.mark.timeout(180)
def test_a_host_agent_removes_a_sessions_default_roots_when_it_ends(short_tmp):
    """On a host agent's host (started by hand: no ``$WORKSPACE_DIR``), a session's default root goes when the
    session ends: its client exited, or was killed and went quiet."""
    import subprocess
    import sys

    from monarch_tensor.transport._curve import JobKeys

    proj = short_tmp / "proj"
    proj.mkdir()
    (proj / "m.py").write_text("X = 1\n")
    (short_tmp / "agent").mkdir()
    JobKeys.generate().save(str(short_tmp / "job.key"))
    env = dict(os.environ, TMPDIR=str(short_tmp / "agent"), MONARCH_TENSOR_SESSION_TIMEOUT="2",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env.pop("WORKSPACE_DIR", None)
    agent = subprocess.Popen([sys.executable, "-m", "monarch_tensor.cli", "host", "--bind", "tcp://127.0.0.1:0",
                              "--key-file", str(short_tmp / "job.key"), "--address-file", str(short_tmp / "addr"),
                              "--ttl", "120"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (short_tmp / "addr").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        addr = (short_tmp / "addr").read_text().strip()
        for kill in (False, True):
            roots = _run_sync_script(short_tmp, str(proj), addr, str(short_tmp / "job.key"), kill=kill)
            assert all(r.startswith(str(short_tmp / "agent")) for r in roots), roots  # (the agent's host's)
            assert _gone(roots), (kill, roots)
    finally:
        agent.terminate()
        agent.wait(timeout=30)
