"""A rank process for the integration tests: a small MLP on a seeded synthetic classification set.

Run as ``python rank_main.py`` with the job in the ``FLODL_TEST_RANK`` environment variable
(JSON) and the run secret (hex) in ``FLODL_SECRET``. Writes its final state to ``out`` (a
``torch.save`` of ``{"params", "buffers", "save_reason"}``) and exits 0; any failure exits 1
(after run_rank wrote the death record).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

# torch's CPU wheel warns once that numpy is absent; flodl never needs numpy
warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flodl.config import ElCheConfig  # noqa: E402
from flodl.data import TensorBatchDataset  # noqa: E402
from flodl.rank.runtime import RankSpec, run_rank  # noqa: E402
from flodl.rank.step import TrainJob  # noqa: E402
from flodl.timeouts import Timeouts  # noqa: E402

FEATURES, CLASSES = 16, 4


def make_data(n: int, seed: int = 0) -> TensorBatchDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    y = (x @ w + 0.1 * torch.randn(n, CLASSES, generator=g)).argmax(dim=1)
    return TensorBatchDataset(x, y)


def build_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    ).to(device)


def make_optim(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def train_step(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def main() -> int:
    job = json.loads(os.environ["FLODL_TEST_RANK"])
    secret = bytes.fromhex(os.environ["FLODL_SECRET"])
    slow_ms = float(job.get("slow_ms", 0.0))

    def hook(rank: int, step: int) -> None:
        if slow_ms > 0:
            time.sleep(slow_ms / 1000.0)

    spec = RankSpec(
        coord_host="127.0.0.1",
        coord_port=int(job["port"]),
        secret=secret,
        run_id=job.get("run_id", "run"),
        rank=int(job["rank"]),
        world_size=int(job["world_size"]),
        timeouts=Timeouts(float(job.get("heartbeat_timeout_s", 10.0))),
        stem=job["stem"],
        threads=1,
    )
    train = TrainJob(
        model_factory=build_model,
        optim_factory=make_optim,
        train_step=train_step,
        dataset=make_data(int(job["dataset_len"])),
        batch_size=int(job["batch_size"]),
        elche=ElCheConfig.preset(job["mode"]),
        step_hook=hook if slow_ms > 0 else None,
    )
    state = run_rank(spec, train)
    torch.save(
        {"params": state.params, "buffers": state.buffers, "save_reason": state.save_reason},
        job["out"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
