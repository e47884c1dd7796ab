"""A rank of tier 4: started by torchrun, srun or ssh, it joins ``flodl coord``.

The same ``Trainer`` call as every other tier; the coordinator's address and secret come from
``FLODL_COORD`` / ``FLODL_SECRET_FILE``, the rank from the launcher (``RANK``/``WORLD_SIZE``,
``SLURM_PROCID``/``SLURM_NTASKS`` or ``FLODL_RANK``/``FLODL_WORLD_SIZE``). Here ``run()``
trains in the calling thread and returns, in every rank, once the rank is done (it raises what
ended the rank, such as ``CoordinatorLost``): ``handle.is_primary`` picks the one that reports.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from flodl import ElCheConfig, TensorBatchDataset, Trainer, TrainerConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="cpu_cadence")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    handle = Trainer.run(
        lambda device: torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        ).to(device),  # the rank's device: its local rank's GPU under torchrun, else the CPU
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        TrainerConfig(
            dataset=TensorBatchDataset(x, y),
            batch_size=32,
            num_epochs=args.epochs,
            elche=ElCheConfig.preset(args.mode),
        ),
    )
    state = handle.join()
    if handle.is_primary:
        print(f"trained {len(state.params)} parameter tensors with {handle.world_size} ranks")


if __name__ == "__main__":
    main()
