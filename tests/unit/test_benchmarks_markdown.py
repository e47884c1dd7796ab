"""The docs sections that bench_recovery, bench_convergence, bench_overhead, bench_elastic and
bench_gpu render from their JSON: each result file is assembled by the script's own ``report`` from
synthetic per-trial rows, written and read back as JSON, and its section must show the figures
and the met / not-met verdicts those rows give. Nothing here trains, spawns or times anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

BENCHMARK = {"bench_convergence": "convergence", "bench_overhead": "overhead"}
"""The ``benchmark`` key a script writes, where it is not the script's name."""


def header(bench: Any, script: str, *packages: str) -> dict[str, Any]:
    """The header keys a run of ``script --trials 1`` writes (real date, load, machine and
    versions of ``packages``)."""
    stamp = bench("_common").RunStamp(script, ["--trials", "1"])
    return dict(stamp.header(BENCHMARK.get(script, script), *packages))


def via_json(
    bench: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    script: str,
    data: dict[str, Any],
) -> str:
    """The section ``<script> --markdown FILE`` prints for ``data`` written as its result file
    (checked to be what the script's ``markdown`` renders from the file read back)."""
    path = bench("_common").write_json(tmp_path / f"{script}.json", data)
    mod = bench(script)
    assert mod.main(["--markdown", str(path)]) == 0
    text: str = capsys.readouterr().out
    assert text.strip() == mod.markdown(json.loads(path.read_text())).strip()
    return text


def test_run_stamp_header_and_helpers(bench: Any) -> None:
    c = bench("_common")
    head = c.RunStamp("bench_x", ["--modes", "a b", "--quick"]).header("x", "pytest", "no-such-pkg")
    assert head["command"] == "python benchmarks/bench_x.py --modes 'a b' --quick"
    assert head["date"].endswith(" UTC") and head["took_s"] >= 0
    assert {"uptime_before", "uptime_after", "machine"} <= set(head)
    assert head["versions"]["pytest"] and head["versions"]["no-such-pkg"] is None
    assert c.span_text([None, 2.0, 1.234]) == "1.23–2.00"
    assert c.span_text([3.0, 3.001]) == "3.00" and c.span_text([None]) == "-"
    assert [c.met_text(v) for v in (True, False, None)] == ["**met**", "**not met**", "n/a"]
    assert c.markdown_table(["a", "b"], [["1", "2"]]) == ["| a | b |", "|---|---|", "| 1 | 2 |"]


# ---------------------------------------------------------------------------------------------
# bench_recovery
# ---------------------------------------------------------------------------------------------


def recovery_trials(kill: list[tuple[float, float | None]]) -> list[dict[str, Any]]:
    """flodl SIGKILL trials (detect, resume s) plus one SIGSTOP trial, one torchft trial on the
    binary lighthouse and a torchft one that could not run."""
    flodl = {"system": "flodl", "ok": True}
    trials = [
        flodl | {"path": "kill", "timeout_s": 30.0, "t_detect_s": d, "t_resume_s": r}
        for d, r in kill
    ]
    trials.append(
        flodl | {"path": "stop", "timeout_s": 3.0, "t_detect_s": 2.995, "t_resume_s": 3.003}
    )
    ft = {"system": "torchft", "path": "kill", "timeout_s": 5.0}
    trials.append(ft | {"variant": "cli", "ok": True, "t_detect_s": 5.038, "t_resume_s": 5.049})
    trials.append({**ft, "variant": "py", "ok": False, "error": "torchft not\nimportable"})
    return trials


def test_recovery_markdown_met(
    bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = bench("bench_recovery")
    args = r.parse_args([])
    trials = recovery_trials([(0.044, 0.080), (0.049, 0.082), (0.080, 0.233)])
    data = r.report(args, trials, None, header(bench, "bench_recovery", "torch", "torchft"))
    assert data["config"]["mode"] == "cpu_cadence" and data["targets"]["detect_kill_s"] == 0.2
    text = via_json(bench, tmp_path, capsys, "bench_recovery", data)
    assert text.startswith("## Recovery (`python benchmarks/bench_recovery.py --trials 1`)")
    assert (
        "| flodl | SIGKILL (child-exit report) | 49 (44–80) | 82 (80–233) "
        "| detect < 200 ms, resume < 2000 ms: **met** |" in text
    )
    assert (
        "| flodl | SIGSTOP, heartbeat timeout 3 s | 2995 | 3003 | detect − timeout < 1000 ms, "
        "resume − detect < 2000 ms: **met** (detect − timeout -5 ms; resume − detect 8 ms) |"
    ) in text
    assert "| torchft (torchft_lighthouse, join 60 s) | SIGKILL | 5038 | 5049 | reference |" in text
    assert "| torchft (LighthouseServer(), join 0.1 s) | SIGKILL | - | - | reference |" in text
    assert "detection came 5 ms before the nominal 3 s heartbeat timeout" in text
    assert "1 of 1 trial(s) failed; the first: torchft not importable" in text
    assert "48,000 windows, batch 64, `cpu_cadence`" in text and "3/3" in text


@pytest.mark.parametrize(
    "kill",
    [
        [(0.044, 0.080), (0.250, 0.300)],  # a detection over 200 ms
        [(0.044, 0.080), (0.049, 2.5)],  # a resume over 2 s
        [(0.044, 0.080), (0.049, None)],  # a trial that never resumed
    ],
)
def test_recovery_markdown_not_met(
    bench: Any,
    kill: list[tuple[float, float | None]],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    r = bench("bench_recovery")
    data = r.report(r.parse_args([]), recovery_trials(kill), None, header(bench, "bench_recovery"))
    text = via_json(bench, tmp_path, capsys, "bench_recovery", data)
    assert "resume < 2000 ms: **not met** |" in text
    assert "resume − detect < 2000 ms: **met**" in text  # the SIGSTOP row is unaffected


# ---------------------------------------------------------------------------------------------
# bench_convergence
# ---------------------------------------------------------------------------------------------


def convergence_runs(accuracies: dict[str, list[float]]) -> list[dict[str, Any]]:
    """One run per seed per mode (solo at 1 rank, the others at 2), as ``run_one`` returns it."""
    return [
        {"mode": mode, "ranks": 1 if mode == "solo" else 2, "seed": seed, "accuracy": acc}
        | {"final_loss": 2.0, "wall_s": 10.0 + seed, "trivial_accuracy": 0.17}
        for mode, accs in accuracies.items()
        for seed, acc in enumerate(accs)
    ]


def convergence_data(bench: Any, accuracies: dict[str, list[float]]) -> dict[str, Any]:
    c = bench("bench_convergence")
    modes = [m for m in accuracies if m != "solo"]
    settings = {"seeds": 2, "epochs": 2, "samples": 32_000, "batch_size": c.BATCH_SIZE}
    settings |= {"modes": modes, "ranks": [2]}
    runs = convergence_runs(accuracies)
    data: dict[str, Any] = c.report(settings, runs, 42.0, header(bench, "bench_convergence"))
    return data


def test_convergence_markdown_verdicts(
    bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = convergence_data(
        bench,
        {
            "solo": [0.50, 0.52],
            "cpu_cadence": [0.508, 0.510],  # −0.10 pp: within 0.5 pp
            "cpu_sync": [0.500, 0.504],  # −0.80 pp but 1.6 % relative: within 2 %
            "nccl_sync": [0.47, 0.48],  # −3.50 pp, 6.9 %
        },
    )
    assert [m["target_met"] for m in data["summary"]] == [None, True, True, False]
    text = via_json(bench, tmp_path, capsys, "bench_convergence", data)
    assert text.startswith("## Convergence parity (`python benchmarks/bench_convergence.py")
    assert "| solo | 1 | 51.00 ± 1.41 | – | – | – |" in text
    assert "| cpu_cadence | 2 | 50.90 ± 0.14 | −0.10 | +0.2 % | **met** |" in text
    assert "| cpu_sync | 2 | 50.20 ± 0.28 | −0.80 | +1.6 % | **met** (relative loss) |" in text
    assert "| nccl_sync | 2 | 47.50 ± 0.71 | −3.50 | +6.9 % | **not met** |" in text
    assert "2 of 3 (mode, ranks) within the bound: the target is **not met**" in text
    assert "Furthest from solo: nccl_sync at 2 ranks, −3.50 pp." in text
    assert "2 epoch(s) of 32,000 windows, batch 128" in text and "seeds 0–1" in text
    assert "scores 17.0 %" in text and "about 500 optimizer steps" in text


def test_convergence_markdown_all_met(
    bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = convergence_data(bench, {"solo": [0.50, 0.52], "cpu_async": [0.52, 0.53]})
    text = via_json(bench, tmp_path, capsys, "bench_convergence", data)
    assert "| cpu_async | 2 | 52.50 ± 0.71 | +1.50 | −2.9 % | **met** |" in text
    assert "1 of 1 (mode, ranks) within the bound: the target is **met**" in text


# ---------------------------------------------------------------------------------------------
# bench_overhead
# ---------------------------------------------------------------------------------------------


def overhead_data(bench: Any, flodl_train_s: float) -> dict[str, Any]:
    o = bench("bench_overhead")
    settings = {"samples": 64_000, "epochs": 1, "batch_size": 128, "repeat": 2}
    settings["single_repeat"] = 2
    single = {"flodl": [1.20, 1.10], "torch": [1.18, 1.25]}
    multi = {
        "flodl": [{"train_s": flodl_train_s, "end_to_end_s": 8.15}, {"train_s": 9.0}],
        "ddp": [{"train_s": 1.36, "end_to_end_s": 7.18}, {"train_s": 1.5}],
    }
    for runs in multi.values():
        runs[1]["end_to_end_s"] = 9.9
    data: dict[str, Any] = o.report(
        settings, single, multi, (1.0, 1.0, 1.0), header(bench, "bench_overhead", "torch")
    )
    return data


def test_overhead_markdown_met(
    bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = overhead_data(bench, 1.45)
    assert data["two_ranks"]["met"] is True and data["two_ranks"]["steps_per_rank"] == 250
    text = via_json(bench, tmp_path, capsys, "bench_overhead", data)
    assert text.startswith("## Homogeneous overhead (`python benchmarks/bench_overhead.py")
    assert (
        "| world 1: the single-device tier vs a plain torch loop (1 thread, best of 2) "
        "| 1.10 s | 1.18 s | 0.93× | ≤ 1.05×: **met** |" in text
    )
    assert (
        "| 2 equal ranks: `nccl_sync` vs DDP on Gloo, training time (best of 2) "
        "| 1.45 s | 1.36 s | 1.07× | ≤ 1.10×: **met** |" in text
    )
    assert "| the same, end to end including process start | 8.15 s | 7.18 s | 1.14× | – |" in text
    assert "0.36 ms per step more than DDP's" in text
    assert "500 steps each" in text and "1 epoch(s) of 64,000 windows" in text


def test_overhead_markdown_not_met(
    bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = via_json(bench, tmp_path, capsys, "bench_overhead", overhead_data(bench, 1.60))
    assert "| 1.60 s | 1.36 s | 1.18× | ≤ 1.10×: **not met** |" in text
    assert "0.96 ms per step more" in text


# ---------------------------------------------------------------------------------------------
# bench_elastic
# ---------------------------------------------------------------------------------------------


def elastic_trial(mode: str, t_fold: float, target: float, **more: Any) -> dict[str, Any]:
    """A finished flodl trial as ``flodl_trial`` returns it (figures in s, throughputs in
    samples/s); ``met`` as ``analyse_flodl`` computes it."""
    row = {
        "system": "flodl",
        "mode": mode,
        "ok": True,
        "orphans": 0,
        "down_s": 3.5,
        "consensus_s": 0.05,
        "t_fold_s": t_fold,
        "window_s": target - 2.0,
        "target_s": target,
        "met": t_fold < target,
        "consensus_to_next_epoch_s": 1.5,
        "epoch_s": 1.9,
        "throughput_before": 50_000.0,
        "throughput_after": 45_000.0,
        "throughput_ratio": 0.9,
        "wall_throughput_ratio": 1.1,
        "syncs_while_down": 144,
        "start_to_imports_s": 1.9,
        "start_to_task_s": 2.1,
        "start_to_hello_s": 3.5,
        "start_to_consensus_s": 3.6,
        "start_to_fold_s": 3.7,
    }
    return row | more


def elastic_data(bench: Any, cadence_fold: float) -> dict[str, Any]:
    e = bench("bench_elastic")
    args = e.parse_args(["--modes", "cpu_sync,cpu_cadence", "--lighthouses", "cli,py"])
    trials = [
        elastic_trial("cpu_sync", 0.12, 2.02),
        elastic_trial("cpu_sync", 0.15, 2.04, throughput_ratio=0.8, syncs_while_down=146),
        elastic_trial("cpu_cadence", cadence_fold, 2.15, start_to_consensus_s=5.1),
        {
            "system": "flodl",
            "mode": "cpu_cadence",
            "ok": False,
            "error": "no\nrejoin",
            "orphans": 1,
        },
        {"system": "torchft", "variant": "cli", "ok": False, "error": "lighthouse failed"},
        {
            "system": "torchft",
            "variant": "py",
            "ok": True,
            "orphans": 0,
            "start_to_ready_s": 2.9,
            "start_to_first_quorum_s": 2.95,
            "start_to_heal_s": 2.96,
            "start_to_consensus_s": 2.98,
            "start_to_fold_s": 3.03,
            "syncs_while_down": 52,
        },
    ]
    data: dict[str, Any] = e.report(args, trials, None, header(bench, "bench_elastic"))
    return data


def test_elastic_markdown_met(
    bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = elastic_data(bench, 0.64)
    text = via_json(bench, tmp_path, capsys, "bench_elastic", data)
    assert text.startswith("## Rejoin after a respawn (`python benchmarks/bench_elastic.py")
    assert (
        "| cpu_sync | 2/2 | 3.50 (3.50–3.50) | 0.05 (0.05–0.05) | 0.14 (0.12–0.15) "
        "| 0.03 (0.02–0.04) | 2.03 (2.02–2.04) | **met** | epoch partitions |"
    ) in text
    assert "| cpu_cadence | 1/2 | 3.50 | 0.05 | 0.64 | 0.15 | 2.15 | **met** | chunks |" in text
    assert "1 orphan(s) killed" in text
    text_met = "**t_fold < 2 s + one window**: **met**: 2 of 2 modes had every finished trial"
    assert text_met in text and "(not:" not in text
    assert "cpu_sync 0.15 s (target 2.04 s); cpu_cadence 0.64 s (target 2.15 s)" in text
    assert (
        "medians 0.85–0.90 (`thr`) and 1.10 (`wall`) over the modes; single trials 0.80–1.10"
        in (text)
    )
    assert "task built 0.20 s later, the hello 1.40 s after that" in text
    assert "Survivor reduces while it was down: 144–145." in text
    assert "Epoch-partition modes (cpu_sync): consensus → next epoch boundary 1.50 s" in text
    assert (
        "| torchft (LighthouseServer(), join 0.1 s) | 1/1 | - | - | 2.90 | 2.95 | 2.98 | 3.03 "
        "| 52 |  |"
    ) in text
    assert (
        "torchft (LighthouseServer(), join 0.1 s) 2.98 s, flodl 3.60–5.10 s (median per mode); "
        "flodl had it first in 0 of 2 modes"
    ) in text
    assert "- cpu_cadence: 1 of 2 trial(s) failed; the first: no rejoin" in text
    assert "- torchft (torchft_lighthouse, join 60 s): 1 of 1 trial(s) failed" in text
    assert (
        "48,000 windows, batch 64, 1 thread per rank" in text and "after 5 reduces and 4 s" in text
    )


def test_elastic_markdown_not_met(
    bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = via_json(bench, tmp_path, capsys, "bench_elastic", elastic_data(bench, 2.5))
    assert "| cpu_cadence | 1/2 | 3.50 | 0.05 | 2.50 | 0.15 | 2.15 | **not met** | chunks |" in text
    assert (
        "**t_fold < 2 s + one window**: **not met**: 1 of 2 modes had every finished trial "
        "within its own target (not: cpu_cadence)"
    ) in text
    assert "cpu_cadence 2.50 s (target 2.15 s)" in text


# ---------------------------------------------------------------------------------------------
# bench_gpu
# ---------------------------------------------------------------------------------------------


def gpu_run(devices: list[str], ms: list[float], samples: list[int], **kw: Any) -> dict[str, Any]:
    total = sum(samples)
    return {
        "devices": devices,
        "parameters": 2_201_729,
        "ms_per_batch": ms,
        "samples": samples,
        "share": [s / total for s in samples],
        "train_s": kw.get("train_s", 1.0),
        "wall_s": 12.0,
        "span_s": 6.0,
        "loss": 2.3,
        "cycles": kw.get("cycles", 0),
        "averaging_ms_median": kw.get("averaging"),
        "averaging_ms_max": kw.get("averaging_max"),
    }


def test_bench_gpu_section_shows_each_run_and_the_mixed_runs_balance(
    bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = header(bench, "bench_gpu", "torch")
    data |= {"gpus": 1, "gpu_name": "NVIDIA H200", "samples": 6400, "not_run": {"nccl": "2 GPUs"}}
    data["runs"] = {
        "solo-cpu": gpu_run(["cpu"], [6.0], [6400], train_s=0.6),
        "solo-gpu": gpu_run(["cuda:0"], [2.0], [6400], train_s=0.2),
        "mixed": gpu_run(
            ["cuda:0", "cpu"],
            [2.0, 6.0],
            [4800, 1600],
            train_s=0.3,
            cycles=4,
            averaging=15.0,
            averaging_max=200.0,
        ),
        "shared-big": {"error": "exit 1: CUDA out of memory"},
    }
    text = via_json(bench, tmp_path, capsys, "bench_gpu", data)
    assert "## The GPU path (`python benchmarks/bench_gpu.py --trials 1`)" in text
    assert "1 × NVIDIA H200" in text
    assert (
        "| mixed | cuda:0 + cpu | 2.2 M | 2.00 / 6.00 | 0.75 / 0.25 | 0.30 | 12.0 | 4 | 15.0 |"
        in text
    )
    assert "| shared-big | failed | exit 1: CUDA out of memory |" in text
    assert "takes 3.0× less time on the GPU" in text
    assert "trained 75% of the samples; its measured speed alone (2.00 against 6.00 ms" in text
    assert "would give it 75%" in text
    # 100 batches at 1/2 + 1/6 batch per ms: 150 ms; the run took 0.30 s
    assert "train the epoch in 0.15 s; the run took 0.30 s (0.50 of that bound" in text
    assert "1.50× the GPU alone's" in text
    assert "Not run: nccl (2 GPUs)." in text


def test_bench_gpu_section_without_cuda_says_nothing_was_measured(
    bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = header(bench, "bench_gpu", "torch") | {"gpus": 0, "samples": 6400, "runs": {}}
    data["not_run"] = {}
    text = via_json(bench, tmp_path, capsys, "bench_gpu", data)
    assert "No CUDA device was visible: nothing was measured." in text


# ---------------------------------------------------------------------------------------------
# bench_demo and the suite (python -m benchmarks)
# ---------------------------------------------------------------------------------------------


def demo_run(index: int, wall_s: float, speedup: float | None) -> dict[str, Any]:
    """A run row as bench_demo assembles it: exit status, wall time and the demo's --json."""
    if speedup is None:
        return {"run": index, "rc": 1, "wall_s": wall_s, "error": "the run failed: boom"}
    result = {
        "solo_accuracy": 0.57,
        "accuracy": 0.568,
        "lockstep_accuracy": 0.572,
        "solo_train_s": 7.9,
        "lockstep_train_s": 7.2 * speedup,
        "train_s": 7.2,
        "batch_share": [0.78, 0.22],
        "syncs": 32,
        "lockstep_syncs": 1500,
        "anchor": 80,
        "speedup": speedup,
    }
    summary = f"summary (held-out …)\n  syncs  -  1500  32\n  (run {index})\n\n  records  /tmp/x"
    return {"run": index, "rc": 0, "wall_s": wall_s, "result": result, "summary": summary}


def test_demo_markdown_shows_every_run_and_the_median_run_s_summary(
    bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = bench("bench_demo")
    runs = [demo_run(0, 44.0, 2.48), demo_run(1, 41.5, 2.31), demo_run(2, 47.2, 2.6)]
    data = header(bench, "bench_demo", "torch") | {"runs": runs, "verdict": mod.verdict(runs)}
    text = via_json(bench, tmp_path, capsys, "bench_demo", data)
    assert "| 1 | 41.5 | 7.9 | 16.6 | 7.2 | 2.31× | 57.0 % / 57.2 % / 56.8 % | 78 % · 22 %" in text
    assert "The summary the median run (run 0, 44.0 s) printed, without" in text
    assert "  (run 0)" in text and "  (run 2)" not in text
    assert "/tmp/x" not in text  # the run's temporary files are not shown
    assert "41.5–47.2 s over 3 run(s), **met**." in text


def test_demo_verdict_fails_on_a_slow_or_failed_run(bench: Any) -> None:
    mod = bench("bench_demo")
    assert mod.verdict([demo_run(0, 181.0, 2.0)])["met"] is False
    failed = [demo_run(0, 40.0, 2.0), demo_run(1, 12.0, None)]
    assert mod.verdict(failed)["met"] is False
    assert "failed: the run failed: boom" in "|".join(mod.table_rows(failed)[1])
    assert mod.median_run(failed)["run"] == 0  # the failed run is not shown as the summary
    assert mod.verdict([])["met"] is False


def suite_summary(scripts: list[dict[str, Any]], total_s: float) -> dict[str, Any]:
    """A ``summary.json`` as ``python -m benchmarks --quick`` writes it, with ``scripts``."""
    return {
        "command": "python -m benchmarks --quick",
        "date": "2026-12-04 21:40 UTC",
        "uptime_before": "load average: 0.1",
        "uptime_after": "load average: 1.9",
        "machine": {"cpus": 2, "python": "3.11.7"},
        "quick": True,
        "total_s": total_s,
        "scripts": scripts,
    }


def test_suite_markdown_lists_every_headline_with_its_verdict(
    bench: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    m = bench("benchmarks.__main__")
    verdict = {"target_s": 180.0, "max_wall_s": 44.0, "met": True}
    demo = {"runs": [demo_run(0, 44.0, 2.48)], "verdict": verdict}
    scripts = [
        {"name": "bench_demo", "status": "ok", "seconds": 45.2, "rows": m._demo(demo)},
        {"name": "bench_gpu", "status": "ok", "seconds": 3.0, "rows": [], "note": "no extractor"},
    ]
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(suite_summary(scripts, 48.2)))
    assert m.main(["--markdown", str(path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("## All of it (`python -m benchmarks --quick`)")
    assert "Run 2026-12-04 21:40 UTC (`date`), 48 s in all." in text
    assert (
        "| bench_demo | flodl demo: the whole command (slowest run) | 44.0 s | < 180 s "
        "| **met** | 45 |" in text
    )
    assert "|  | flodl demo: flodl vs lock-step DDP (training span) | 2.48× | – | – |  |" in text
    assert "| bench_gpu | ok | no extractor | | | 3 |" in text


def test_suite_markdown_escapes_cells_and_refuses_bad_files(
    bench: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    m = bench("benchmarks.__main__")
    failed = {"name": "bench_x", "status": "exit 1", "seconds": 3.0, "rows": []}
    failed["note"] = "Traceback | a | b"
    text = m.markdown(suite_summary([failed], 3.0))
    assert "| bench_x | exit 1 | Traceback \\| a \\| b | | | 3 |" in text
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"quick": False, "total_s": 1.0, "scripts": []}))
    assert m.main(["--markdown", str(old)]) == 2
    assert "has no 'machine'" in capsys.readouterr().err
    assert m.main(["--markdown", str(tmp_path / "absent.json")]) == 2
    assert "absent.json" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# bench_reform
# ---------------------------------------------------------------------------------------------


def test_reform_markdown_shows_each_size_and_the_median_run(
    bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = bench("bench_reform")

    def run(world: int, encode_ms: float, machine_ms: float) -> dict[str, Any]:
        return {
            "world": world,
            "event": "ChildExited",
            "members": world - 1,
            "new_session_frames": 1,
            "sends": 2 * (world - 1),
            "bytes": 180 * (world - 1),
            "new_session_bytes": 92,
            "machine_ms": machine_ms,
            "encode_ms": encode_ms,
            "encode_each_ms": 1.7 * encode_ms,
        }

    rows = [
        r.median_run([run(64, 0.31, 0.2), run(64, 0.29, 0.3), run(64, 0.35, 0.2)]),
        r.median_run([run(4096, 16.0, 11.0), run(4096, 15.5, 12.0), run(4096, 19.0, 10.5)]),
    ]
    assert rows[1]["encode_ms"] == 16.0 and rows[1]["encode_ms_runs"] == [15.5, 16.0, 19.0]
    gap = {"world": 4096, "members": 2048, "runs": 2048, "new_session_bytes": 10_137}
    gaps = [r.median_run([gap | {"bytes": 2048 * 10_137, "encode_ms": ms} for ms in (22.4, 21.0)])]
    data = header(bench, "bench_reform") | {
        "mode": "nccl_cadence",
        "kill_at_s": 0.25,
        "repeats": 3,
        "rows": rows,
        "gaps": gaps,
    }
    text = via_json(bench, tmp_path, capsys, "bench_reform", data)
    assert text.startswith("## Re-forming a collective session (`python benchmarks/bench_reform.py")
    assert "(nccl_cadence, equal speeds), rank W/2 killed at 0.25 s of virtual time" in text
    assert (
        "| 4,096 | 11.0 | 8,190 (4,095 new_session, 1 body) | 0.1 | 0.7 | 16.0 | 27.2 | 1.7× "
        "| 3.9 | 15.5 · 16.0 · 19.0 |" in text
    )
    assert "| 64 | 0.2 | 126 (63 new_session, 1 body) |" in text
    assert "a gap after every member (every other rank" in text
    assert "| 4,096 | 2,048 | 2,048 | 9.9 | 19.8 | 21.0 | 10.3 | 21.0 · 22.4 |" in text
    for bad in (["--sizes", "2,64"], ["--sizes", "x"]):
        with pytest.raises(SystemExit):
            r.main(bad)
