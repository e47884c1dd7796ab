"""Cluster configuration: builder ↔ YAML equality, rank order, helpers, and every rejection."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from flodl.errors import ConfigError
from flodl.launch.builder import ClusterBuilder
from flodl.launch.cluster import (
    CLUSTER_ENV_VAR,
    Cluster,
    Controller,
    RankSlot,
    SshSettings,
    Worker,
    reserved_env_reason,
)
from flodl.launch.cluster_file import load_cluster_yaml, parse_cluster_yaml

FULL_YAML = """\
cluster:
  controller:
    host: controller.example.com
    port: 1337
    path: /opt/flodl
  workers:
    - host: worker-a
      devices: [0, 1]
      nccl_socket_ifname: enp1s0
      path: /opt/flodl
      ssh:
        target: worker-a.example.com
        port: 2222
        user: ubuntu
        identity_file: ~/.ssh/cluster_key
        options: ["-o", "BatchMode=yes"]
      env:
        NCCL_DEBUG: INFO
    - host: worker-b
      local_devices: ["cuda:0"]
      nccl_socket_ifname: enp1s0
      path: /srv/flodl
  env:
    OMP_NUM_THREADS: 4
"""


def _full_builder() -> Cluster:
    return (
        ClusterBuilder()
        .controller("controller.example.com")
        .port(1337)
        .path("/opt/flodl")
        .done()
        .host("worker-a")
        .devices(["cuda:0", "cuda:1"])
        .nccl_socket_ifname("enp1s0")
        .path("/opt/flodl")
        .ssh("worker-a.example.com")
        .ssh_port(2222)
        .ssh_user("ubuntu")
        .ssh_identity_file("~/.ssh/cluster_key")
        .ssh_options(["-o", "BatchMode=yes"])
        .env("NCCL_DEBUG", "INFO")
        .done()
        .host("worker-b")
        .devices([0])
        .nccl_socket_ifname("enp1s0")
        .path("/srv/flodl")
        .done()
        .env("OMP_NUM_THREADS", "4")
        .build()
    )


def _yaml_workers(workers: str) -> str:
    return "cluster:\n  workers:\n" + workers


# equality and shape ---------------------------------------------------------------------------


def test_builder_and_yaml_build_equal_clusters() -> None:
    from_yaml = parse_cluster_yaml(FULL_YAML)
    from_builder = _full_builder()
    assert from_yaml == from_builder
    assert from_yaml.controller == Controller(
        host="controller.example.com", port=1337, path="/opt/flodl"
    )
    a, b = from_yaml.workers
    assert a.devices == ("cuda:0", "cuda:1")
    assert a.ssh == SshSettings(
        target="worker-a.example.com",
        port=2222,
        user="ubuntu",
        identity_file="~/.ssh/cluster_key",
        options=("-o", "BatchMode=yes"),
    )
    assert a.ssh_target == "worker-a.example.com"
    assert b.ssh is None
    assert b.ssh_target == "worker-b"
    assert from_yaml.env == {"OMP_NUM_THREADS": "4"}


def test_minimal_yaml_equals_minimal_builder_with_defaults() -> None:
    from_yaml = parse_cluster_yaml("cluster:\n  workers:\n    - {host: box, devices: [cpu, cpu]}\n")
    from_builder = ClusterBuilder().host("box").devices(["cpu", "cpu"]).done().build()
    assert from_yaml == from_builder
    assert from_yaml.controller == Controller()
    assert (from_yaml.controller.host, from_yaml.controller.port) == ("127.0.0.1", 1337)
    assert from_yaml.env == {}
    assert from_yaml.workers[0] == Worker(host="box", devices=("cpu", "cpu"))


def test_devices_are_normalized_to_cuda_n() -> None:
    cluster = parse_cluster_yaml(_yaml_workers("    - {host: a, devices: [0, '1', 'cuda:02']}\n"))
    assert cluster.workers[0].devices == ("cuda:0", "cuda:1", "cuda:2")


def test_other_top_level_keys_are_ignored() -> None:
    text = "commands: {train: {run: python train.py}}\n" + _yaml_workers(
        "    - {host: a, devices: [cpu]}\n"
    )
    assert parse_cluster_yaml(text).world_size == 1


def test_null_sections_take_defaults() -> None:
    text = "cluster:\n  controller:\n  env:\n  workers:\n    - {host: a, devices: [cpu], env: }\n"
    cluster = parse_cluster_yaml(text)
    assert cluster.controller == Controller()
    assert cluster.env == {}
    assert cluster.workers[0].env == {}


def test_merge_keys_may_be_overridden() -> None:
    text = (
        "base: &base {devices: [0], nccl_socket_ifname: eth0}\n"
        "cluster:\n  workers:\n"
        "    - {<<: *base, host: a}\n"
        "    - {<<: *base, host: b, devices: [0, 1]}\n"
    )
    cluster = parse_cluster_yaml(text)
    assert [w.devices for w in cluster.workers] == [("cuda:0",), ("cuda:0", "cuda:1")]


# ranks ----------------------------------------------------------------------------------------


def test_ranks_follow_worker_order() -> None:
    cluster = parse_cluster_yaml(
        _yaml_workers(
            "    - {host: a, devices: [0, 1], nccl_socket_ifname: eth0}\n"
            "    - {host: b, devices: [0], nccl_socket_ifname: eth0}\n"
            "    - {host: c, devices: [1, 0, 2], nccl_socket_ifname: eth0}\n"
        )
    )
    assert cluster.world_size == 6
    assert cluster.ranks() == [
        (0, 0, "cuda:0"),
        (1, 0, "cuda:1"),
        (2, 1, "cuda:0"),
        (3, 2, "cuda:1"),
        (4, 2, "cuda:0"),
        (5, 2, "cuda:2"),
    ]
    assert cluster.ranks()[3] == RankSlot(rank=3, worker_index=2, device="cuda:1")
    assert [cluster.ranks_of(i) for i in range(3)] == [range(2), range(2, 3), range(3, 6)]
    assert cluster.rank_hosts() == ("a", "a", "b", "c", "c", "c")
    assert cluster.device_type == "cuda"
    with pytest.raises(IndexError):
        cluster.ranks_of(3)


def test_resolve_all_replaces_all_with_probed_counts() -> None:
    cluster = parse_cluster_yaml(
        _yaml_workers(
            "    - {host: a, devices: all, nccl_socket_ifname: eth0}\n"
            "    - {host: b, devices: [1], nccl_socket_ifname: eth0}\n"
        )
    )
    assert not cluster.is_resolved
    assert cluster.device_type == "cuda"
    resolved = cluster.resolve_all({"a": 3})
    assert resolved.is_resolved
    assert resolved.workers[0].devices == ("cuda:0", "cuda:1", "cuda:2")
    assert resolved.world_size == 4
    assert resolved.ranks()[3] == (3, 1, "cuda:1")


# shortcuts ------------------------------------------------------------------------------------


def test_local_cpu_ranks() -> None:
    cluster = ClusterBuilder.local(3)
    assert cluster.world_size == 3
    assert cluster.workers == (Worker(host="127.0.0.1", devices=("cpu", "cpu", "cpu")),)
    assert cluster.controller == Controller()
    assert cluster.device_type == "cpu"
    assert cluster.is_local()
    assert not cluster.spans_hosts()
    assert ClusterBuilder.local(2, port=0).controller.port == 0


def test_local_cuda_and_all_local_gpus() -> None:
    cuda = ClusterBuilder.local(2, "cuda")
    assert cuda.workers[0].devices == ("cuda:0", "cuda:1")
    gpus = ClusterBuilder.all_local_gpus(4)
    assert gpus.workers[0].devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert gpus.world_size == 4
    assert gpus.device_type == "cuda"
    assert gpus.is_local()
    assert gpus == ClusterBuilder.local(4, "cuda")


# locality -------------------------------------------------------------------------------------


def _two_hosts(first: str, second: str) -> Cluster:
    return (
        ClusterBuilder()
        .host(first)
        .devices(["cpu"])
        .done()
        .host(second)
        .devices(["cpu"])
        .done()
        .build()
    )


def test_is_local_and_spans_hosts() -> None:
    one_remote = ClusterBuilder().host("node-a").devices(["cpu"]).done().build()
    assert not one_remote.is_local()
    assert one_remote.is_local({"node-a"})
    assert one_remote.is_local({"NODE-A"})
    assert not one_remote.spans_hosts()

    for name in ("localhost", "127.0.0.1", "::1", "LocalHost"):
        cluster = ClusterBuilder().host(name).devices(["cpu"]).done().build()
        assert cluster.is_local(), name

    mixed = _two_hosts("127.0.0.1", "node-b")
    assert not mixed.is_local()
    assert mixed.spans_hosts()
    # this machine under its own name and under loopback is one machine
    assert not mixed.spans_hosts({"node-b"})
    assert mixed.is_local({"node-b"})
    assert _two_hosts("node-a", "node-b").spans_hosts({"node-a"})


def test_worker_env_overlays_cluster_env() -> None:
    cluster = (
        ClusterBuilder()
        .env("A", "cluster")
        .env("B", "cluster")
        .host("a")
        .devices(["cpu"])
        .env("B", "worker")
        .done()
        .build()
    )
    assert cluster.worker_env(0) == {"A": "cluster", "B": "worker"}


# env JSON -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cluster",
    [
        _full_builder(),
        ClusterBuilder.local(3),
        ClusterBuilder.all_local_gpus(2),
        parse_cluster_yaml(_yaml_workers("    - {host: a, devices: all}\n")),
    ],
    ids=["full", "local-cpu", "all-local-gpus", "unresolved-all"],
)
def test_env_json_round_trip(cluster: Cluster) -> None:
    text = cluster.to_env_json()
    assert "\n" not in text
    assert Cluster.from_env_json(text) == cluster
    assert Cluster.from_env_json(text.encode()) == cluster


def test_env_json_rejects_garbage() -> None:
    with pytest.raises(ConfigError, match=r"cluster JSON.*Invalid JSON"):
        Cluster.from_env_json("{")
    with pytest.raises(ConfigError, match="at least one worker"):
        Cluster.from_env_json('{"workers": []}')
    assert CLUSTER_ENV_VAR == "FLODL_INTERNAL_FULL_CLUSTER_JSON"


def test_reserved_env_reason() -> None:
    assert reserved_env_reason("OMP_NUM_THREADS") is None
    assert reserved_env_reason("FLODL_NET_TIMEOUT_SCALE") is None
    for key in ("FLODL_INTERNAL_X", "FLODL_RANK", "FLODL_SECRET_FILE", "CUDA_VISIBLE_DEVICES"):
        reason = reserved_env_reason(key)
        assert reason is not None and "reserved" in reason


# files ----------------------------------------------------------------------------------------


def test_load_cluster_yaml_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "fdl.cluster.yml"
    path.write_text(FULL_YAML, encoding="utf-8")
    assert load_cluster_yaml(path) == _full_builder()
    assert load_cluster_yaml(str(path)) == _full_builder()


def test_load_cluster_yaml_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yml"
    with pytest.raises(ConfigError) as info:
        load_cluster_yaml(path)
    assert str(path) in str(info.value)
    assert "No such file or directory" in str(info.value)


def test_load_cluster_yaml_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_cluster_yaml(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "Is a directory" in str(info.value)


def test_load_cluster_yaml_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yml"
    path.write_text(_yaml_workers("    - {host: a, devices: [gpu]}\n"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad\.yml: invalid cluster configuration"):
        load_cluster_yaml(path)


def test_load_cluster_yaml_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yml"
    path.write_bytes(b"cluster:\n  workers: [{host: \xe9, devices: [cpu]}]\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_cluster_yaml(path)


# rejections -----------------------------------------------------------------------------------


def _yaml(text: str) -> Callable[[], object]:
    return lambda: parse_cluster_yaml(text, source="fdl.cluster.yml")


def _one(worker: str) -> Callable[[], object]:
    return _yaml(_yaml_workers(f"    - {worker}\n"))


INVALID: list[tuple[str, Callable[[], object], str]] = [
    # document shape
    ("empty-document", _yaml(""), "document is empty"),
    ("top-level-list", _yaml("- cluster\n"), "top level must be a mapping"),
    ("no-cluster-key", _yaml("clusetr: {}\n"), "missing top-level 'cluster:' key"),
    ("cluster-not-mapping", _yaml("cluster: [1]\n"), "cluster must be a mapping"),
    ("bad-yaml", _yaml("cluster:\n  workers: [{host: a\n"), "invalid YAML at line 3, column 1"),
    ("bad-indent", _yaml("cluster:\n  workers:\n - x\n  y: 1\n"), "invalid YAML at line"),
    (
        "duplicate-yaml-key",
        _yaml("cluster:\n  workers: []\n  workers: []\n"),
        "line 3, column 3: found duplicate key 'workers'",
    ),
    # workers
    ("no-workers", _yaml("cluster:\n  workers: []\n"), "cluster.workers: at least one worker"),
    ("workers-missing", _yaml("cluster:\n  env: {}\n"), "cluster.workers: at least one worker"),
    ("workers-not-list", _yaml("cluster:\n  workers: node-a\n"), "cluster.workers: must be a list"),
    ("worker-not-mapping", _one("node-a"), "cluster.workers[0]: must be a mapping"),
    ("host-missing", _one("{devices: [cpu]}"), "cluster.workers[0].host: required key is missing"),
    ("host-empty", _one("{host: '', devices: [cpu]}"), "workers[0].host: must not be empty"),
    ("host-space", _one("{host: 'a b', devices: [cpu]}"), "must not contain whitespace"),
    ("host-dash", _one("{host: -oProxy, devices: [cpu]}"), "must not start with '-'"),
    ("host-int", _one("{host: 7, devices: [cpu]}"), "workers[0].host: must be a string"),
    (
        "duplicate-host",
        _yaml(_yaml_workers("    - {host: a, devices: [cpu]}\n    - {host: A, devices: [cpu]}\n")),
        "cluster.workers[1].host: duplicate host 'A'",
    ),
    (
        "duplicate-loopback",
        _yaml(
            _yaml_workers(
                "    - {host: localhost, devices: [cpu]}\n    - {host: '::1', devices: [cpu]}\n"
            )
        ),
        "workers[1].host: duplicate host '::1' (same host as workers[0]: 'localhost')",
    ),
    # ranks
    (
        "ranks-in-worker",
        _one("{host: a, ranks: [0], devices: [0]}"),
        "cluster.workers[0].ranks: ranks are assigned by worker order; remove 'ranks'",
    ),
    (
        "ranks-in-cluster",
        _yaml("cluster:\n  ranks: 2\n  workers: [{host: a, devices: [cpu]}]\n"),
        "cluster.ranks: ranks are assigned by worker order",
    ),
    (
        "ranks-in-controller",
        _yaml("cluster:\n  controller: {ranks: [0]}\n  workers: [{host: a, devices: [cpu]}]\n"),
        "cluster.controller.ranks: ranks are assigned by worker order",
    ),
    # devices
    ("devices-missing", _one("{host: a}"), "workers[0].devices: required key is missing"),
    ("devices-empty", _one("{host: a, devices: []}"), "must list at least one device"),
    ("devices-word", _one("{host: a, devices: gpus}"), "workers[0].devices: must be a list"),
    ("device-bad", _one("{host: a, devices: [0, gpu1]}"), "devices[1]: 'gpu1' is not a device"),
    ("device-negative", _one("{host: a, devices: [-1]}"), "devices[0]: -1 is not a device"),
    ("device-bool", _one("{host: a, devices: [true]}"), "devices[0]: True is not a device"),
    (
        "devices-and-local-devices",
        _one("{host: a, devices: [0], local_devices: [1]}"),
        "give devices or local_devices, not both",
    ),
    (
        "nccl-ifname-contradicted",
        _one("{host: a, devices: [0], nccl_socket_ifname: eth0, env: {NCCL_SOCKET_IFNAME: ib0}}"),
        "workers[0].env.NCCL_SOCKET_IFNAME: contradicts nccl_socket_ifname 'eth0'",
    ),
    (
        "nccl-ifname-missing",
        _yaml(
            _yaml_workers(
                "    - {host: a, devices: [0], nccl_socket_ifname: eth0}\n"
                "    - {host: b, devices: [0]}\n"
            )
        ),
        "cluster.workers[1]: nccl_socket_ifname is required when CUDA ranks span hosts",
    ),
    (
        "nccl-ifname-space",
        _one("{host: a, devices: [0], nccl_socket_ifname: 'eth 0'}"),
        "workers[0].nccl_socket_ifname: 'eth 0' must not contain whitespace",
    ),
    # unknown keys and types
    (
        "unknown-worker-key",
        _one("{host: a, devices: [0], docker: cuda}"),
        "cluster.workers[0].docker: unknown key 'docker' (expected one of: host, devices",
    ),
    (
        "unknown-cluster-key",
        _yaml("cluster:\n  worker: [{host: a, devices: [cpu]}]\n"),
        "cluster.worker: unknown key 'worker'",
    ),
    (
        "unknown-ssh-key",
        _one("{host: a, devices: [cpu], ssh: {hostname: x}}"),
        "workers[0].ssh.hostname: unknown key 'hostname' (expected one of: target, port",
    ),
    ("ssh-not-mapping", _one("{host: a, devices: [cpu], ssh: a@b}"), "ssh: must be a mapping"),
    ("ssh-port-zero", _one("{host: a, devices: [cpu], ssh: {port: 0}}"), "ssh.port: Input should"),
    (
        "ssh-options-string",
        _one("{host: a, devices: [cpu], ssh: {options: -v}}"),
        "workers[0].ssh.options: must be a list",
    ),
    # controller
    (
        "port-too-high",
        _yaml("cluster:\n  controller: {port: 70000}\n  workers: [{host: a, devices: [cpu]}]\n"),
        "cluster.controller.port: Input should be less than or equal to 65535",
    ),
    (
        "port-negative",
        _yaml("cluster:\n  controller: {port: -1}\n  workers: [{host: a, devices: [cpu]}]\n"),
        "cluster.controller.port: Input should be greater than or equal to 0",
    ),
    (
        "port-string",
        _yaml("cluster:\n  controller: {port: '80'}\n  workers: [{host: a, devices: [cpu]}]\n"),
        "cluster.controller.port: must be an integer",
    ),
    (
        "controller-not-mapping",
        _yaml("cluster:\n  controller: box\n  workers: [{host: a, devices: [cpu]}]\n"),
        "cluster.controller: must be a mapping",
    ),
    # env
    (
        "env-reserved-rank",
        _one("{host: a, devices: [cpu], env: {FLODL_RANK: '3'}}"),
        "cluster.workers[0].env.FLODL_RANK: FLODL_RANK is reserved",
    ),
    (
        "env-reserved-internal",
        _yaml(
            "cluster:\n  env: {FLODL_INTERNAL_LOCAL_RANK: '0'}\n"
            "  workers: [{host: a, devices: [cpu]}]\n"
        ),
        "cluster.env.FLODL_INTERNAL_LOCAL_RANK: FLODL_INTERNAL_LOCAL_RANK is reserved",
    ),
    (
        "env-reserved-visibility",
        _one("{host: a, devices: [0], env: {CUDA_VISIBLE_DEVICES: '1'}}"),
        "CUDA_VISIBLE_DEVICES is reserved: each rank's device is one of its worker's devices",
    ),
    (
        "env-bad-name",
        _one("{host: a, devices: [cpu], env: {'A=B': x}}"),
        "'A=B' is not a valid environment variable name",
    ),
    ("env-bool", _one("{host: a, devices: [cpu], env: {X: yes}}"), "env.X: must be a string"),
    ("env-not-mapping", _one("{host: a, devices: [cpu], env: [X]}"), "env: must be a mapping"),
    # builder misuse
    (
        "builder-devices-before-host",
        lambda: ClusterBuilder().devices(["cpu"]),
        "devices() needs an open worker: call host(name) first",
    ),
    (
        "builder-devices-in-controller",
        lambda: ClusterBuilder().controller("c").devices(["cpu"]),
        "devices() does not apply to controller(): call done(), then host(name)",
    ),
    (
        "builder-port-in-worker",
        lambda: ClusterBuilder().host("a").port(1),
        "port() does not apply to worker 'a': call done(), then controller(host)",
    ),
    (
        "builder-path-nothing-open",
        lambda: ClusterBuilder().path("/x"),
        "path() needs an open controller or worker",
    ),
    (
        "builder-ssh-nothing-open",
        lambda: ClusterBuilder().ssh_port(22),
        "ssh_port() needs an open worker",
    ),
    (
        "builder-build-open-worker",
        lambda: ClusterBuilder().host("a").devices(["cpu"]).build(),
        "build() while worker 'a' is open: call done() first",
    ),
    (
        "builder-build-open-controller",
        lambda: ClusterBuilder().controller("c").build(),
        "build() while controller() is open: call done() first",
    ),
    (
        "builder-host-while-open",
        lambda: ClusterBuilder().host("a").host("b"),
        "host() while worker 'a' is open: call done()",
    ),
    (
        "builder-two-controllers",
        lambda: ClusterBuilder().controller("c").done().controller("d"),
        "controller() was already called",
    ),
    ("builder-done-nothing", lambda: ClusterBuilder().done(), "done() has nothing to close"),
    (
        "builder-env-in-controller",
        lambda: ClusterBuilder().controller("c").env("A", "B"),
        "env() does not apply to controller()",
    ),
    (
        "builder-ranks",
        lambda: ClusterBuilder().host("a").ranks([0, 1]),
        "ranks are assigned by worker order; remove 'ranks'",
    ),
    (
        "builder-no-workers",
        lambda: ClusterBuilder().controller("c").done().build(),
        "ClusterBuilder: invalid cluster configuration: workers: at least one worker",
    ),
    (
        "builder-device-string",
        lambda: ClusterBuilder().host("a").devices("cuda:0").done().build(),
        "workers[0].devices: must be a list of devices",
    ),
    (
        "builder-reserved-env",
        lambda: ClusterBuilder().env("FLODL_SECRET", "x").host("a").devices(["cpu"]).done().build(),
        "env.FLODL_SECRET: FLODL_SECRET is reserved",
    ),
    (
        "builder-port-range",
        lambda: (
            ClusterBuilder()
            .controller("c")
            .port(65_536)
            .done()
            .host("a")
            .devices([0])
            .done()
            .build()
        ),
        "controller.port: Input should be less than or equal to 65535",
    ),
    (
        "builder-bool-ssh-port",
        lambda: ClusterBuilder().host("a").devices([0]).ssh_port(True).done().build(),
        "workers[0].ssh.port: must be an integer",
    ),
    ("local-zero-ranks", lambda: ClusterBuilder.local(0), "ranks must be an integer ≥ 1, got 0"),
    ("local-bad-device", lambda: ClusterBuilder.local(2, "gpu"), "device must be 'cpu' or 'cuda'"),
    ("all-local-gpus-zero", lambda: ClusterBuilder.all_local_gpus(0), "no GPUs to use (count 0)"),
    # unresolved "all"
    (
        "all-unresolved-world-size",
        lambda: parse_cluster_yaml(_yaml_workers("    - {host: a, devices: all}\n")).world_size,
        "workers[0].devices is 'all' on 'a': resolve it",
    ),
    (
        "all-without-count",
        lambda: parse_cluster_yaml(_yaml_workers("    - {host: a, devices: all}\n")).resolve_all(
            {"b": 2}
        ),
        "no GPU count was given for 'a'",
    ),
    (
        "all-with-zero-gpus",
        lambda: parse_cluster_yaml(_yaml_workers("    - {host: a, devices: all}\n")).resolve_all(
            {"a": 0}
        ),
        "'a' has no GPUs",
    ),
]


@pytest.mark.parametrize(
    ("make", "phrase"),
    [(make, phrase) for _, make, phrase in INVALID],
    ids=[i for i, *_ in INVALID],
)
def test_invalid_config_is_rejected(make: Callable[[], object], phrase: str) -> None:
    with pytest.raises(ConfigError) as info:
        make()
    assert phrase in str(info.value)


def test_invalid_table_is_large_and_named_uniquely() -> None:
    names = [name for name, *_ in INVALID]
    assert len(names) >= 15
    assert len(set(names)) == len(names)


def test_yaml_errors_are_value_errors_named_by_source() -> None:
    with pytest.raises(ValueError, match=r"^fdl\.cluster\.yml: "):
        _one("{host: a, devices: [gpu]}")()
    with pytest.raises(ConfigError, match=r"^<string>: "):
        parse_cluster_yaml("cluster: 1\n")


def test_every_problem_of_a_document_is_reported() -> None:
    with pytest.raises(ConfigError) as info:
        parse_cluster_yaml(_yaml_workers("    - {host: '', devices: [gpu], path: ''}\n"))
    message = str(info.value)
    assert "cluster.workers[0].host: must not be empty" in message
    assert "cluster.workers[0].devices[0]: 'gpu' is not a device" in message
    assert "cluster.workers[0].path: must not be empty" in message


def test_builder_is_reusable_and_unaffected_by_later_calls() -> None:
    builder = ClusterBuilder().host("a").devices(["cpu"]).env("K", "1").done()
    first = builder.build()
    builder.host("b").devices(["cpu"]).done()
    assert first.workers[0].env == {"K": "1"}
    assert len(first.workers) == 1
    assert len(builder.build().workers) == 2


def test_models_are_frozen() -> None:
    cluster = ClusterBuilder.local(1)
    with pytest.raises(ValueError, match="frozen"):
        cluster.controller.port = 1  # type: ignore[misc]
