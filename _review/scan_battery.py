"""Step-scan battery: ops that should be refused (or not) in a DP fit's compiled step.

Each case is a small layer in a DPSequential; fit one step and report
REFUSED (with the start of the message) or ACCEPTED (with what leaked).
Run: cd /work/wt/review-7 && PYTHONPATH=$PWD python _review/scan_battery.py [case ...]
"""
import os, sys, tempfile, traceback
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, numpy as np, tensorflow as tf
import tfdp

SECRET = 98765.4375
TMP = tempfile.mkdtemp()


def crafted(n=16, dim=4):
    x = np.zeros((n, dim), "float32")
    if os.environ.get("NO_CANARY") != "1":
        x[0, 0] = SECRET
    return x, np.zeros(n, "int64")


def fit(middle, x=None, y=None, **kw):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,) if x is None else x.shape[1:], dtype=kw.pop("dtype", "float32")),
                               middle, keras.layers.Dense(3, name="head")])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0, seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kw)
    if x is None:
        x, y = crafted()
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)
    return model


@tfdp.per_example.declare_per_example
class Abort(keras.layers.Layer):
    """tf.raw_ops.Abort under a cond the batch decides: kills the process when the canary is drawn."""
    def call(self, x, training=None):
        def die():
            op = tf.raw_ops.Abort(error_msg="record drawn", exit_without_error=False)
            with tf.control_dependencies([op]):
                return tf.identity(tf.constant(0.0))
        big = tf.reduce_max(x) > 1000.0
        return x + tf.cond(big, die, lambda: tf.constant(0.0))


class ToNumber(keras.layers.Layer):
    def call(self, s):
        return tf.strings.to_number(s, tf.float32)
    def compute_output_shape(self, s):
        return s


class ExternalVar(keras.layers.Layer):
    """A running max kept in a tf.Variable the layer does not track."""
    def __init__(self, var, **kw):
        super().__init__(**kw); self._box = [var]
    def call(self, x, training=None):
        v = self._box[0]
        v.assign(tf.maximum(v, tf.reduce_max(x)))
        return x


class OwnRunningMax(keras.layers.Layer):
    def build(self, shape):
        self.m = self.add_weight(shape=(), initializer="zeros", trainable=False, name="running_max")
    def call(self, x, training=None):
        if training:
            self.m.assign(tf.maximum(self.m, tf.reduce_max(x)))
        return x


class HashInsert(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, -1.0)
    def call(self, x, training=None):
        self.table.insert(tf.constant([1], tf.int64), tf.reshape(tf.reduce_max(x), [1]))
        return x


class StatefulRng(keras.layers.Layer):
    """tf.random.Generator skipped a data-dependent number of times."""
    def __init__(self, **kw):
        super().__init__(**kw)
        self.g = tf.random.Generator.from_seed(1)
    def call(self, x, training=None):
        n = tf.cast(tf.reduce_max(x) > 1000.0, tf.int64)
        self.g.skip(n)
        return x + 0.0 * self.g.normal([])


class PyFn(keras.layers.Layer):
    def call(self, x):
        y = tf.py_function(lambda t: t, [x], tf.float32); y.set_shape(x.shape); return y
    def compute_output_shape(self, s):
        return s


class NpFn(keras.layers.Layer):
    def call(self, x):
        y = tf.numpy_function(lambda t: t, [x], tf.float32); y.set_shape(x.shape); return y


class PrintFile(keras.layers.Layer):
    def call(self, x):
        tf.print(x, output_stream="file://" + os.path.join(TMP, "print.txt"))
        return x


class Summary(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw); self.w = tf.summary.create_file_writer(os.path.join(TMP, "tb"))
    def call(self, x):
        with self.w.as_default():
            tf.summary.scalar("m", tf.reduce_max(x), step=0)
        return x


class JitWrite(keras.layers.Layer):
    """An own-variable write inside a jit_compile'd tf.function."""
    def __init__(self, **kw):
        super().__init__(**kw)
        self.f = tf.function(lambda v, x: v.assign(tf.maximum(v, tf.reduce_max(x))), jit_compile=True)
    def build(self, shape):
        self.m = self.add_weight(shape=(), initializer="zeros", trainable=False, name="jit_max")
    def call(self, x, training=None):
        if training:
            self.f(self.m, x)
        return x
    def compute_output_shape(self, s):
        return s


class BoolMaskShapeAssert(keras.layers.Layer):
    """Known MINOR: assert on tf.shape of a value-dependent tensor (boolean_mask)."""
    def call(self, x):
        picked = tf.boolean_mask(x, x > 1000.0)
        tf.debugging.assert_equal(tf.shape(picked)[0], 0)
        return x


class MaxLabel(keras.metrics.Metric):
    """A metric keeping the largest label it saw (its own variable)."""
    def __init__(self, name="max_label", **kw):
        super().__init__(name=name, **kw)
        self.v = self.add_variable(shape=(), initializer="zeros", name="v")
    def update_state(self, y_true, y_pred, sample_weight=None):
        self.v.assign(tf.maximum(self.v, tf.cast(tf.reduce_max(y_true), "float32")))
    def result(self):
        return self.v


def case_abort():
    import subprocess
    code = ("import sys; sys.argv=['x','abort_inproc']; exec(open('_review/scan_battery.py').read())")
    out = []
    for no_canary in ("0", "1"):
        env = dict(os.environ, NO_CANARY=no_canary)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=600, env=env)
        out.append(f"canary={'no' if no_canary == '1' else 'yes'}: child rc {r.returncode}"
                   f" ({'Abort_op fired' if 'Abort_op' in r.stderr else 'trained'})")
    return "; ".join(out)


def case_abort_inproc():
    fit(Abort(name="abort"))


def case_to_number():
    """A text input read by a (public) StringLookup and parsed by tf.strings.to_number."""
    x = np.array([["1.5"]] * 15 + [["SECRET-ID-4711"]])
    y = np.zeros(16, "int64")
    inp = keras.Input((1,), dtype="string")
    lookup = keras.layers.StringLookup(vocabulary=["1.5"], output_mode="one_hot", name="lk")
    tfdp.preprocessing.declare_public(lookup, source="constant")
    feats = keras.layers.concatenate([lookup(inp), ToNumber(name="to_number")(inp)])
    model = tfdp.DPModel(inp, keras.layers.Dense(3)(feats))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0, seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)


def case_external_var():
    v = tf.Variable(0.0)
    fit(ExternalVar(v, name="ext"))
    return f"external variable now {float(v.numpy())}"


def case_own_running_max():
    fit(OwnRunningMax(name="rmax"))


def case_hash_insert():
    fit(HashInsert(name="hins"))


def case_stateful_rng():
    fit(StatefulRng(name="rng"))


def case_py_function():
    fit(PyFn(name="pyf"))


def case_numpy_function():
    fit(NpFn(name="npf"))


def case_print_file():
    fit(PrintFile(name="pr"))
    p = os.path.join(TMP, "print.txt")
    return f"print file exists={os.path.exists(p)}"


def case_summary():
    fit(Summary(name="summ"))


def case_jit_write():
    fit(JitWrite(name="jitw"))


def case_boolmask_shape_assert():
    fit(BoolMaskShapeAssert(name="bm"))


def _regression_fit(metrics):
    keras.utils.set_random_seed(0)
    x = np.zeros((16, 4), "float32"); y = np.zeros((16, 1), "float32"); y[0, 0] = SECRET
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(1, name="head")])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1), loss="mse", metrics=metrics)
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)
    return model


def _files_hold(model, needle):
    import zipfile, glob
    found = []
    for kind in ("keras", "weights.h5"):
        path = os.path.join(TMP, f"saved.{kind}")
        (model.save if kind == "keras" else model.save_weights)(path)
        blob = open(path, "rb").read()
        if kind == "keras":
            blob += b"".join(zipfile.ZipFile(path).read(n) for n in zipfile.ZipFile(path).namelist())
        found.append(f"{kind}: {needle in blob}")
    return ", ".join(found)


def case_metric_own_variable():
    m = MaxLabel()
    model = _regression_fit([m])
    return (f"metric variable = {float(m.v.numpy())} (the crafted label); canary float32 bytes in "
            f"saved files: {_files_hold(model, np.float32(SECRET).tobytes())}")


class WritesOther(keras.metrics.Metric):
    """update_state writes ANOTHER metric's variable (the known MINOR)."""
    def __init__(self, other, name="writes_other", **kw):
        super().__init__(name=name, **kw)
        self.other = [other]
        self.n = self.add_variable(shape=(), initializer="zeros", name="n")
    def update_state(self, y_true, y_pred, sample_weight=None):
        self.other[0].v.assign(tf.maximum(self.other[0].v, tf.reduce_max(y_true)))
        self.n.assign_add(1.0)
    def result(self):
        return self.n


def case_metric_writes_other_metric():
    first = MaxLabel(name="first")
    _regression_fit([first, WritesOther(first)])
    return f"other metric's variable = {float(first.v.numpy())}"


class ScatterOwn(keras.layers.Layer):
    def build(self, shape):
        self.m = self.add_weight(shape=(4,), initializer="zeros", trainable=False, name="scat")
    def call(self, x, training=None):
        if training:
            tf.raw_ops.ResourceScatterUpdate(resource=self.m.value.handle, indices=tf.constant([0]), updates=tf.reduce_max(x, 0)[:1])
        return x


class DatasetInStep(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.ds = tf.data.Dataset.from_tensors(tf.zeros([4])).repeat()
    def call(self, x, training=None):
        return x + next(iter(self.ds)) if training else x


@tfdp.per_example.declare_per_example
class LocalTensorArray(keras.layers.Layer):
    """A TensorArray made and read inside the step (no state): should be accepted."""
    def call(self, x):
        ta = tf.TensorArray(tf.float32, size=2)
        ta = ta.write(0, x).write(1, 2.0 * x)
        return ta.read(1) - x


def case_scatter_own():
    fit(ScatterOwn(name="scat"))


def case_running_max_jit_compile():
    fit(OwnRunningMax(name="rmax_jit"), jit_compile=True)


def case_dataset_in_step():
    fit(DatasetInStep(name="ds"))


def case_local_tensor_array():
    fit(LocalTensorArray(name="ta"))


CASES = {k[5:]: v for k, v in globals().items() if k.startswith("case_")}

if __name__ == "__main__":
    names = sys.argv[1:] or [n for n in CASES if n != "abort_inproc"]
    for name in names:
        try:
            out = CASES[name]()
            print(f"{name:24s} ACCEPTED {out or ''}")
        except Exception as e:  # noqa
            msg = " ".join(str(e).split())
            print(f"{name:24s} REFUSED  {type(e).__name__}: {msg[:260]}"
                  + ("  [SECRET IN MESSAGE]" if "SECRET" in msg or "98765" in msg else ""))
        sys.stdout.flush()
