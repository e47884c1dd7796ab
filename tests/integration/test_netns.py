"""Multi-host over a real network boundary: two network namespaces joined by a veth pair.

The coordinator runs in namespace A (bound to its veth address, not loopback), one rank in A
and one in B; they train to completion across the veth link. Skipped, with the reason, where
``ip netns`` is not permitted (it needs root / CAP_NET_ADMIN).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
JOIN = HERE / "join_main.py"
ADDR_A, ADDR_B = "10.213.77.1", "10.213.77.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    tag = secrets.token_hex(3)
    a, b = f"flodl-a-{tag}", f"flodl-b-{tag}"
    try:
        ip("netns", "add", a)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"network namespaces are not available here: {exc}")
    try:
        ip("netns", "add", b)
        ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        ip("link", "set", f"va{tag}", "netns", a)
        ip("link", "set", f"vb{tag}", "netns", b)
        for ns, dev, addr in ((a, f"va{tag}", ADDR_A), (b, f"vb{tag}", ADDR_B)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)


@pytest.mark.timeout(150)
def test_ranks_in_two_namespaces_train_across_a_veth_link(
    namespaces: tuple[str, str], tmp_path: Path
) -> None:
    ns_a, ns_b = namespaces
    secret_file = tmp_path / "secret"
    coord = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            ns_a,
            sys.executable,
            "-m",
            "flodl",
            "coord",
            "--host",
            ADDR_A,
            "--world-size",
            "2",
            "--dataset-len",
            "2048",
            "--epochs",
            "2",
            "--mode",
            "cpu_cadence",
            "--secret-file",
            str(secret_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        assert coord.stdout is not None
        coord.stdout.readline()
        line = coord.stdout.readline()
        address = line.split("FLODL_COORD=")[1].split()[0]
        run_id = line.split("FLODL_RUN_ID=")[1].split()[0]
        assert address.startswith(ADDR_A)
        for rank, ns in enumerate((ns_a, ns_b)):
            env = {
                **os.environ,
                "FLODL_COORD": address,
                "FLODL_SECRET_FILE": str(secret_file),
                "FLODL_RUN_ID": run_id,
                "FLODL_RANK": str(rank),
                "FLODL_WORLD_SIZE": "2",
            }
            ranks.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, str(JOIN), "--out", str(tmp_path)],
                    env=env,
                )
            )
        assert [p.wait(timeout=120) for p in ranks] == [0, 0]
        assert coord.wait(timeout=30) == 0
        a = torch.load(tmp_path / "rank0.pt", weights_only=True)["params"]
        b = torch.load(tmp_path / "rank1.pt", weights_only=True)["params"]
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b, strict=True))
    finally:
        procs: list[subprocess.Popen[bytes] | subprocess.Popen[str]] = [*ranks, coord]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if coord.stdout is not None:
            coord.stdout.close()
        if coord.stderr is not None:
            coord.stderr.close()
