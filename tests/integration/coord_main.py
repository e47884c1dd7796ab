"""A standalone coordinator process for the coordinator-loss test: prints its port, serves.

Prints ``TRAINING`` once every rank has joined and an averaging cycle has finished (so every
rank is past its handshake and inside its training loop): the test kills the coordinator only
then, whatever the ranks' start-up (torch's import) costs.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from flodl.config import CoordConfig, ElCheConfig, validated
from flodl.service.coordinator import CoordinatorService
from flodl.timeouts import Timeouts


async def announce_training(service: CoordinatorService, world_size: int) -> None:
    machine = service.machine
    while True:
        if machine.sync_rounds >= 1 and len(machine.membership.alive()) == world_size:
            print("TRAINING", flush=True)
            return
        await asyncio.sleep(0.05)


async def main() -> int:
    job = json.loads(os.environ["FLODL_TEST_COORD"])
    cfg = validated(
        CoordConfig,
        world_size=int(job["world_size"]),
        dataset_len=int(job["dataset_len"]),
        batch_size=int(job["batch_size"]),
        num_epochs=int(job["epochs"]),
        elche=ElCheConfig.preset(job["mode"]),
        timeouts=Timeouts(10.0),
    )
    service = CoordinatorService(cfg, bytes.fromhex(os.environ["FLODL_SECRET"]))
    port = await service.start()
    print(port, flush=True)
    announcer = asyncio.create_task(announce_training(service, cfg.world_size))
    try:
        over = await service.wait()
    finally:
        announcer.cancel()
        await service.close()
    return 0 if over.ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
