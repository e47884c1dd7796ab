"""Tensor frame throughput: encode and decode GB/s next to a plain torch copy of the same bytes.

Usage::

    python benchmarks/bench_tensor_wire.py [--mib 64] [--reps 5] [--json out.json]

Every figure is the best of ``--reps`` repetitions, and every comparison is measured in the same
run (this machine is shared and noisy). GB/s always counts the model's f32 bytes (``--mib``), so
the bf16 row is comparable with the f32 row although half as many bytes cross the wire.

Rows:
    f32       ``encode_tensor_frame`` (zero-copy payload, ``any()`` scan, Poly1305), then
              ``decode_tensor_frame`` of the joined frame into a preallocated tensor.
    bf16      the same with ``wire_dtype=torch.bfloat16`` (conversion on encode, f32 copy_ on
              decode through a reused scratch buffer).
    f32 sock  encode, ``send_buffers`` on one end of a socketpair in a thread,
              ``read_tensor_frame(sock.recv_into)`` on the other: the reduce server's path.

Columns: encode, decode and round trip (bytes / (encode + decode)) GB/s; ``memcpy`` is
``dst.copy_(src)`` of the same f32 bytes; ``mac`` is :func:`~flodl.wire.tensors.frame_tag`
over the wire bytes alone (per-frame key derivation, then Poly1305), the authentication every
frame must pay, hence the ceiling of any decoder of this format.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch

    from flodl.wire.tensor_read import decode_tensor_frame, read_tensor_frame
    from flodl.wire.tensors import (
        TensorKind,
        encode_tensor_frame,
        frame_ceiling,
        frame_tag,
        send_buffers,
    )

SECRET = b"bench-secret-0123456789abcdef012"
TARGET = 0.5  # f32 decode must reach this fraction of memcpy


def best_of(reps: int, fn: Callable[[], object]) -> float:
    """Best wall time of ``reps`` calls of ``fn`` after one warm-up call, in seconds."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_codec(
    src: torch.Tensor, reps: int, wire_dtype: torch.dtype | None
) -> dict[str, float | int]:
    """Encode and in-memory decode times of one frame carrying ``src``."""
    out = [torch.empty_like(src)]
    scratch = torch.empty(0, dtype=torch.uint8)
    ceiling = frame_ceiling(src.numel() * src.element_size())

    def encode() -> list[memoryview | bytes]:
        return encode_tensor_frame(
            [src], kind=TensorKind.MODEL_PARAMS, weight=1.0, round=1, secret=SECRET,
            wire_dtype=wire_dtype,
        )  # fmt: skip

    frame = b"".join(encode())
    encode_s = best_of(reps, encode)
    decode_s = best_of(
        reps,
        lambda: decode_tensor_frame(
            frame, out, secret=SECRET, max_frame_bytes=ceiling, scratch=scratch
        ),
    )
    if wire_dtype is None:
        assert torch.equal(out[0], src)
    else:
        assert torch.allclose(out[0], src, rtol=2**-8, atol=0)
    return {"encode_s": encode_s, "decode_s": decode_s, "wire_bytes": len(frame)}


def measure_socket(src: torch.Tensor, reps: int) -> dict[str, float | int]:
    """End-to-end time of encode + sendmsg + recv_into over a socketpair, f32."""
    out = [torch.empty_like(src)]
    ceiling = frame_ceiling(src.numel() * src.element_size())
    a, b = socket.socketpair()
    sent: list[int] = []

    def round_trip() -> None:
        buffers = encode_tensor_frame(
            [src], kind=TensorKind.MODEL_PARAMS, weight=1.0, round=1, secret=SECRET
        )
        sender = threading.Thread(target=lambda: sent.append(send_buffers(a, buffers)))
        sender.start()
        read_tensor_frame(b.recv_into, out, secret=SECRET, max_frame_bytes=ceiling)
        sender.join()

    with a, b:
        total_s = best_of(reps, round_trip)
    assert torch.equal(out[0], src)
    return {"total_s": total_s, "wire_bytes": sent[-1]}


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="f32 payload size (MiB)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions, best taken (>= 5)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error("--reps must be at least 5")

    nbytes: int = args.mib << 20
    reps: int = args.reps
    src = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(0))
    dst = torch.empty_like(src)
    memcpy_s = best_of(reps, lambda: dst.copy_(src))
    wire = memoryview(
        b"".join(encode_tensor_frame([src], kind=0, weight=1, round=0, secret=SECRET))
    )
    mac_s = best_of(reps, lambda: frame_tag(SECRET, b"", [wire]))
    mac_half_s = best_of(reps, lambda: frame_tag(SECRET, b"", [wire[: len(wire) // 2]]))

    def gbps(seconds: float) -> float:
        return nbytes / seconds / 1e9

    memcpy = gbps(memcpy_s)
    rows: dict[str, dict[str, float | int | None]] = {}
    for name, wire_dtype, mac_row_s in (
        ("f32", None, mac_s),
        ("bf16", torch.bfloat16, mac_half_s),
    ):
        m = measure_codec(src, reps, wire_dtype)
        rows[name] = {
            "encode_gbps": gbps(m["encode_s"]),
            "decode_gbps": gbps(m["decode_s"]),
            "round_trip_gbps": gbps(m["encode_s"] + m["decode_s"]),
            "memcpy_gbps": memcpy,
            "decode_vs_memcpy": gbps(m["decode_s"]) / memcpy,
            "mac_gbps": gbps(mac_row_s),
            "decode_vs_mac": mac_row_s / m["decode_s"],
            "wire_bytes": m["wire_bytes"],
        }
    sock = measure_socket(src, reps)
    rows["f32 sock"] = {
        "encode_gbps": None,
        "decode_gbps": None,
        "round_trip_gbps": gbps(sock["total_s"]),
        "memcpy_gbps": memcpy,
        "decode_vs_memcpy": None,
        "mac_gbps": gbps(mac_s),
        "decode_vs_mac": None,
        "wire_bytes": sock["wire_bytes"],
    }

    print(
        f"tensor frame, {args.mib} MiB f32 model, best of {reps}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads); GB/s of f32 model bytes"
    )
    line = "{:<9} {:>8} {:>8} {:>10} {:>8} {:>10} {:>8} {:>8}"
    print(
        line.format(
            "row", "encode", "decode", "round trip", "memcpy", "dec/memcpy", "mac", "dec/mac"
        )
    )
    keys = (
        "encode_gbps",
        "decode_gbps",
        "round_trip_gbps",
        "memcpy_gbps",
        "decode_vs_memcpy",
        "mac_gbps",
        "decode_vs_mac",
    )
    for name, row in rows.items():
        cells = [_cell(row[k], 3 if "_vs_" in k else 2) for k in keys]
        print(line.format(name, *cells))
    ratio = rows["f32"]["decode_vs_memcpy"]
    assert ratio is not None
    met = ratio >= TARGET
    print(
        f"target f32 decode >= {TARGET} x memcpy: {'met' if met else 'NOT met'} ({ratio:.3f}); "
        f"the frame MAC (Poly1305) alone runs at {gbps(mac_s):.2f} GB/s = "
        f"{gbps(mac_s) / memcpy:.3f} x memcpy, which bounds any decoder of this format"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "mib": args.mib,
                    "reps": args.reps,
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "python": sys.version.split()[0],
                    "target_decode_vs_memcpy": TARGET,
                    "target_met": met,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
