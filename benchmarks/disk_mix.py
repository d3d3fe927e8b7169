"""Does one disk read and write at once faster than in turn? What the planner's SSD time assumes
(``planner/plan.py``: reads and writes summed, whatever the buffers).

Through the tensor manager's own I/O engine (O_DIRECT, ``--threads`` threads, 16 MiB chunks), on a
scratch file under ``--dir``: per round, ``--gb`` GB read then ``--gb`` GB written one after the other
("in turn"), and the same read beside the same write from two threads, each on its own engine as the
tensor manager's lanes are ("together"), with requests of ``--request-mb`` MB. Rounds alternate the
two orders. Prints the read and write times, both totals, and the together time over the in-turn
one (the planner's sum) and over the slower stream alone (perfect overlap: the max) per round, and
writes JSON (default ``benchmarks/results/disk_mix.json``).

    python benchmarks/disk_mix.py
    python benchmarks/disk_mix.py --dir /mnt/nvme --gb 4 --request-mb 384
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import print_table, write_result

MiB = 1 << 20
COLUMNS = ["read_s", "write_s", "in_turn_s", "together_s", "together_vs_in_turn", "together_vs_max"]


def _round(directory: Path, nbytes: int, request: int, threads: int, swap: bool) -> dict[str, float]:
    """One round; ``swap``: together first."""
    from lightning_greedysnake.io import AlignedBuffer, IOConfig, ThreadedIOEngine

    n = nbytes // request
    src, dst = directory / "disk_mix_read.bin", directory / "disk_mix_write.bin"
    config = IOConfig(threads, 16 * MiB, True)
    try:
        with ThreadedIOEngine(config) as reads, ThreadedIOEngine(config) as writes, \
                AlignedBuffer(request) as rbuf, AlignedBuffer(request) as wbuf:
            f, g = reads.open(src, n * request), writes.open(dst, n * request)
            wbuf.tensor.fill_(1)
            for i in range(n):  # the file read back below exists on the disk
                writes.write(f, i * request, wbuf, 0, request)

            def read_all() -> None:
                for i in range(n):
                    reads.read(f, i * request, rbuf, 0, request)

            def write_all() -> None:
                for i in range(n):
                    writes.write(g, i * request, wbuf, 0, request)

            def in_turn() -> None:
                t0 = time.perf_counter()
                read_all()
                seconds["read"] = time.perf_counter() - t0
                write_all()

            def together() -> None:
                both = [threading.Thread(target=read_all), threading.Thread(target=write_all)]
                for t in both:
                    t.start()
                for t in both:
                    t.join()

            seconds: dict[str, float] = {}
            for name, run in (("in_turn", in_turn), ("together", together))[::-1 if swap else 1]:
                t0 = time.perf_counter()
                run()
                seconds[name] = time.perf_counter() - t0
    finally:
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)
    read, write = seconds["read"], seconds["in_turn"] - seconds["read"]
    return {"read_s": round(read, 3), "write_s": round(write, 3), "in_turn_s": round(seconds["in_turn"], 3),
            "together_s": round(seconds["together"], 3),
            "together_vs_in_turn": round(seconds["together"] / seconds["in_turn"], 3),
            "together_vs_max": round(seconds["together"] / max(read, write), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="a directory on the disk to measure (default: the temp dir)")
    parser.add_argument("--gb", type=float, default=1.5)
    parser.add_argument("--request-mb", type=int, default=48)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "disk_mix.json"))
    args = parser.parse_args()
    request = args.request_mb * MiB
    nbytes = max(request, int(args.gb * 1e9) // request * request)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for r in range(args.rounds):
            rows.append({"round": r, **_round(Path(tmp), nbytes, request, args.threads, swap=r % 2 == 1)})
    rows.append({"round": "median", **{k: round(statistics.median(row[k] for row in rows), 3)
                                       for k in COLUMNS}})
    print_table(rows, ["round", *COLUMNS])
    write_result(args.out, args, ["gb", "request_mb", "threads", "rounds"], rows)


if __name__ == "__main__":
    main()
