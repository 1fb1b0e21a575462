"""Data-plane backends, one file each behind :class:`base.Backend`."""
