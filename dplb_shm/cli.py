"""``dplb-shm``: create, unlink and list DPLB segments.

Usage::

    dplb-shm create --name dplb-30000 --slots 64 [--replace]
    dplb-shm unlink --name dplb-30000 [--missing-ok]
    dplb-shm list

Exit status: 0 ok, 1 segment error (exists, missing, permission), 2 usage or layout mismatch.
"""
from __future__ import annotations

import argparse
import sys

from dplb_shm import (
    DEFAULT_NUM_SLOTS,
    LAYOUT_VERSION,
    LayoutMismatchError,
    Segment,
    SegmentError,
    WorkerState,
    default_name,
    unlink,
)
from dplb_shm.discover import list_segments


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="dplb-shm", description="Manage DPLB shared-memory segments.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="create a segment (mode 0600)")
    c.add_argument("--name", default=default_name(), help="segment name (default %(default)s)")
    c.add_argument("--slots", type=int, default=DEFAULT_NUM_SLOTS, help="number of worker slots")
    c.add_argument("--replace", action="store_true", help="unlink an existing segment of that name first")
    u = sub.add_parser("unlink", help="remove a segment from /dev/shm")
    u.add_argument("--name", default=default_name())
    u.add_argument("--missing-ok", action="store_true", help="exit 0 when it does not exist")
    sub.add_parser("list", help="list DPLB segments in /dev/shm")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dplb-shm``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "create":
            seg = Segment.create(args.name, num_slots=args.slots, replace=args.replace)
            print(f"created {seg.name}: {seg.num_slots} slots, layout version {LAYOUT_VERSION}")
            seg.close()
        elif args.cmd == "unlink":
            gone = unlink(args.name, missing_ok=args.missing_ok)
            print(f"unlinked {args.name}" if gone else f"{args.name} did not exist")
        else:
            for info in list_segments():
                live = "?"
                if info.compatible:
                    try:
                        with Segment.attach(info.name, readonly=True) as seg:
                            live = str(sum(1 for s in seg.snapshot() if s.state != WorkerState.EMPTY))
                    except SegmentError:
                        pass
                print(f"{info.name}\tversion={info.version}\tslots={info.num_slots}\tworkers={live}")
    except LayoutMismatchError as e:
        print(f"dplb-shm: {e}", file=sys.stderr)
        return 2
    except SegmentError as e:
        print(f"dplb-shm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
