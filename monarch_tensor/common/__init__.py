"""Monarch's ``monarch.common`` paths for the tensor engine's names, so that imports such as
``from monarch.common.remote import remote`` work with ``monarch`` renamed: ``remote``, ``opaque_ref``,
``stream``, ``device_mesh``, ``tensor``, ``future``. Each module re-exports the names this project has
(its engine lives in ``controller/`` and ``worker/``); Monarch's internals there are not part of it."""
