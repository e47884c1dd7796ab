"""``examples/kubernetes/flodl.yaml`` holds together (docs/schedulers.md, "Kubernetes").

Structural checks only (no cluster): the objects are there, the ranks' environment agrees with
the coordinator's command line, the Service can carry a run, the secret is never a value in
the file and reaches the coordinator as a file flodl's mode check accepts, and every container
runs something that exists. Each check fails when its part of the manifest is broken
(``test_each_check_fails_on_a_broken_manifest``).
"""

from __future__ import annotations

import argparse
import copy
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from flodl.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "examples" / "kubernetes" / "flodl.yaml"
DOCKERFILE = REPO / "examples" / "kubernetes" / "Dockerfile"
SECRET_NAME = "flodl-run"

Doc = dict[str, Any]


def load(text: str | None = None) -> list[Doc]:
    docs = list(yaml.safe_load_all(MANIFEST.read_text() if text is None else text))
    return [d for d in docs if d is not None]


def one(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec(obj: Doc) -> Doc:
    spec: Doc = obj["spec"]["template"]["spec"]
    return spec


def containers(obj: Doc) -> list[Doc]:
    spec = pod_spec(obj)
    found: list[Doc] = [*spec.get("initContainers", []), *spec["containers"]]
    return found


def option(argv: list[str], name: str) -> str:
    """The value of ``name`` in ``argv`` (``--name V`` or ``--name=V``)."""
    for i, arg in enumerate(argv):
        if arg == name:
            assert i + 1 < len(argv), f"{name} has no value"
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} is not on the command line {argv}")


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def field_ref(entry: Doc | None) -> str | None:
    """The downward-API field an env entry reads, if it reads one."""
    path = ((entry or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
    return None if path is None else str(path)


def coord_argv(docs: list[Doc]) -> list[str]:
    (coord,) = [
        c for c in containers(one(docs, "Deployment")) if c["command"][:2] == ["flodl", "coord"]
    ]
    argv: list[str] = [*coord["command"], *coord.get("args", [])]
    return argv


def rank_container(docs: list[Doc]) -> Doc:
    (rank,) = one(docs, "Job")["spec"]["template"]["spec"]["containers"]
    return dict(rank)


def coord_subparser() -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub: argparse.ArgumentParser = action.choices["coord"]
            return sub
    raise AssertionError("flodl has no coord subcommand")


def dockerfile_workdir() -> str:
    found = re.findall(r"^WORKDIR\s+(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    assert found, "the Dockerfile sets no WORKDIR"
    return str(found[-1])


def dockerfile_copies() -> list[str]:
    """Repository paths the Dockerfile copies into its WORKDIR (``COPY src... dest``)."""
    copied: list[str] = []
    for line in DOCKERFILE.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"]:
            copied += [p.rstrip("/") for p in parts[1:-1]]
    return copied


def walk_strings(node: object) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from walk_strings(k)
            yield from walk_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk_strings(v)


# -------------------------------------------------------------------------------------------------
# the checks, each on a list of documents
# -------------------------------------------------------------------------------------------------


def check_kinds(docs: list[Doc]) -> None:
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "Job", "Service"], kinds
    deployment = one(docs, "Deployment")
    assert deployment["apiVersion"] == "apps/v1"
    assert deployment["spec"]["replicas"] == 1, "one coordinator per run"
    assert deployment["spec"]["strategy"]["type"] == "Recreate", (
        "a rolling update would run two coordinators of one run"
    )
    assert one(docs, "Job")["apiVersion"] == "batch/v1"


def check_world_size(docs: list[Doc]) -> None:
    world = int(option(coord_argv(docs), "--world-size"))
    job = one(docs, "Job")["spec"]
    assert job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"] == world, (job, world)
    env = env_of(rank_container(docs))
    assert env["FLODL_WORLD_SIZE"]["value"] == str(world)
    assert field_ref(env.get("FLODL_RANK")) == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )


def check_restarts(docs: list[Doc]) -> None:
    job = one(docs, "Job")["spec"]
    assert job.get("backoffLimitPerIndex", 0) >= 1, "a failed rank pod must be replaced"
    assert job["template"]["spec"]["restartPolicy"] == "Never", (
        "backoffLimitPerIndex needs restartPolicy Never"
    )
    assert job.get("podReplacementPolicy") == "Failed", (
        "a replacement that starts while the old pod still holds its connection is refused"
    )
    restart = env_of(rank_container(docs)).get("FLODL_RESTART_COUNT")
    assert field_ref(restart) == (
        "metadata.annotations['batch.kubernetes.io/job-index-failure-count']"
    )


def service_target(docs: list[Doc], entry: Doc) -> int:
    """The coordinator container port a Service port sends to (``targetPort``, maybe named)."""
    target: Any = entry.get("targetPort", entry["port"])
    if isinstance(target, str):  # a named container port
        (coord,) = containers(one(docs, "Deployment"))
        named = {p["name"]: p["containerPort"] for p in coord.get("ports", []) if "name" in p}
        assert target in named, f"targetPort {target!r} names no container port"
        target = named[target]
    return int(target)


def check_address(docs: list[Doc]) -> None:
    service = one(docs, "Service")
    host, _, port = env_of(rank_container(docs))["FLODL_COORD"]["value"].rpartition(":")
    assert host == service["metadata"]["name"], (host, service["metadata"]["name"])
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert int(port) in ports, f"FLODL_COORD's port {port} is not one the Service exposes"
    argv = coord_argv(docs)
    assert option(argv, "--host") in ("0.0.0.0", "::"), "the coordinator must listen on the pod IP"
    listen = int(option(argv, "--port"))
    target = service_target(docs, ports[int(port)])
    assert target == listen, f"the Service sends {port} to {target}, the coordinator is on {listen}"
    # The coordinator announces its data port (reduce server or store) in `accept`, and the
    # ranks dial that number at FLODL_COORD's host: the Service must expose it under the same
    # number, so it must be fixed (--data-port), unless the Service is headless (the pod's IP).
    if service["spec"].get("clusterIP") != "None":
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
        data = int(option(argv, "--data-port"))
        assert data != 0, "a random data port (--data-port 0) cannot go through a ClusterIP Service"
        assert data in ports, f"the Service does not expose the data port {data} as {data}"
        sent = service_target(docs, ports[data])
        assert sent == data, f"the Service sends the data port {data} to {sent}"
    selector = service["spec"]["selector"]
    coord_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    rank_labels = one(docs, "Job")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= coord_labels.items(), "the Service does not select the coordinator"
    assert not selector.items() <= rank_labels.items(), "the Service also selects the ranks"


def check_run_id(docs: list[Doc]) -> None:
    run_id = option(coord_argv(docs), "--run-id")
    assert env_of(rank_container(docs))["FLODL_RUN_ID"]["value"] == run_id


def secret_volume_of(obj: Doc, path: str) -> tuple[Doc, Doc]:
    """The (volumeMount, secret volume source) a container of ``obj`` reads ``path`` from."""
    volumes = {v["name"]: v for v in pod_spec(obj).get("volumes", [])}
    for c in containers(obj):
        for mount in c.get("volumeMounts", []):
            if path.startswith(mount["mountPath"].rstrip("/") + "/"):
                source = volumes[mount["name"]].get("secret")
                assert source is not None, f"{path} is on volume {mount['name']}, not a secret"
                return mount, source
    raise AssertionError(f"{path} is on no mounted volume")


def check_secret(docs: list[Doc]) -> None:
    assert all(d["kind"] != "Secret" for d in docs), (
        "the Secret is created by kubectl, never written in the manifest"
    )
    text = "\n".join(s for d in docs for s in walk_strings(d))
    assert not re.search(r"[0-9a-fA-F]{32,}", text), "a hex string that could be a secret"
    for obj in docs:
        if obj["kind"] == "Service":
            continue
        for c in containers(obj):
            env = env_of(c)
            assert not {"FLODL_SECRET_STDIN"} & env.keys()
            if "FLODL_SECRET" in env:
                entry = env["FLODL_SECRET"]
                assert "value" not in entry, "FLODL_SECRET must come from a secretKeyRef"
                ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
                assert ref == {"name": SECRET_NAME, "key": "secret"}, ref
            files = [e["value"] for n, e in env.items() if n == "FLODL_SECRET_FILE"]
            argv = [*c["command"], *c.get("args", [])]
            if argv[:2] == ["flodl", "coord"]:
                files.append(option(argv, "--secret-file"))
            assert "FLODL_SECRET" in env or files, f"{c['name']} gets no secret"
            for path in files:
                mount, source = secret_volume_of(obj, path)
                assert mount.get("readOnly") is True
                assert source["secretName"] == SECRET_NAME
                key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
                items = source.get("items")
                modes = [source.get("defaultMode")]
                if items is not None:
                    (item,) = [i for i in items if i["path"] == key]
                    modes = [item.get("mode", source.get("defaultMode"))]
                else:
                    assert key == "secret", f"{path}: the Secret's key is 'secret'"
                # the kubelet's default is 0644, which flodl coord refuses
                assert modes[0] is not None, "set defaultMode: the default 0644 is refused"
                assert modes[0] & 0o077 == 0, f"mode {oct(modes[0])} is group/other-readable"


def check_coord_owns_its_secret(docs: list[Doc]) -> None:
    """The kubelet writes secret files as root:root; fsGroup adds 0440 to them."""
    spec = pod_spec(one(docs, "Deployment"))
    pod_ctx = spec.get("securityContext", {})
    assert "fsGroup" not in pod_ctx, "fsGroup makes the secret file 0440: flodl coord refuses it"
    (coord,) = containers(one(docs, "Deployment"))
    uid = coord.get("securityContext", {}).get("runAsUser", pod_ctx.get("runAsUser"))
    assert uid == 0, "the secret file is root's (0400): the coordinator must run as uid 0"


def check_commands(docs: list[Doc]) -> None:
    workdir = dockerfile_workdir()
    copied = dockerfile_copies()
    coord = coord_subparser()
    known = {s for a in coord._actions for s in a.option_strings}
    for obj in docs:
        if obj["kind"] == "Service":
            continue
        for c in containers(obj):
            argv = [*c["command"], *c.get("args", [])]
            assert c.get("workingDir") == workdir, f"{c['name']}: workingDir is not {workdir}"
            if argv[0] == "flodl":
                assert argv[1] == "coord", argv
                for arg in argv[2:]:
                    if arg.startswith("--"):
                        assert arg.split("=")[0] in known, f"flodl coord has no {arg}"
            else:
                assert argv[0] in ("python", "python3"), f"{c['name']} runs {argv[0]}"
                script = argv[1]
                assert not script.startswith("-"), f"{c['name']} runs no script: {argv}"
                assert (REPO / script).is_file(), f"{script} is not in the repository"
                assert any(script == p or script.startswith(p + "/") for p in copied), (
                    f"the Dockerfile does not copy {script}"
                )
                source = (REPO / script).read_text()
                for arg in argv[2:]:
                    if arg.startswith("--"):
                        assert f'"{arg}"' in source, f"{script} takes no {arg}"


CHECKS: list[Callable[[list[Doc]], None]] = [
    check_kinds,
    check_world_size,
    check_restarts,
    check_address,
    check_run_id,
    check_secret,
    check_coord_owns_its_secret,
    check_commands,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_manifest(check: Callable[[list[Doc]], None]) -> None:
    check(load())


def test_the_secret_volume_mode_is_read_as_octal() -> None:
    """``defaultMode: 0400`` is YAML 1.1 octal (256), as kubectl reads it, not 400."""
    (volume,) = pod_spec(one(load(), "Deployment"))["volumes"]
    assert volume["secret"]["defaultMode"] == 0o400


# -------------------------------------------------------------------------------------------------
# every check catches its breakage
# -------------------------------------------------------------------------------------------------


def _set_argv(name: str, value: str) -> Callable[[list[Doc]], None]:
    def edit(docs: list[Doc]) -> None:
        (c,) = containers(one(docs, "Deployment"))
        argv = c["command"]
        argv[argv.index(name) + 1] = value

    return edit


def _drop_argv(name: str) -> Callable[[list[Doc]], None]:
    def edit(docs: list[Doc]) -> None:
        (c,) = containers(one(docs, "Deployment"))
        i = c["command"].index(name)
        del c["command"][i : i + 2]

    return edit


def _drop_service_port(name: str) -> Callable[[list[Doc]], None]:
    def edit(docs: list[Doc]) -> None:
        spec = one(docs, "Service")["spec"]
        spec["ports"] = [p for p in spec["ports"] if p["name"] != name]

    return edit


def _renumber_service_port(name: str) -> Callable[[list[Doc]], None]:
    def edit(docs: list[Doc]) -> None:
        (entry,) = [p for p in one(docs, "Service")["spec"]["ports"] if p["name"] == name]
        entry["port"] += 100

    return edit


def _set_rank_env(name: str, entry: Doc | None) -> Callable[[list[Doc]], None]:
    def edit(docs: list[Doc]) -> None:
        (c,) = one(docs, "Job")["spec"]["template"]["spec"]["containers"]
        c["env"] = [e for e in c["env"] if e["name"] != name]
        if entry is not None:
            c["env"].append({"name": name, **entry})

    return edit


def _job(key: str, value: object) -> Callable[[list[Doc]], None]:
    def edit(docs: list[Doc]) -> None:
        one(docs, "Job")["spec"][key] = value

    return edit


def _service(key: str, value: object) -> Callable[[list[Doc]], None]:
    def edit(docs: list[Doc]) -> None:
        one(docs, "Service")["spec"][key] = value

    return edit


def _volume(key: str, value: object) -> Callable[[list[Doc]], None]:
    def edit(docs: list[Doc]) -> None:
        (volume,) = pod_spec(one(docs, "Deployment"))["volumes"]
        if value is None:
            del volume["secret"][key]
        else:
            volume["secret"][key] = value

    return edit


def _coord_pod(key: str, value: object) -> Callable[[list[Doc]], None]:
    def edit(docs: list[Doc]) -> None:
        pod_spec(one(docs, "Deployment"))["securityContext"][key] = value

    return edit


def _rank_command(*argv: str) -> Callable[[list[Doc]], None]:
    def edit(docs: list[Doc]) -> None:
        (c,) = one(docs, "Job")["spec"]["template"]["spec"]["containers"]
        c["command"] = list(argv)

    return edit


def _add_secret_doc(docs: list[Doc]) -> None:
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": SECRET_NAME},
            "stringData": {"secret": "REPLACE-ME"},
        }
    )


def _drop_kind(kind: str) -> Callable[[list[Doc]], None]:
    def edit(docs: list[Doc]) -> None:
        docs[:] = [d for d in docs if d["kind"] != kind]

    return edit


def _unmount_secret(docs: list[Doc]) -> None:
    (c,) = containers(one(docs, "Deployment"))
    c["volumeMounts"][0]["mountPath"] = "/var/run/elsewhere"


BREAKAGES: dict[str, tuple[Callable[[list[Doc]], None], Callable[[list[Doc]], None]]] = {
    "no Deployment": (_drop_kind("Deployment"), check_kinds),
    "a Secret in the manifest (kinds)": (_add_secret_doc, check_kinds),
    "two coordinator replicas": (
        lambda d: one(d, "Deployment")["spec"].__setitem__("replicas", 2),
        check_kinds,
    ),
    "not Indexed": (_job("completionMode", "NonIndexed"), check_world_size),
    "completions != world size": (_job("completions", 4), check_world_size),
    "parallelism != world size": (_job("parallelism", 2), check_world_size),
    "coordinator --world-size 4": (_set_argv("--world-size", "4"), check_world_size),
    "FLODL_WORLD_SIZE 2": (_set_rank_env("FLODL_WORLD_SIZE", {"value": "2"}), check_world_size),
    "FLODL_RANK not from the index": (
        _set_rank_env("FLODL_RANK", {"value": "0"}),
        check_world_size,
    ),
    "no backoffLimitPerIndex": (_job("backoffLimitPerIndex", 0), check_restarts),
    "podReplacementPolicy TerminatingOrFailed": (
        _job("podReplacementPolicy", "TerminatingOrFailed"),
        check_restarts,
    ),
    "FLODL_COORD names another host": (
        _set_rank_env("FLODL_COORD", {"value": "coordinator:29400"}),
        check_address,
    ),
    "FLODL_COORD on a port the Service lacks": (
        _set_rank_env("FLODL_COORD", {"value": "flodl-coord:29500"}),
        check_address,
    ),
    "the coordinator on another port": (_set_argv("--port", "29401"), check_address),
    "the coordinator on loopback": (_set_argv("--host", "127.0.0.1"), check_address),
    "a random data port": (_set_argv("--data-port", "0"), check_address),
    "no --data-port": (_drop_argv("--data-port"), check_address),
    "the data port not exposed": (_drop_service_port("data"), check_address),
    "the data port exposed under another number": (_renumber_service_port("data"), check_address),
    "the data port sent to another container port": (
        _set_argv("--data-port", "29402"),
        check_address,
    ),
    "a selector that misses the coordinator": (
        _service("selector", {"app.kubernetes.io/name": "other"}),
        check_address,
    ),
    "a selector that takes the ranks too": (
        _service("selector", {"app.kubernetes.io/name": "flodl"}),
        check_address,
    ),
    "another run id": (_set_argv("--run-id", "another-run"), check_run_id),
    "FLODL_SECRET as a value": (
        _set_rank_env("FLODL_SECRET", {"value": "00" * 32}),
        check_secret,
    ),
    "FLODL_SECRET as a placeholder value": (
        _set_rank_env("FLODL_SECRET", {"value": "REPLACE-ME"}),
        check_secret,
    ),
    "FLODL_SECRET from another Secret": (
        _set_rank_env(
            "FLODL_SECRET", {"valueFrom": {"secretKeyRef": {"name": "other", "key": "secret"}}}
        ),
        check_secret,
    ),
    "a rank with no secret": (_set_rank_env("FLODL_SECRET", None), check_secret),
    "a Secret in the manifest": (_add_secret_doc, check_secret),
    "a hex secret in an annotation": (
        lambda d: one(d, "Job")["metadata"].__setitem__("annotations", {"x": "ab" * 16}),
        check_secret,
    ),
    "defaultMode unset (0644)": (_volume("defaultMode", None), check_secret),
    "defaultMode 0640": (_volume("defaultMode", 0o640), check_secret),
    "defaultMode 0644": (_volume("defaultMode", 0o644), check_secret),
    "the secret file not on the secret volume": (_unmount_secret, check_secret),
    "--secret-file names another key": (
        _set_argv("--secret-file", "/var/run/flodl/token"),
        check_secret,
    ),
    "fsGroup on the coordinator": (_coord_pod("fsGroup", 1000), check_coord_owns_its_secret),
    "a non-root coordinator": (_coord_pod("runAsUser", 1000), check_coord_owns_its_secret),
    "a script not in the repository": (
        _rank_command("python", "examples/no_such_script.py"),
        check_commands,
    ),
    "an option the script does not take": (
        _rank_command("python", "examples/join_coordinator.py", "--no-such-option", "1"),
        check_commands,
    ),
    "another interpreter": (_rank_command("bash", "-c", "true"), check_commands),
    "an option flodl coord does not have": (
        lambda d: containers(one(d, "Deployment"))[0]["command"].append("--no-such-option"),
        check_commands,
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_each_check_fails_on_a_broken_manifest(breakage: str) -> None:
    edit, check = BREAKAGES[breakage]
    docs = copy.deepcopy(load())
    check(docs)  # holds before the edit
    edit(docs)
    with pytest.raises(AssertionError):
        check(docs)
