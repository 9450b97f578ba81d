"""py-spy recording of one process for the length of a ``with`` block, written as the functions
with the most samples (own and inclusive): the overhead benches' ``--profile FILE``."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Self


class Profiler:
    """py-spy recording of one process for the length of a ``with`` block; :meth:`write` turns
    the raw stacks into the top functions by own and inclusive samples."""

    def __init__(self, pid: int, out: str | None) -> None:
        self.pid, self.out, self.p = pid, out, None
        self.raw = (out + ".raw") if out else None

    def __enter__(self) -> Self:
        if self.out:
            import shutil

            spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
            self.p = subprocess.Popen([spy, "record", "--pid", str(self.pid), "--format", "raw", "--rate", "250",
                                       "--nonblocking", "--output", self.raw], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.p is not None:
            self.p.send_signal(2)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
            self.write()

    def write(self, top: int = 40) -> None:
        from collections import Counter

        own: Counter[str] = Counter()
        incl: Counter[str] = Counter()
        total = 0
        try:
            lines = open(self.raw).read().splitlines()  # noqa: SIM115
        except OSError:
            return
        for line in lines:
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            k = int(n)
            total += k
            frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 2)[-1] + ")"
                      if " (" in f else f for f in stack.split(";")]
            own[frames[-1]] += k
            for f in set(frames):
                incl[f] += k
        with open(self.out, "w") as f:
            f.write(f"py-spy samples: {total} (rate 250/s)\n\nown time (top {top})\n")
            for name, k in own.most_common(top):
                f.write(f"{100.0 * k / max(total, 1):6.2f}%  {name}\n")
            f.write(f"\ninclusive time (top {top})\n")
            for name, k in incl.most_common(top):
                f.write(f"{100.0 * k / max(total, 1):6.2f}%  {name}\n")
        os.unlink(self.raw)
