"""Monarch's ``monarch.fetch`` path: ``from monarch_tensor.fetch import fetch_shard, inspect``."""

from monarch_tensor.controller.api import call_on_shard_and_fetch, fetch_shard, inspect, show

__all__ = ["call_on_shard_and_fetch", "fetch_shard", "inspect", "show"]
