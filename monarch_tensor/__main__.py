"""``python -m monarch_tensor ...``: the ``monarch-tensor`` command line (monarch_tensor/cli.py)."""

import sys

from monarch_tensor.cli import main

sys.exit(main())
