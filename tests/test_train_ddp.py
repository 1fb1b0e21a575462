"""examples/train_ddp.py on a real 2-proc mesh: its losses equal plain local training on the same batches."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import train_ddp  # noqa: E402
from test_gpt_example import decode_png  # noqa: E402

STEPS = 6
ARGS = ["--gpus", "2", "--steps", str(STEPS), "--batch", "4", "--block", "16", "--n-layer", "1", "--n-embd", "32",
        "--threads", "1", "--sample-chars", "40"]


@pytest.mark.timeout(150)
def test_train_ddp_matches_local_training(tmp_path):
    args = ARGS + ["--out-dir", str(tmp_path), "--json", str(tmp_path / "run.json")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, os.path.join("examples", "train_ddp.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=140)
    out = proc.stdout
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out}\n{proc.stderr[-4000:]}"

    # one line per step: progress bar, mean loss, each rank's loss
    steps = re.findall(r"^\[[#.]{20}\] +(\d+)/6 \| loss ([\d.]+) \| per rank ([\d.]+) ([\d.]+) \| \d+ ms/step$",
                       out, re.M)
    assert [int(s[0]) for s in steps] == list(range(1, STEPS + 1)), out
    for _, mean, a, b in steps:
        assert abs(float(mean) - (float(a) + float(b)) / 2) < 1e-3

    mesh = json.loads((tmp_path / "run.json").read_text())["losses"]
    torch.set_num_threads(1)
    local = train_ddp.train_local(train_ddp.settings_from_args(args))
    assert len(mesh) == len(local) == STEPS and all(len(r) == 2 for r in mesh)
    assert torch.allclose(torch.tensor(mesh), torch.tensor(local), rtol=1e-4, atol=1e-5), (mesh, local)
    assert all(abs(a - b) > 1e-4 for a, b in mesh), "both ranks trained on the same batches"

    w, h, _ = decode_png((tmp_path / "train_ddp_loss.png").read_bytes()) if "(builtin)" in out else (1, 1, None)
    assert (tmp_path / "train_ddp_loss.png").stat().st_size > 1000 and w > 0 and h > 0
    assert re.search(r"^sample: The .{40}$", out, re.M), out
    assert re.search(r"^done in [\d.]+ s: loss [\d.]+ -> [\d.]+$", out, re.M), out
