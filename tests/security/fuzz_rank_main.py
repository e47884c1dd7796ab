"""A rank process for the live fuzz test: a small MLP on a seeded synthetic classification set.

Run as ``python fuzz_rank_main.py`` with the job in ``FLODL_TEST_RANK`` (JSON) and the run
secret (hex) in ``FLODL_SECRET``. While the file ``job["hold"]`` exists every optimizer step
sleeps ``job["pace_s"]`` (so the run is still training while the attack lasts; timing never
changes which samples are trained). Writes ``{"params", "buffers", "save_reason"}`` to
``job["out"]`` and exits 0.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

# torch's CPU wheel warns once that numpy is absent; flodl never needs numpy
warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flodl.config import ElCheConfig  # noqa: E402
from flodl.data import TensorBatchDataset  # noqa: E402
from flodl.rank.runtime import RankSpec, run_rank  # noqa: E402
from flodl.rank.step import TrainJob  # noqa: E402

FEATURES, CLASSES = 16, 4


def make_data(n: int) -> TensorBatchDataset:
    g = torch.Generator().manual_seed(0)
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
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


def train_step(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def main() -> int:
    job = json.loads(os.environ["FLODL_TEST_RANK"])
    hold = Path(job["hold"])
    pace_s = float(job["pace_s"])

    def hook(rank: int, step: int) -> None:
        if hold.exists():
            time.sleep(pace_s)

    spec = RankSpec(
        coord_host="127.0.0.1",
        coord_port=int(job["port"]),
        secret=bytes.fromhex(os.environ["FLODL_SECRET"]),
        run_id=job["run_id"],
        rank=int(job["rank"]),
        world_size=int(job["world_size"]),
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
        step_hook=hook,
    )
    state = run_rank(spec, train)
    torch.save(
        {"params": state.params, "buffers": state.buffers, "save_reason": state.save_reason},
        job["out"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
