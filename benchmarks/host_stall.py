"""How long the train loop keeps the devices waiting per step: train.py, instrumented, on CPU.

    python benchmarks/host_stall.py                       # the demo config, 40 steps, 1 process
    python benchmarks/host_stall.py --processes 2         # 2 processes x 4 CPU devices
    PYTHONPATH=/path/to/other/checkout python benchmarks/host_stall.py   # another version's loop

Each process runs `train.py` (train.cli.main) with two wrappers and nothing else changed: the
compiled train step records when each step is dispatched and how long the call takes, and
jax.device_get how long the host blocks on the devices; a watcher thread records when each step's
outputs are ready. Per step (medians over the steps after the first few, the three periods
from each checkpoint's step on excluded):

    period      time between consecutive dispatches (the loop's step time, host gaps included)
    device      from the step's start (its dispatch, or the previous step's end) to its end
    idle        from a step's end to the next step's dispatch: the devices wait for the host
                (median, and mean: a few long gaps show in the mean)
    host work   period - time in device_get and in the step call (on CPU the call waits for the
                step before): what the loop does besides waiting for the devices
    save adds   per checkpoint (--checkpoint-every): the three periods from its step's dispatch
                on, less three ordinary periods: what the save costs the run, however the loop
                spreads it (the step after a save costs period + this)
    save blocks per checkpoint: the loop's time in Checkpointer.save, when it dispatches nothing
                (on a GPU the devices idle once their queue drains; on CPU devices the save's
                work also competes with the steps for the same cores). The state's copy on the
                devices (checkpoint.copy_on_device) is dispatched like a step: on CPU devices
                that call, like a step's, waits for the step before

Prints one table row per process, a digest of the losses (to compare versions bit for bit) and a
JSON line (--json FILE writes it too).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(args) -> None:
    """One trainer process, instrumented."""
    if not os.environ.get("PYTHONPATH"):  # this checkout's trainer (PYTHONPATH: another one's)
        sys.path.insert(0, str(ROOT))
    sys.setswitchinterval(1e-4)  # the watcher thread records a step's end without waiting long
    import queue
    import threading

    import jax

    from train.program import state as program
    from train import cli

    dispatches, ends, waits = [], {}, []
    watch: queue.Queue = queue.Queue()

    def watcher():  # when each step's outputs are ready, whatever the loop is doing meanwhile
        while (item := watch.get()) is not None:
            index, loss = item
            loss.block_until_ready()
            ends[index] = time.perf_counter()

    threading.Thread(target=watcher, daemon=True).start()
    device_get = jax.device_get

    def timed_get(x):
        t = time.perf_counter()
        out = device_get(x)
        waits.append((t, time.perf_counter() - t))
        return out

    jax.device_get = timed_get
    lower = program.TrainProgram.lower

    def timed_lower(self, *a, **k):
        lowered = lower(self, *a, **k)

        class Lowered:
            def compile(self_):
                compiled = lowered.compile()

                class Step:
                    def __getattr__(self__, name):
                        return getattr(compiled, name)

                    def __call__(self__, *step_args):
                        t = time.perf_counter()
                        out = compiled(*step_args)
                        # (the CPU client waits here for the step before, whose outputs it takes)
                        waits.append((t, time.perf_counter() - t))
                        dispatches.append(t)
                        watch.put((len(dispatches) - 1, out[2]["loss"]))
                        return out

                return Step()

            def __getattr__(self_, name):
                return getattr(lowered, name)

        return Lowered()

    program.TrainProgram.lower = timed_lower
    from train.checkpoint import store

    saving = []  # seconds the loop's thread spent in Checkpointer.save
    save_calls = []

    def timed(fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                saving.append(time.perf_counter() - t)
        return call

    save = timed(store.Checkpointer.save)
    store.Checkpointer.save = lambda *a, **k: (save_calls.append(1), save(*a, **k))[1]
    status = cli.main(args.train_args)
    watch.put(None)
    if status:
        sys.exit(status)
    while len(ends) < len(dispatches):
        time.sleep(0.01)

    every = args.checkpoint_every
    # a save's window: the period of the step it follows and the two after it (a save written
    # after the next dispatch, or on a CPU client whose calls wait for the step before, shows
    # in those), less three ordinary periods
    saves = [i for i in range(args.skip, len(dispatches) - 3) if every and (i + 1) % every == 0]
    in_window = {i + k for i in saves for k in range(3)}
    periods, host, idle, device = [], [], [], []
    for i in range(args.skip, len(dispatches) - 1):
        if i in in_window:
            continue
        a, b = dispatches[i], dispatches[i + 1]
        blocked = sum(d for t0, d in waits if a <= t0 < b)
        periods.append(b - a)
        host.append(b - a - blocked)
        idle.append(max(0.0, b - ends[i]))  # step i ended before step i + 1 was dispatched
        device.append(ends[i] - max(a, ends[i - 1]))
    period = statistics.median(periods)
    costs = [dispatches[i + 3] - dispatches[i] - 3 * period for i in saves]
    row = {"source": str(Path(cli.__file__).parent.parent), "process": jax.process_index(),
           "steps": len(periods), "period_ms": 1e3 * period,
           "device_ms": 1e3 * statistics.median(device),
           "idle_ms": 1e3 * statistics.median(idle), "idle_mean_ms": 1e3 * statistics.mean(idle),
           "host_work_ms": 1e3 * statistics.median(host), "saves": len(saves),
           # what a save adds to the run (median over the saves): the step after a save costs
           # period + this
           "save_cost_ms": 1e3 * statistics.median(costs) if costs else None,
           # the loop's thread in Checkpointer.save, per save (the loop dispatches nothing
           # meanwhile: on a GPU the devices idle once the queue drains)
           "save_blocks_ms": 1e3 * sum(saving) / len(save_calls) if save_calls else None}
    print("HOST_STALL " + json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs/demo_cpu.yaml"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--processes", type=int, choices=(1, 2), default=1)
    p.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("overrides", nargs="*", help="more key.sub=value overrides")
    args = p.parse_args()

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    port = None
    if args.processes > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for pid in range(args.processes):
            train_args = ["--config", args.config, f"run.dir={tmp}/run",
                          f"train.steps={args.steps}", f"checkpoint.every={args.checkpoint_every}",
                          "checkpoint.save_final=false", "metrics.progress=false", *args.overrides]
            if port is not None:
                train_args += ["runtime.cpu_devices=4",
                               f"runtime.distributed.coordinator=127.0.0.1:{port}",
                               f"runtime.distributed.num_processes={args.processes}",
                               f"runtime.distributed.process_id={pid}"]
            cmd = [sys.executable, __file__, "--_worker", json.dumps(
                {"train_args": train_args, "skip": args.skip,
                 "checkpoint_every": args.checkpoint_every})]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        rows = []
        for proc in procs:
            out, err = proc.communicate(timeout=1800)
            if proc.returncode:
                sys.exit(f"error: a trainer process exited {proc.returncode}:\n{err[-3000:]}")
            rows += [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
                     if line.startswith("HOST_STALL ")]
        # the losses, to compare versions bit for bit
        lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
        losses = [json.loads(line)["loss"] for line in lines]
        digest = hashlib.sha256(json.dumps(losses).encode()).hexdigest()[:16]
        for r in rows:
            r["losses_sha256"] = digest
    print(f"{'process':>7} {'steps':>5} {'period ms':>10} {'device ms':>10} {'idle ms':>8} "
          f"{'idle mean':>10} {'host work ms':>13} {'save adds ms':>15} {'save blocks ms':>15}")
    for r in rows:
        save = "-" if r["save_cost_ms"] is None else \
            f"{r['save_cost_ms']:.1f} ({r['save_cost_ms'] / r['period_ms']:+.0%})"
        print(f"{r['process']:>7} {r['steps']:>5} {r['period_ms']:>10.2f} {r['device_ms']:>10.2f} "
              f"{r['idle_ms']:>8.2f} {r['idle_mean_ms']:>10.2f} {r['host_work_ms']:>13.2f} "
              f"{save:>15} {'-' if r['save_blocks_ms'] is None else round(r['save_blocks_ms'], 1):>15}")
    print(f"{len(losses)} losses, {losses[0]:.6f} -> {losses[-1]:.6f}, sha256 {digest}")
    print(json.dumps(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_worker":
        worker(argparse.Namespace(**json.loads(sys.argv[2])))
    else:
        main()
