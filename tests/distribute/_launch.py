"""Runs `scenarios.py` in fresh processes with bounded time (helper, not tests).

Multi-worker runs start one process per worker on 127.0.0.1 (loopback only),
each with its TF_CONFIG. If any process fails or the time runs out, all are
killed and the caller gets their logs: a hung worker cannot hang the suite.
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


def run_all(jobs, out_dir, timeout):
    """Runs `jobs` = {name: (args, tf_config)} concurrently; returns {name: results}."""
    out_dir = Path(out_dir)
    procs = {}
    for name, (args, tf_config) in jobs.items():
        log = open(out_dir / f"{name}.log", "w")
        out = out_dir / f"{name}.npz"
        procs[name] = (
            subprocess.Popen(
                [sys.executable, str(SCRIPT), *args, str(out)],
                env=_env(tf_config), stdout=log, stderr=subprocess.STDOUT,
            ),
            log,
            out,
        )
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while failure is None:
            codes = {name: p.poll() for name, (p, _, _) in procs.items()}
            if all(code == 0 for code in codes.values()):
                break
            failed = [name for name, code in codes.items() if code not in (None, 0)]
            if failed:
                failure = f"{failed} exited with codes {[codes[n] for n in failed]}"
            elif time.monotonic() > deadline:
                failure = f"timed out after {timeout} s"
            else:
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
