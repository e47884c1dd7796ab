"""The ``fdl.cluster.yml`` reader (docs/design.md §2c): a strict YAML load that refuses duplicate
keys, then the ``cluster:`` body validated as a :class:`~flodl.launch.cluster.Cluster`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from flodl.errors import ConfigError
from flodl.launch.cluster import Cluster, kind_of

__all__ = ["load_cluster_yaml", "parse_cluster_yaml"]


class _StrictSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also refuses a key given twice in one mapping: plain
    ``safe_load`` keeps the last one, which would silently drop, say, a first ``workers:``."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _value in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # ``<<: *base`` merges may be overridden by explicit keys
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable: construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictSafeLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def _yaml_error(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or "malformed document"
        return f"invalid YAML{where}: {problem}"
    return f"invalid YAML: {exc}"


def parse_cluster_yaml(text: str, *, source: str = "<string>") -> Cluster:
    """Parse an ``fdl.cluster.yml`` document (docs/design.md §2c)::

        cluster:
          controller: {host: 10.0.0.1, port: 1337, path: /opt/run}
          workers:
            - host: node-a
              devices: [0, 1]            # or "all"; local_devices is accepted too
              nccl_socket_ifname: eth0
              ssh: {target: me@node-a, port: 22, identity_file: ~/.ssh/id}
          env: {OMP_NUM_THREADS: "4"}

    Other top-level keys (the rest of an fdl overlay) are ignored; everything under
    ``cluster:`` is checked, unknown keys included.

    Args:
        text: the YAML document.
        source: names the origin in error messages.

    Raises:
        ConfigError: invalid YAML (with line and column), a document that is not a mapping
            with a ``cluster:`` mapping, or any invalid field (named by its path).
    """
    try:
        document = yaml.load(text, Loader=_StrictSafeLoader)  # safe: a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: {_yaml_error(exc)}") from None
    if document is None:
        raise ConfigError(f"{source}: the document is empty; expected a top-level 'cluster:' key")
    if not isinstance(document, Mapping):
        raise ConfigError(
            f"{source}: the top level must be a mapping with a 'cluster:' key, got "
            f"{kind_of(document)}"
        )
    if "cluster" not in document:
        found = ", ".join(repr(key) for key in document) or "none"
        raise ConfigError(f"{source}: missing top-level 'cluster:' key (found {found})")
    body = document["cluster"]
    if not isinstance(body, Mapping):
        raise ConfigError(
            f"{source}: cluster must be a mapping with controller, workers and env, got "
            f"{kind_of(body)}"
        )
    return Cluster.from_mapping(body, source=source, root="cluster")


def load_cluster_yaml(path: str | Path) -> Cluster:
    """Read and parse an ``fdl.cluster.yml`` file (see :func:`parse_cluster_yaml`).

    Raises:
        ConfigError: the file cannot be read (naming the path and the OS error) or is invalid.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"cannot read cluster config {str(file)!r}: {reason}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read cluster config {str(file)!r}: not UTF-8 ({exc})") from None
    return parse_cluster_yaml(text, source=str(file))
