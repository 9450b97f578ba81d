"""What one read of a slot frozen mid-write costs: a slot's seqlock sequence made odd (the first of
a write's two stores, its writer gone), then ``--reads`` full reads of it once its heartbeat is
``--age`` s old; prints the CPU and wall time per read and what the read returned.

Usage: ``python -m bench.frozen_slot_read [--reads 20] [--age 1.2]``; run it with another checkout's
``dplb_shm`` first on ``PYTHONPATH`` to compare builds (bench/results/faults.md, row 46.4).
"""
from __future__ import annotations

import argparse
import mmap
import os
import time

from dplb_shm import Segment, WorkerState, layout


def main(argv: list[str] | None = None) -> int:
    """Measure and print; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m bench.frozen_slot_read", description=__doc__.split("\n\n")[0])
    p.add_argument("--reads", type=int, default=20)
    p.add_argument("--age", type=float, default=1.2, help="seconds between the freeze and the reads")
    args = p.parse_args(argv)
    name = f"dplb-bench-frozen-{os.getpid()}"
    seg = Segment.create(name, num_slots=4, replace=True)
    try:
        w = seg.writer(0)
        w.claim(0, endpoint="/tmp/dplb-frozen.sock")
        w.set_state(WorkerState.READY)
        off = layout.slot_offset(0) + layout.Slot.seq.offset
        with open(f"/dev/shm/{name}", "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
            try:
                mm[off:off + 8] = (int.from_bytes(mm[off:off + 8], "little") | 1).to_bytes(8, "little")
            finally:
                mm.close()
        time.sleep(args.age)
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(args.reads):
            s = seg.read_slot(0)
        cpu_ms = (time.process_time() - c0) / args.reads * 1e3
        wall_ms = (time.perf_counter() - t0) / args.reads * 1e3
        print(f"reads={args.reads} cpu_ms_per_read={cpu_ms:.3f} wall_ms_per_read={wall_ms:.3f} "
              f"state={s.state.name} stale={getattr(s, 'stale', 'n/a')}")
    finally:
        seg.close()
        os.unlink(f"/dev/shm/{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
