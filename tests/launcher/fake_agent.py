"""Stand-in worker agent for the launcher's tests: same CLI as ``python -m worker_agent``.

Claims its slot, starts an "engine" (a sleeping grandchild in a session of its own, pid written to
``<run-dir>/engine-K.pid``) and turns READY after a short delay, then heartbeats. Behaviour per
worker id from the environment: ``FAKE_FAIL=K`` makes worker K print an error and exit 3;
``FAKE_NEVER=K`` keeps worker K in STARTING; ``FAKE_DEAD=K`` marks worker K DEAD and lives on; ``FAKE_DIE_AFTER_READY=K`` exits 4 after 1 s of READY;
``FAKE_RESTART_AFTER_READY=K`` records in the slot, after 1 s of READY, what a real agent does for
a killed engine: DEAD (engine exited, code -9, restart in 0.5 s), then restart 1, then READY.
``FAKE_DRAIN_S=S`` makes every worker drain like a real agent on SIGTERM: it takes S seconds, then
stops its engine and exits 0, and writes to ``<run-dir>/drain-K.json`` whether the router still
answered and its engine still ran when the drain began and when it ended.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from dplb_shm import Segment, StateReason, WorkerState, now_ns

STOP = []


def router_up(shm: str) -> bool:
    """Does the router of segment ``dplb-<port>`` answer ``GET /health``?"""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{int(shm.rsplit('-', 1)[1])}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def drain(k: int, shm: str, run_dir: str, engine: subprocess.Popen, seconds: float) -> None:
    """What a real agent does on SIGTERM, timed: DRAINING for ``seconds``, then stop the engine."""
    seen = {"begin": {"router": router_up(shm), "engine": engine.poll() is None}}
    time.sleep(seconds)
    seen["end"] = {"router": router_up(shm), "engine": engine.poll() is None}
    engine.terminate()
    engine.wait(5)
    with open(os.path.join(run_dir, f"drain-{k}.json"), "w") as f:
        json.dump(seen, f)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker-id", type=int, required=True)
    ap.add_argument("--shm", required=True)
    ap.add_argument("--uds", required=True)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--model", default="fake-model")
    args, _ = ap.parse_known_args()
    k = args.worker_id
    print(f"fake agent {k} argv={sys.argv[1:]} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}",
          flush=True)
    if os.environ.get("FAKE_FAIL") == str(k):
        print(f"fake agent {k}: engine failed to start: CUDA out of memory (simulated)", flush=True)
        return 3
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    with open(os.path.join(args.run_dir, f"engine-{k}.pid"), "w") as f:
        f.write(str(engine.pid))
    seg = Segment.attach(args.shm)
    w = seg.writer(k)
    w.claim(worker_id=k, pid=os.getpid(), endpoint=args.uds, gpu_ids=[], weight=1.0, model=args.model,
            max_num_seqs=256)
    time.sleep(0.3)
    if os.environ.get("FAKE_DEAD") == str(k):
        print(f"fake agent {k}: engine exited with status 1 (simulated)", flush=True)
        with open(os.path.join(args.run_dir, f"engine-{k}.log"), "w") as f:
            f.write("ModuleNotFoundError: No module named 'vllm' (simulated)\n")
        w.set_state(WorkerState.DEAD)
    elif os.environ.get("FAKE_NEVER") != str(k):
        w.publish(state=WorkerState.READY, engine_pid=engine.pid)
    ready_at = time.monotonic()
    restart_step = 0 if os.environ.get("FAKE_RESTART_AFTER_READY") == str(k) else -1
    drain_s = os.environ.get("FAKE_DRAIN_S")
    if drain_s is not None:
        signal.signal(signal.SIGTERM, lambda *_: STOP.append(True))
    while True:
        if STOP:
            w.set_state(WorkerState.DRAINING)
            drain(k, args.shm, args.run_dir, engine, float(drain_s or 0))
            return 0
        w.heartbeat()
        if restart_step == 0 and time.monotonic() - ready_at > 1.0:
            w.publish(state=WorkerState.DEAD, state_reason=StateReason.ENGINE_EXITED, last_exit_code=-9,
                      next_restart_ns=now_ns() + 500_000_000)
            restart_step, t_step = 1, time.monotonic()
        elif restart_step == 1 and time.monotonic() - t_step > 0.6:
            w.publish(state=WorkerState.STARTING, restarts=1, next_restart_ns=0)
            restart_step, t_step = 2, time.monotonic()
        elif restart_step == 2 and time.monotonic() - t_step > 0.6:
            w.publish(state=WorkerState.READY, state_reason=StateReason.NONE, engine_pid=engine.pid)
            restart_step = 3
        if os.environ.get("FAKE_DIE_AFTER_READY") == str(k) and time.monotonic() - ready_at > 1.0:
            print(f"fake agent {k}: crashing", flush=True)
            os._exit(4)
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
