"""The public API: every name ``flodl`` exports resolves, lazily, to the object it documents."""

from __future__ import annotations

import importlib

import flodl


def test_every_exported_name_resolves() -> None:
    for name in flodl.__all__:
        assert getattr(flodl, name) is not None, name


def test_the_cluster_builder_is_public() -> None:
    from flodl import ClusterBuilder

    assert ClusterBuilder is importlib.import_module("flodl.launch.builder").ClusterBuilder
    cluster = ClusterBuilder().host("localhost").devices(["cpu", "cpu"]).done().build()
    assert cluster.world_size == 2
