"""A standalone coordinator process for the coordinator-loss test: prints its port, serves."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from flodl.config import CoordConfig, ElCheConfig, validated
from flodl.service.coordinator import CoordinatorService
from flodl.timeouts import Timeouts


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
    try:
        over = await service.wait()
    finally:
        await service.close()
    return 0 if over.ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
