"""bench_gpu: what the GPU path costs, on the GPU at hand (docs/benchmarks.md, "The GPU path").

Every run is one ``Trainer`` call on the demo task (``flodl/demo/task.py``), in a subprocess
whose launcher re-executes this script per rank (``--job SPEC``):

* ``solo-cpu`` / ``solo-gpu``: the single-device tier on the CPU (all its cores) and on
  ``cuda:0``: ms per batch as flodl measures it (compute only), and the epoch's training span
  (the epoch's ``epoch_ms``: process start-up, CUDA's initialisation and the data set's
  construction are in the wall time, not in it);
* ``shared-f32`` / ``shared-bf16``: two ranks sharing ``cuda:0`` in ``cpu_cadence``: the
  averaging time per cycle (the window records' ``averaging_ms``: from the slowest rank's last
  batch to the cycle's end, so the GPU → host copy, the upload, the fold and the copy back);
* ``shared-big``: the same with a 34 M-parameter model (136 MiB in f32), where averaging
  costs most;
* ``mixed``: a GPU rank and a CPU rank (half the CPU's cores, as the launcher splits a host's
  cores among its CPU ranks' workers) in ``cpu_cadence``:
  each rank's share of the samples, against the share its measured speed alone would give.

The NCCL modes need a GPU per rank and an eviction on NCCL three GPUs: the JSON says which of
those this machine could run (``gpus``), and the runs that need more are left out, with that
reason. Without CUDA the script writes a JSON that says so and exits 0.

    python benchmarks/bench_gpu.py [--samples 24000] [--json PATH]
    python benchmarks/bench_gpu.py --markdown [PATH]   # the docs section, from the JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    RESULTS_DIR,
    RunStamp,
    add_markdown_option,
    ensure_repo_on_path,
    markdown_table,
    print_table,
    read_records,
    section_head,
    write_json,
)

ensure_repo_on_path()

DEFAULT_JSON = RESULTS_DIR / "bench_gpu.json"
REALISTIC = {"context": 32, "embed": 32, "hidden": 1024}  # 2.2 M parameters
BIG = {"context": 64, "embed": 64, "hidden": 4096}  # 34 M parameters
RUNS: dict[str, dict[str, Any]] = {
    "solo-cpu": {"devices": None, "device": "cpu", "task": REALISTIC},
    "solo-gpu": {"devices": None, "device": "cuda:0", "task": REALISTIC},
    "shared-f32": {"devices": ["cuda:0", "cuda:0"], "task": REALISTIC},
    "shared-bf16": {"devices": ["cuda:0", "cuda:0"], "task": REALISTIC, "bf16": True},
    "shared-big": {"devices": ["cuda:0", "cuda:0"], "task": BIG},
    "mixed": {"devices": ["cuda:0", "cpu"], "task": REALISTIC},
}


def job(spec_path: str) -> None:
    """The body of ``--job SPEC``: launcher and ranks alike run this."""
    from flodl import ElCheConfig, Trainer
    from flodl.demo import demo_task

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    task = demo_task(samples=spec["samples"], seed=0, **spec["task"])
    elche = ElCheConfig.cpu_cadence()
    if spec.get("bf16"):
        elche = elche.model_copy(update={"bf16_wire": True})
    epochs: list[dict[str, Any]] = []
    builder = (
        Trainer.builder(task.model_factory, task.optim_factory, task.train_step)
        .dataset(task.train)
        .batch_size(64)
        .num_epochs(1)
        .elche(elche)
        .progress(False)
        .record_log(str(out / "records"))
        .metrics_fn(lambda m: epochs.append(m.model_dump()))
    )
    if spec["devices"]:
        builder = builder.local_devices(spec["devices"])
    else:
        builder = builder.device(spec["device"])
    t0 = time.perf_counter()
    state = builder.run().join()
    span_s = time.perf_counter() - t0
    model = task.model_factory("cpu")
    state.load_into(model)
    result = {"span_s": span_s, "loss": task.loss_fn(model, task.held_out), "epochs": epochs}
    result["parameters"] = task.parameters
    (out / "result.json").write_text(json.dumps(result))


def run(name: str, cfg: dict[str, Any], samples: int, base: Path) -> dict[str, Any]:
    out = base / name
    out.mkdir(parents=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({**cfg, "samples": samples, "out_dir": str(out)}))
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--job", str(spec)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    wall_s = time.perf_counter() - t0
    if done.returncode != 0 or not (out / "result.json").exists():
        return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    epoch = result.pop("epochs")[-1]
    samples_by_rank = epoch["per_rank_samples"]
    batches = [max(1, -(-s // 64)) for s in samples_by_rank]
    windows = [
        r["data"] for r in read_records(out / "records" / "root.log") if r["kind"] == "window"
    ]
    averaging = [float(w["averaging_ms"]) for w in windows if w.get("averaging_ms") is not None]
    return {
        **result,
        "wall_s": wall_s,
        "train_s": float(epoch["epoch_ms"]) / 1000.0,
        "devices": cfg["devices"] or [cfg["device"]],
        "samples": samples_by_rank,
        "share": [s / max(1, sum(samples_by_rank)) for s in samples_by_rank],
        "ms_per_batch": [
            ms / b for ms, b in zip(epoch["per_rank_compute_only_ms"], batches, strict=True)
        ],
        "cycles": len(windows),
        "averaging_ms_median": statistics.median(averaging) if averaging else None,
        "averaging_ms_max": max(averaging) if averaging else None,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    stamp = RunStamp("bench_gpu", args.argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    data: dict[str, Any] = {"gpus": gpus, "samples": args.samples, "runs": {}}
    if gpus:
        data["gpu_name"] = torch.cuda.get_device_name(0)
        with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
            for name, cfg in RUNS.items():
                data["runs"][name] = run(name, cfg, args.samples, Path(tmp))
                print(f"{name}: {data['runs'][name]}", flush=True)
    data["not_run"] = {
        "nccl modes": f"need a GPU per rank (2 or more); {gpus} visible",
        "eviction on NCCL": f"needs 3 GPUs (2 survivors); {gpus} visible",
    }
    return {**stamp.header("bench_gpu", "torch", "nvidia-ml-py"), **data}


def _cell(value: Any, fmt: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return " / ".join(_cell(v, fmt) for v in value)
    return format(value, fmt)


def rows(data: dict[str, Any]) -> list[list[str]]:
    out = []
    for name, r in data["runs"].items():
        if "error" in r:
            out.append([name, "failed", r["error"][:80], "", "", "", "", "", ""])
            continue
        out.append(
            [
                name,
                " + ".join(r["devices"]),
                f"{r['parameters'] / 1e6:.1f} M",
                _cell(r["ms_per_batch"]),
                _cell(r["share"]),
                f"{r['train_s']:.2f}",
                f"{r['wall_s']:.1f}",
                f"{r['cycles']}",
                _cell(r["averaging_ms_median"], ".1f"),
            ]
        )
    return out


HEADERS = [
    "run",
    "devices",
    "model",
    "ms/batch per rank",
    "sample share",
    "training s",
    "wall s",
    "cycles",
    "averaging ms/cycle (median)",
]


def markdown(data: dict[str, Any]) -> str:
    detail = f"{data['gpus']} × {data.get('gpu_name', 'no GPU')}"
    lines = section_head("The GPU path", data, detail)
    lines.append("")
    if not data["gpus"]:
        lines.append("No CUDA device was visible: nothing was measured.")
        return "\n".join(lines)
    lines += markdown_table(HEADERS, rows(data))
    lines.append("")
    runs = data["runs"]
    solo_cpu, solo_gpu, mixed = runs.get("solo-cpu"), runs.get("solo-gpu"), runs.get("mixed")
    if solo_cpu and solo_gpu and "error" not in solo_cpu and "error" not in solo_gpu:
        ratio = solo_cpu["ms_per_batch"][0] / solo_gpu["ms_per_batch"][0]
        lines.append(
            f"One batch of the 2.2 M-parameter model takes {ratio:.1f}× less time on the GPU "
            "than on all the CPU's cores."
        )
    if mixed and "error" not in mixed:
        gpu_ms, cpu_ms = mixed["ms_per_batch"]
        lines.append(
            f"With a CPU rank beside the GPU one, the GPU rank trained {mixed['share'][0]:.0%} "
            f"of the samples; its measured speed alone ({gpu_ms:.2f} against {cpu_ms:.2f} ms "
            f"per batch) would give it {cpu_ms / (gpu_ms + cpu_ms):.0%}."
        )
        batches = sum(mixed["samples"]) / 64
        bound_s = batches / (1.0 / gpu_ms + 1.0 / cpu_ms) / 1000.0
        ratio = bound_s / mixed["train_s"]
        lines.append(
            f"A perfect balance with free averaging at those speeds would train the epoch in "
            f"{bound_s:.2f} s; the run took {mixed['train_s']:.2f} s ({ratio:.2f} of that bound; "
            f"its {mixed['cycles']} averaging cycles took {mixed['averaging_ms_median']:.0f} ms "
            f"at the median and {mixed['averaging_ms_max']:.0f} ms at the most)"
            + (
                f", {mixed['train_s'] / solo_gpu['train_s']:.2f}× the GPU alone's."
                if solo_gpu and "error" not in solo_gpu
                else "."
            )
        )
    for what, why in data["not_run"].items():
        lines.append(f"Not run: {what} ({why}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=24_000)
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    parser.add_argument("--job", help=argparse.SUPPRESS)
    add_markdown_option(parser, DEFAULT_JSON)
    args = parser.parse_args(raw)
    args.argv = raw
    if args.job is not None:
        job(args.job)
        return 0
    if args.markdown is not None:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    data = measure(args)
    write_json(args.json, data)
    if data["gpus"]:
        print_table("bench_gpu", HEADERS, rows(data))
    else:
        print("bench_gpu: no CUDA device visible; nothing measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
