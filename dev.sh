#!/usr/bin/env bash
# Set-up and everyday commands for monarch-tensor, on a fresh machine or not:
#   bash dev.sh demo    # install what is missing into .venv, run the main demo on a local mesh
#   bash dev.sh test    # install what is missing into .venv, lint (ruff), type-check (mypy), run the test suite
#   bash dev.sh bench   # the actor benchmark (add --peers to compare with Monarch and Ray)
# Torch: the CPU wheel where no NVIDIA GPU is present, the default (CUDA) build otherwise.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${MONARCH_TENSOR_VENV:-.venv}
PY=${PYTHON:-python3}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  local py="$VENV/bin/python"
  if ! "$py" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      "$py" -m pip install -q torch
    else
      # 2.13.0 is the CPU wheel cached on project machines; elsewhere take PyTorch's CPU index.
      "$py" -m pip install -q torch==2.13.0 2>/dev/null \
        || "$py" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
    fi
  fi
  if ! "$py" -c "import monarch_tensor, zmq, cloudpickle, pytest, hypothesis, pytest_timeout, xdist, mypy, mkdocs, mkdocstrings_handlers.python" 2>/dev/null \
     || [ pyproject.toml -nt "$VENV/.installed" ]; then
    "$py" -m pip install -q -e ".[dev]"
    touch "$VENV/.installed"
  fi
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)  setup; exec "$VENV/bin/python" examples/actors_basics.py "$@" ;;
  # The tests wait on processes and sockets more than they compute: 3 workers (pytest-xdist), each running whole
  # files (module fixtures stay shared; tests/test_slurm.py's cluster is used by one file) but for the few files
  # that tests/conftest.py hands out test by test, the longest units first (tests/durations.json). A later -n wins:
  # `bash dev.sh test -n 0 tests/test_x.py -k y` runs in this process.
  # Byte-code caching on (an environment may turn it off): the tests start hundreds of Python processes.
  test)  setup; "$VENV/bin/python" -m ruff check .; "$VENV/bin/python" -m mypy; unset PYTHONDONTWRITEBYTECODE
         exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 -n 3 --dist loadfile --no-loadscope-reorder "$@" ;;
  bench) setup; exec "$VENV/bin/python" bench/actor_bench.py "$@" ;;
  setup) setup ;;
  *) echo "usage: bash dev.sh {demo|test|bench|setup} [args...]" >&2; exit 2 ;;
esac
