"""Which placements each mode trains (docs/design.md §2c, "Devices"): the rule, the cluster
that feeds it, the launcher that applies it before any process starts, and the coordinator
that applies it to every hello."""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl import ConfigError, ElCheConfig, TensorBatchDataset, TrainerConfig
from flodl.config import CoordConfig, validated
from flodl.coord.effects import RefusePeer, Reply
from flodl.coord.machine import Coordinator
from flodl.launch.builder import ClusterBuilder
from flodl.launch.cluster import Cluster
from flodl.launch.launcher import placed
from flodl.modes import MODES, traits_of
from flodl.placement import Placement, cpu_averaging_modes, placement_problem
from flodl.wire.frames import Accept, Hello, Reject

CPU_MODES = ["cpu_sync", "cpu_cadence", "cpu_async"]
COLLECTIVE = ["nccl_sync", "nccl_cadence"]
MIXED = [Placement(0, "a", "cuda:0", "GPU-1"), Placement(1, "a", "cpu")]
SHARED = [Placement(0, "a", "cuda:0", "GPU-1"), Placement(1, "a", "cuda:0", "GPU-1")]


def test_the_cpu_averaging_modes_are_the_ones_named_in_the_messages() -> None:
    assert sorted(cpu_averaging_modes()) == sorted(CPU_MODES)
    assert sorted(CPU_MODES + COLLECTIVE) == sorted(MODES)


@pytest.mark.parametrize("mode", CPU_MODES)
def test_a_cpu_averaging_mode_trains_any_placement(mode: str) -> None:
    traits = traits_of(mode)
    assert placement_problem(traits, MIXED) is None
    assert placement_problem(traits, SHARED) is None


@pytest.mark.parametrize("mode", COLLECTIVE)
def test_a_collective_mode_refuses_mixed_devices_naming_the_modes_that_work(mode: str) -> None:
    problem = placement_problem(traits_of(mode), MIXED)
    assert problem is not None
    assert f"{mode} averages with one torch.distributed backend" in problem
    assert "rank 0 is on cuda:0 of host 'a' and rank 1 on cpu of host 'a'" in problem
    assert "(cpu_sync, cpu_cadence, cpu_async) train ranks on mixed devices" in problem


@pytest.mark.parametrize("mode", COLLECTIVE)
def test_a_collective_mode_refuses_two_ranks_on_one_gpu(mode: str) -> None:
    problem = placement_problem(traits_of(mode), SHARED)
    assert problem is not None
    assert "needs a GPU of its own for every rank (NCCL refuses two ranks on one device)" in problem
    assert "ranks 0 and 1 are both on cuda:0 of host 'a' (GPU GPU-1)" in problem


def test_the_gpu_id_tells_gpus_apart_where_device_strings_agree() -> None:
    traits = traits_of("nccl_cadence")
    # each rank sees its own GPU as cuda:0 (CUDA_VISIBLE_DEVICES differs): no conflict
    apart = [Placement(0, "a", "cuda:0", "GPU-1"), Placement(1, "a", "cuda:0", "GPU-2")]
    assert placement_problem(traits, apart) is None
    # without ids, the same device string on one host is one GPU; on two hosts two
    assert placement_problem(traits, [Placement(0, "a", "cuda:0"), Placement(1, "a", "cuda:0")])
    assert (
        placement_problem(traits, [Placement(0, "a", "cuda:0"), Placement(1, "b", "cuda:0")])
        is None
    )
    # CPU ranks of a collective mode share a host freely (Gloo)
    cpus = [Placement(0, "a", "cpu"), Placement(1, "a", "cpu")]
    assert placement_problem(traits, cpus) is None


# the cluster ------------------------------------------------------------------------------------


def test_a_cluster_may_mix_devices_and_list_a_gpu_twice() -> None:
    mixed = ClusterBuilder.local_devices(["cuda:0", "cpu", 0])
    assert [s.device for s in mixed.ranks()] == ["cuda:0", "cpu", "cuda:0"]
    assert mixed.device_type == "mixed"
    assert [p.host for p in mixed.placements()] == ["\x00this-machine"] * 3
    assert ClusterBuilder.local(3, "cuda", gpus=2).workers[0].devices == (
        "cuda:0",
        "cuda:1",
        "cuda:0",
    )
    two = (
        ClusterBuilder()
        .host("gpu-box")
        .devices([0])
        .done()
        .host("cpu-box")
        .devices(["cpu"])
        .done()
        .build()
    )
    assert two.device_type == "mixed"  # one CUDA host: no nccl_socket_ifname needed


def test_nccl_socket_ifname_is_exported_to_that_hosts_ranks() -> None:
    cluster = (
        ClusterBuilder()
        .env("NCCL_SOCKET_IFNAME", "eth9")
        .host("a")
        .devices([0])
        .nccl_socket_ifname("ib0")
        .done()
        .host("b")
        .devices([0])
        .nccl_socket_ifname("eth0")
        .env("NCCL_SOCKET_IFNAME", "eth0")
        .done()
        .host("c")
        .devices(["cpu"])
        .done()
        .build()
    )
    assert cluster.worker_env(0)["NCCL_SOCKET_IFNAME"] == "ib0"  # the worker's field wins
    assert cluster.worker_env(1)["NCCL_SOCKET_IFNAME"] == "eth0"
    assert cluster.worker_env(2)["NCCL_SOCKET_IFNAME"] == "eth9"  # the cluster env, as given


# the launcher: before any process starts ------------------------------------------------------


def config(mode: str, **kw: Any) -> TrainerConfig:
    ds = TensorBatchDataset(torch.zeros(64, 2))
    return TrainerConfig(dataset=ds, elche=ElCheConfig.preset(mode), **kw)


def fake_smi(tmp: Path, gpus: int) -> str:
    exe = tmp / "nvidia-smi"
    lines = "".join(f"{i}, GPU-{i}, NVIDIA H200, 143771\n" for i in range(gpus))
    exe.write_text(f"#!/bin/sh\ncat <<'EOF'\n{lines}EOF\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return f"{tmp}{os.pathsep}/usr/bin:/bin"


def all_gpus_here() -> Cluster:
    return ClusterBuilder().host("localhost").devices("all").done().build()


def test_the_launcher_resolves_devices_all_here_with_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", fake_smi(tmp_path, 3))
    cluster = placed(config("nccl_cadence"), all_gpus_here(), frozenset())
    assert [s.device for s in cluster.ranks()] == ["cuda:0", "cuda:1", "cuda:2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # honoured, as for auto-promotion
    assert placed(config("nccl_cadence"), all_gpus_here(), frozenset()).world_size == 1


def test_devices_all_on_a_host_without_gpus_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", fake_smi(tmp_path, 0))
    with pytest.raises(ConfigError, match=r"devices is 'all' but 'localhost' has no GPUs"):
        placed(config("cpu_cadence"), all_gpus_here(), frozenset())


def test_the_world_dependent_settings_are_checked_once_devices_all_is_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", fake_smi(tmp_path, 2))
    c = config("cpu_cadence", cluster=all_gpus_here(), epoch_callback_policy=3)
    with pytest.raises(ConfigError, match=r"for 2 ranks: .*Rank\(3\) is out of range for 2"):
        placed(c, all_gpus_here(), frozenset())


@pytest.mark.parametrize("mode", COLLECTIVE)
def test_the_launcher_refuses_a_collective_mode_on_mixed_or_shared_devices(mode: str) -> None:
    with pytest.raises(ConfigError, match="train ranks on mixed devices"):
        placed(config(mode), ClusterBuilder.local_devices(["cuda:0", "cpu"]), frozenset())
    with pytest.raises(ConfigError, match="ranks 0 and 2 are both on cuda:0"):
        placed(config(mode), ClusterBuilder.local(3, "cuda", gpus=2), frozenset())


@pytest.mark.parametrize("mode", CPU_MODES)
def test_the_launcher_lets_a_cpu_averaging_mode_mix_and_share(mode: str) -> None:
    mixed = ClusterBuilder.local_devices(["cuda:0", "cpu", "cuda:0"])
    assert placed(config(mode), mixed, frozenset()) == mixed


def test_trainer_config_refuses_two_placements_and_unknown_devices() -> None:
    with pytest.raises(ValueError, match="set one of ranks, local_devices and cluster"):
        config("cpu_cadence", ranks=2, local_devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        config("cpu_cadence", device="gpu")
    with pytest.raises(ValueError, match="'gpu1' is not a device"):
        config("cpu_cadence", local_devices=["cpu", "gpu1"])


# the coordinator: every hello -----------------------------------------------------------------


def coordinator(mode: str) -> Coordinator:
    cfg = validated(
        CoordConfig,
        world_size=2,
        dataset_len=640,
        batch_size=32,
        elche=ElCheConfig.preset(mode),
    )
    return Coordinator(cfg, random.Random(0))


def hello(rank: int, device: str, gpu: str | None = None) -> Hello:
    return Hello(
        run_id="run",
        rank=rank,
        world_size=2,
        model_signature="a" * 64,
        host="node-a",
        device=device,
        gpu=gpu,
    )


@pytest.mark.parametrize("mode", COLLECTIVE)
def test_the_coordinator_refuses_a_rank_on_a_gpu_a_live_rank_holds(mode: str) -> None:
    coord = coordinator(mode)
    first = coord.handle(hello(0, "cuda:0", "GPU-7"), 0.0)
    assert isinstance(first[0], Reply) and isinstance(first[0].frame, Accept)
    # rank 1 sees the same GPU as cuda:1 (another visibility mask): the UUID says it is one GPU
    effects = coord.handle(hello(1, "cuda:1", "GPU-7"), 0.1)
    assert [type(e) for e in effects] == [Reply, RefusePeer]
    reply = effects[0]
    assert isinstance(reply, Reply) and isinstance(reply.frame, Reject)
    assert reply.frame.reason.startswith("rank 1 cannot join: ")
    both = "ranks 0 (cuda:0) and 1 (cuda:1) are both on one GPU of host 'node-a' (GPU GPU-7)"
    assert both in reply.frame.reason
    assert "use a CPU averaging mode (cpu_sync, cpu_cadence, cpu_async)" in reply.frame.reason
    # nothing changed: rank 1 on a GPU of its own still joins
    joined = coord.handle(hello(1, "cuda:1", "GPU-8"), 0.2)
    assert isinstance(joined[0], Reply) and isinstance(joined[0].frame, Accept)


@pytest.mark.parametrize("mode", COLLECTIVE)
def test_the_coordinator_refuses_a_cpu_rank_beside_gpu_ranks(mode: str) -> None:
    coord = coordinator(mode)
    coord.handle(hello(0, "cuda:0", "GPU-7"), 0.0)
    effects = coord.handle(hello(1, "cpu"), 0.1)
    reply = effects[0]
    assert isinstance(reply, Reply) and isinstance(reply.frame, Reject)
    assert "train ranks on mixed devices" in reply.frame.reason


@pytest.mark.parametrize("mode", CPU_MODES)
def test_the_coordinator_admits_mixed_and_shared_placements_in_cpu_modes(mode: str) -> None:
    coord = coordinator(mode)
    coord.handle(hello(0, "cuda:0", "GPU-7"), 0.0)
    effects = coord.handle(hello(1, "cuda:0", "GPU-7"), 0.1)
    assert not any(isinstance(e, RefusePeer) for e in effects)


def test_a_dead_ranks_gpu_is_free_again_and_a_rank_never_conflicts_with_itself() -> None:
    from flodl.coord.membership import Membership
    from flodl.timeouts import Timeouts

    m = Membership(3, "run", Timeouts(), traits=traits_of("nccl_cadence"))
    first = hello(0, "cuda:0", "GPU-7").model_copy(update={"world_size": 3})
    assert m.refusal(first, forming=True) is None
    m.place(first)
    m.join(first, 0.0)
    clash = hello(1, "cuda:0", "GPU-7").model_copy(update={"world_size": 3})
    assert "both on cuda:0" in (m.refusal(clash, forming=True) or "")
    assert m.declare_dead(0, "test")
    assert m.refusal(clash, forming=True) is None  # its holder died: the GPU is free
    # rank 0's next incarnation on its own GPU is no conflict with its earlier self
    assert m.refusal(first, forming=True, rejoining=None) is None
