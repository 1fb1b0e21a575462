"""Objects named by ``"package.module:attribute"`` strings, imported where they are used: the tools' hooks
(``_hooks``) and actor classes that a process spawns without importing them (``SpawnActor.cls``).

>>> resolve("os.path:join")("a", "b")
'a/b'
"""

from __future__ import annotations

import importlib
from typing import Any


def check(ref: object, what: str) -> str:
    """``ref`` itself if it reads as ``"package.module:attribute"``, else a ``ValueError`` naming ``what``."""
    if not isinstance(ref, str):
        raise ValueError(f"{what} must be 'package.module:attribute', got {ref!r}")
    module, sep, attr = ref.partition(":")
    if not (sep and module and all(p.isidentifier() for p in module.split("."))
            and all(p.isidentifier() for p in attr.split("."))):
        raise ValueError(f"{what} must be 'package.module:attribute', got {ref!r}")
    return ref


def resolve(ref: str) -> Any:
    """The object ``ref`` names, its module imported here (``attribute`` may be dotted: ``Class.method``)."""
    module, _, attr = check(ref, "a name of an object").partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
