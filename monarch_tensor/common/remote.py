"""Monarch's ``monarch.common.remote`` path."""

from monarch_tensor.controller.api import call_on_shard_and_fetch, remote

__all__ = ["call_on_shard_and_fetch", "remote"]
