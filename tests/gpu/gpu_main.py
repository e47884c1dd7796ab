"""The user script of the GPU tests: ``python gpu_main.py --out RESULT.json [options]``.

One ``Trainer`` call, placed by the options: ``--devices cuda:0,cpu`` (local ranks, one per
entry), else ``--device D`` (``auto`` by default: one device in process, or one rank per GPU
when several are visible). The same script is a tier-4 rank when ``FLODL_RANK`` is set. The
launcher (or the one process) writes what the run did to ``--out``:

``{"world", "losses" (per epoch), "samples" (per rank, summed over epochs), "on_cuda" (per rank:
the share of its batches that were on a CUDA device), "params_device", "first_epoch"}``.

``--cpu-slow-ms`` sleeps in every step of a CPU rank (a weak rank beside a GPU one);
``--kill-rank R --kill-step S`` SIGKILLs rank R at its step S (first incarnation only).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

from flodl import ElCheConfig, EpochMetrics, TensorBatchDataset, Trainer, record_scalar


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", help="local ranks, one per device (comma-separated)")
    p.add_argument("--device", default="auto")
    p.add_argument("--mode", default="cpu_cadence")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--bf16", action="store_true", help="bf16 wire (CPU averaging modes)")
    p.add_argument("--save", help="bundle stem (save_path, a bundle after every epoch)")
    p.add_argument("--resume", help="bundle stem (resume_from)")
    p.add_argument("--records", help="record log directory")
    p.add_argument("--cpu-slow-ms", type=float, default=0.0)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=0)
    args = p.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 64, generator=g)
    y = (x @ torch.randn(64, 8, generator=g)).argmax(dim=1)
    me = int(os.environ.get("FLODL_RANK", "-1"))
    first = os.environ.get("FLODL_RESTART_COUNT", "0") == "0"
    steps = [0]

    def train_step(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        steps[0] += 1
        if me == args.kill_rank and steps[0] == args.kill_step and first:
            os.kill(os.getpid(), signal.SIGKILL)
        on_cuda = batch[0].is_cuda
        if args.cpu_slow_ms and not on_cuda:
            time.sleep(args.cpu_slow_ms / 1000.0)
        record_scalar("on_cuda", 1.0 if on_cuda else 0.0)
        return F.cross_entropy(model(batch[0]), batch[1])

    def model_factory(device: torch.device) -> torch.nn.Module:
        net = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
        )
        return net.to(device)

    elche = ElCheConfig.preset(args.mode)
    if args.bf16:
        elche = elche.model_copy(update={"bf16_wire": True})
    builder = (
        Trainer.builder(
            model_factory,
            lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
            train_step,
        )
        .dataset(TensorBatchDataset(x, y))
        .batch_size(64)
        .num_epochs(args.epochs)
        .elche(elche)
        .device(args.device)
        .progress(False)
    )
    if args.devices:
        builder = builder.local_devices(args.devices.split(","))
    if args.save:
        builder = builder.save_path(args.save).checkpoint_every(1)
    if args.resume:
        builder = builder.resume_from(args.resume)
    if args.records:
        builder = builder.record_log(args.records)
    metrics: list[EpochMetrics] = []
    builder = builder.metrics_fn(metrics.append)
    handle = builder.run()
    state = handle.join()
    if os.environ.get("FLODL_RANK") is not None:
        return  # a tier-4 rank: the coordinator's side says what the run did
    world = handle.world_size
    samples = [sum(m.per_rank_samples[r] for m in metrics) for r in range(world)]
    on_cuda = []
    for r in range(world):
        seen = [m.per_rank[r]["on_cuda"] for m in metrics if "on_cuda" in m.per_rank[r]]
        on_cuda.append(sum(seen) / len(seen) if seen else None)
    result = {
        "world": world,
        "losses": [m.avg_loss for m in metrics],
        "first_epoch": metrics[0].epoch if metrics else None,
        "samples": samples,
        "on_cuda": on_cuda,
        "params_device": str(state.params[0].device),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
