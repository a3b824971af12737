"""Builds, caches and loads tfdp's compiled ops, or says why it cannot.

`gaussian_noise.cc` (the noise) and `embedding_rows.cc` (an embedding's
repeated ids, merged rows and clipped sum) are compiled into one library
on first use with the system C++ compiler (`$CXX`, else `g++`) against the
installed TensorFlow's headers and library (`tf.sysconfig`), into a
per-user cache: `$TFDP_CACHE_DIR`, else `$XDG_CACHE_HOME/tfdp`, else
`~/.cache/tfdp`, in a folder named by a hash of the TensorFlow version,
the sources, the compiler's version and the flags.
A later process loads the cached library (`tf.load_op_library`) only if it
and its folders are owned by the current user and not writable by group or
others (else the graph generator runs, `noise_path` naming the path and the
fix). Nothing is built at install time, so `pip install` needs no compiler.

Each op reproduces its TensorFlow reference bit for bit only on the
TensorFlow builds whose kernels it mirrors, so a loaded op must also pass a
self-check against the graph (`native_noise.py` and
`tfdp/per_example/native_rows.py` run them) before it is used. Where anything
fails (no compiler, no headers, a compile error, a failed check) the graph
generator runs, and `TFDP_NOISE_KERNEL=graph` forces it.

Example:

>>> ops = load()
>>> ops.library is None or hasattr(ops.library, "tfdp_gaussian_noise")
True
"""

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

import tensorflow as tf

ENV_SWITCH = "TFDP_NOISE_KERNEL"  # "graph" forces TensorFlow's ops for every compiled op
SOURCES = tuple(pathlib.Path(__file__).with_name(name)
                for name in ("gaussian_noise.cc", "embedding_rows.cc"))
# No -ffast-math, and no contraction of a * b + c into one rounding: the op
# must round exactly where TensorFlow's kernels round.
FLAGS = ["-O3", "-fPIC", "-shared", "-w", "-ffp-contract=off", "-fno-math-errno"]
_LIBRARY_NAME = "tfdp_ops.so"


@dataclasses.dataclass(frozen=True)
class NativeOps:
    """The loaded op library, or None with the reason.

    Attributes:
        library: the module `tf.load_op_library` returned, or None.
        path: the shared library's path (None when none was loaded).
        reason: why there is no library ("" when there is one).
        build_seconds: how long this process took to compile it (None: it
            came from the cache).
    """

    library: object = None
    path: str = None
    reason: str = ""
    build_seconds: float = None


def _cache_root():
    if os.environ.get("TFDP_CACHE_DIR"):
        return pathlib.Path(os.environ["TFDP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "tfdp"


def _compiler():
    """The compiler's path and its version line, or (None, why)."""
    name = os.environ.get("CXX", "g++")
    path = shutil.which(name)
    if path is None:
        return None, f"no C++ compiler: {name!r} is not on PATH (set CXX to one)"
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=60, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as error:
        return None, f"the C++ compiler {path} did not run ({error})"
    return path, version


def _command(compiler, output):
    return [compiler, *FLAGS, *tf.sysconfig.get_compile_flags(), *map(str, SOURCES),
            "-o", str(output), *tf.sysconfig.get_link_flags()]


def _cache_key(compiler_version):
    digest = hashlib.sha256()
    for part in (tf.__version__, compiler_version, " ".join(FLAGS),
                 " ".join(tf.sysconfig.get_compile_flags())):
        digest.update(part.encode() + b"\0")
    for source in SOURCES:
        digest.update(source.read_bytes() + b"\0")
    return f"tf{tf.__version__}-{digest.hexdigest()[:16]}"


def _unsafe(paths):
    """Why the first of `paths` that another user could have written is not
    to be trusted, else None: it must be owned by this user and not
    writable by group or others (a planted library would run in this
    process and could draw no noise)."""
    for path in paths:
        try:
            info = path.stat()
        except FileNotFoundError:
            continue
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            return (f"{path} is not owned by this user or is writable by others (mode "
                    f"{info.st_mode & 0o777:o}): remove it, or set TFDP_CACHE_DIR to a folder "
                    "only you can write")
    return None


def _names():
    return " and ".join(source.name for source in SOURCES)


def _build(compiler, target):
    """Compiles into `target`'s folder atomically; returns None or why not."""
    for folder in (_cache_root(), target.parent.parent, target.parent):  # private folders
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = pathlib.Path(scratch) / _LIBRARY_NAME
        try:
            run = subprocess.run(_command(compiler, partial), capture_output=True, text=True,
                                 timeout=600)
        except (OSError, subprocess.SubprocessError) as error:
            return f"compiling {_names()} failed to run ({error})"
        if run.returncode != 0:
            tail = " ".join(run.stderr.strip().splitlines()[-3:])
            return f"compiling {_names()} failed (exit {run.returncode}): {tail}"
        partial.chmod(0o755)  # whatever the umask: writable by this user only
        os.replace(partial, target)  # atomic: a concurrent build writes the same bytes
    return None


def load():
    """The compiled ops' library, built and cached on first use (see the module).

    Returns:
        `NativeOps`: the library, or None and the reason.
    """
    if os.environ.get(ENV_SWITCH, "").strip().lower() == "graph":
        return NativeOps(reason=f"{ENV_SWITCH}=graph")
    missing = [str(source) for source in SOURCES if not source.exists()]
    if missing:
        return NativeOps(reason=f"the ops' source {', '.join(missing)} is missing")
    compiler, version = _compiler()
    if compiler is None:
        return NativeOps(reason=version)
    target = _cache_root() / "native" / _cache_key(version) / _LIBRARY_NAME
    folders = [target.parent, target.parent.parent, _cache_root()]
    unsafe = _unsafe(folders)
    if unsafe is not None:
        return NativeOps(reason=unsafe)
    build_seconds = None
    if not target.exists():
        start = time.monotonic()
        failure = _build(compiler, target)
        if failure is not None:
            return NativeOps(reason=failure)
        build_seconds = time.monotonic() - start
    unsafe = _unsafe([target, *folders])  # as built or found: checked again before loading
    if unsafe is not None:
        return NativeOps(reason=unsafe)
    try:
        library = tf.load_op_library(str(target))
    except (tf.errors.OpError, OSError) as error:
        return NativeOps(reason=f"loading {target} failed ({error})")
    return NativeOps(library=library, path=str(target), build_seconds=build_seconds)
