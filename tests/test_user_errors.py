"""An error the engine raises at the user's line reads as local torch's: torch's own message, a traceback that
ends at the user's line, no chained meta-kernel error; the engine's frames stay on ``e.engine_traceback``."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import torch
    from monarch_tensor import this_host

    procs = this_host().spawn_procs({"dp": 2})
    with procs.activate():
        x = torch.randn(4, 4)
        try:
            x @ torch.randn(3, 5)
        except RuntimeError as e:
            print("caught:", e, "| cause:", e.__cause__, "| engine frames kept:",
                  "controller" in e.engine_traceback)
        y = x @ torch.randn(3, 5)   # the user's line
''')


def _run(args, stdin=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *args], input=stdin, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=100)


def test_a_shape_error_in_a_script_reads_as_local_torchs(tmp_path):
    path = tmp_path / "user.py"
    path.write_text(SCRIPT)
    p = _run([str(path)])
    assert p.returncode == 1
    assert "caught: mat1 and mat2 shapes cannot be multiplied (4x4 and 3x5) | cause: None | engine frames kept: True" \
        in p.stdout
    tb = p.stderr[p.stderr.index("Traceback (most recent call last):"):].strip().splitlines()  # (after any notice)
    assert tb[-1] == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x4 and 3x5)"
    frames = [line for line in tb if line.startswith('  File "')]
    assert frames == [f'  File "{path}", line 13, in <module>'], p.stderr  # the user's line, and only it
    assert "direct cause" not in p.stderr and "During handling" not in p.stderr


def test_a_shape_error_at_the_interactive_prompt_ends_at_the_users_line():
    p = _run(["-i", "-q"], stdin=SCRIPT + "\nprint('still here')\n")
    assert "still here" in p.stdout  # the session goes on
    tb = p.stderr[p.stderr.rindex("Traceback"):].splitlines()
    frames = [line for line in tb if line.startswith('  File "')]
    assert len(frames) == 1 and frames[0].startswith('  File "<stdin>", line '), p.stderr  # the prompt's line only
    assert any(line.endswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x4 and 3x5)") for line in tb)


def test_an_internal_failure_keeps_its_whole_traceback(tmp_path):
    # Only the engine's deliberate errors lose its frames: anything else (a bug here) prints as it is.
    path = tmp_path / "bug.py"
    path.write_text(textwrap.dedent('''
        import torch
        import monarch_tensor.controller.tensor as t
        from monarch_tensor import this_host

        def broken(*a, **k):
            raise KeyError("an engine bug")

        t._propagate = broken
        procs = this_host().spawn_procs({"dp": 1})
        with procs.activate():
            torch.ones(2) * 3
    '''))
    p = _run([str(path)])
    assert p.returncode == 1 and "KeyError: 'an engine bug'" in p.stderr
    assert "controller/tensor.py" in p.stderr and "in broken" in p.stderr
