"""Runs `scenarios.py` in fresh processes, watched for hangs (helper, not tests).

Multi-worker runs start one process per worker on 127.0.0.1 (loopback only),
each with its TF_CONFIG. If any process fails, all are killed and the caller
gets their logs: a hung worker cannot hang the suite.

No wall-clock budget: a loaded machine (the CI runner, or a developer's
2 cores at load 9) only slows them down. Instead a watchdog reads the CPU
time the processes have used (Linux /proc): they are hung if together they
used less than `MIN_CPU_SECONDS` in `STALL_SECONDS` of wall time and wrote
nothing to their logs meanwhile (a deadlock sleeps: the from_generator
teardown deadlock sat at 1% CPU), and runaway if together they used more than
`CPU_BUDGET_SECONDS` (about 13 times what all four use on 2 quiet cores).
Where /proc cannot tell CPU time (not Linux), the watchdog judges nothing,
and pytest-timeout's limit (conftest.py) is the only backstop.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).with_name("scenarios.py")
REPO = Path(__file__).resolve().parents[2]

# Measured: the four scenario processes used 91.5 s of CPU in all (104 s of
# wall time at load 3 to 5 on 2 cores). A process that makes progress on a
# loaded machine still gets CPU time: at load 9 on 2 cores the four get about
# 0.6 of a core, 108 s in 180 s, far above 10.
STALL_SECONDS = 180.0
MIN_CPU_SECONDS = 10.0
CPU_BUDGET_SECONDS = 1200.0


def _env(tf_config=None):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def _free_ports(count):
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def cpu_seconds(pid):
    """User + system CPU time of process `pid` (all its threads), or None
    where /proc cannot tell (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Watchdog:
    """Tells a hung or runaway group of processes from a slow one.

    Args:
        stall_seconds, min_cpu_seconds: hung if the group used less CPU than
            `min_cpu_seconds` in `stall_seconds` of wall time and no log grew.
        cpu_budget_seconds: runaway above this much CPU in all.
    """

    def __init__(self, stall_seconds, min_cpu_seconds, cpu_budget_seconds):
        self.stall_seconds = stall_seconds
        self.min_cpu_seconds = min_cpu_seconds
        self.cpu_budget_seconds = cpu_budget_seconds
        self._used = {}  # pid -> CPU seconds last read (kept once it exits)
        self._log_bytes = 0
        self._mark = (time.monotonic(), 0.0, 0)

    def verdict(self, procs, logs):
        """None while the group makes progress (or /proc cannot tell), else
        why it does not."""
        if cpu_seconds(os.getpid()) is None:
            return None
        for proc in procs:
            used = cpu_seconds(proc.pid)
            if used is not None:
                self._used[proc.pid] = used
        total = sum(self._used.values())
        log_bytes = sum(path.stat().st_size for path in logs if path.exists())
        now = time.monotonic()
        since, cpu_then, log_then = self._mark
        if total > self.cpu_budget_seconds:
            return (f"runaway: they used {total:.0f} s of CPU, more than the budget of "
                    f"{self.cpu_budget_seconds:.0f} s")
        if total - cpu_then >= self.min_cpu_seconds or log_bytes > log_then:
            self._mark = (now, total, log_bytes)
        elif now - since > self.stall_seconds:
            return (f"hung: in the last {now - since:.0f} s they used "
                    f"{total - cpu_then:.1f} s of CPU (progress needs "
                    f"{self.min_cpu_seconds:.0f} s) and wrote nothing to their logs")
        return None


def run_all(jobs, out_dir, script=SCRIPT, stall_seconds=STALL_SECONDS,
            min_cpu_seconds=MIN_CPU_SECONDS, cpu_budget_seconds=CPU_BUDGET_SECONDS):
    """Runs `jobs` = {name: (args, tf_config)} concurrently; returns {name: results}.

    Each job runs `script` with its args and an output path OUT.npz; the
    results are the arrays it saved there.
    """
    out_dir = Path(out_dir)
    procs = {}
    for name, (args, tf_config) in jobs.items():
        log = open(out_dir / f"{name}.log", "w")
        out = out_dir / f"{name}.npz"
        procs[name] = (
            subprocess.Popen(
                [sys.executable, str(script), *args, str(out)],
                env=_env(tf_config), stdout=log, stderr=subprocess.STDOUT,
            ),
            log,
            out,
        )
    watchdog = Watchdog(stall_seconds, min_cpu_seconds, cpu_budget_seconds)
    logs = [out_dir / f"{name}.log" for name in procs]
    failure = None
    try:
        while failure is None:
            codes = {name: p.poll() for name, (p, _, _) in procs.items()}
            if all(code == 0 for code in codes.values()):
                break
            failed = [name for name, code in codes.items() if code not in (None, 0)]
            if failed:
                failure = f"{failed} exited with codes {[codes[n] for n in failed]}"
            else:
                running = [p for name, (p, _, _) in procs.items() if codes[name] is None]
                failure = watchdog.verdict(running, logs)
                time.sleep(0.2)
    finally:
        for proc, log, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failure:
        logs = "\n".join(
            f"--- {name} ---\n" + (out_dir / f"{name}.log").read_text()[-3000:]
            for name in procs
        )
        raise AssertionError(f"scenario processes failed: {failure}\n{logs}")
    results = {}
    for name, (_, _, out) in procs.items():
        with np.load(out, allow_pickle=False) as data:
            results[name] = {key: data[key] for key in data.files}
    return results


def mirrored_jobs(replicas_list):
    return {f"mirrored_{r}": (["mirrored", str(r)], None) for r in replicas_list}


def worker_jobs(num_workers):
    ports = _free_ports(num_workers)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    return {
        f"worker_{i}": (
            ["worker", str(num_workers)],
            {"cluster": cluster, "task": {"type": "worker", "index": i}},
        )
        for i in range(num_workers)
    }
