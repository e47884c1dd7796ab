"""A demo-size job with a record log, for the replay test: the demo's character model, 2 local
ranks, rank 1 slowed 3×, an eval every epoch. ``python replay_main.py MODE RECORD_DIR``."""

from __future__ import annotations

import sys

from flodl import ElCheConfig, Trainer
from flodl.demo.slowdown import slowed
from flodl.demo.task import demo_task

if __name__ == "__main__":
    mode, records = sys.argv[1], sys.argv[2]
    task = demo_task(samples=16_000, seed=0)
    step = slowed(task.train_step, {1: 3.0}, step_per_forward=task.step_per_forward)
    (
        Trainer.builder(task.model_factory, task.optim_factory, step)
        .dataset(task.train)
        .batch_size(128)
        .num_epochs(2)
        .seed(0)
        .elche(ElCheConfig.preset(mode))
        .local_ranks(2)
        .eval_dataset(task.held_out)
        .eval_fn(task.eval_fn)
        .progress(False)
        .record_log(records)
        .run()
        .join()
    )
