"""No Python on tf.data's threads when training on in-memory data (issue 35, item 1).

A `fit` hung for minutes: the thread deleting the input iterator waited for a
prefetch thread blocked inside the Python generator that drew the Poisson
batches (`tf.data.Dataset.from_generator`). The draws now happen in the
graph: for arrays (and DPIS) the pipeline holds no op that calls Python and
makes no Python call; data on disk keeps one read function a step (the
record read, which the positive controls show the checks would see).
Checked in a fresh process, where the hooks cannot leak.
"""

import json
import os
import subprocess
import sys


def test_in_memory_pipelines_call_no_python(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "_pipeline_python.py")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("arrays", "dpis"):
        assert report[name] == {"python_ops": [], "python_calls": 0}, (name, report[name])
    for name in ("memmap", "record_source"):  # positive controls: the record read
        assert report[name]["python_ops"] == ["PyFuncStateless"], (name, report[name])
        assert report[name]["python_calls"] > 0, (name, report[name])
