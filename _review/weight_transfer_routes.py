"""Routes that move a DP-trained encoder's weights into a second DP model.

Model A (a nested keras.Model encoder 'enc' + head) is trained by DP-SGD;
model B is built on A's encoder weights (by each route below) and trained by
DP-SGD on the same records. B's statement must carry A's training: B's
epsilon should equal the composition (A's steps + B's steps), not B's alone.
Prints, per route, B's epsilon, B alone, the composition, and CARRIED / LOST.
Run: cd /work/wt/review-7 && PYTHONPATH=$PWD python _review/weight_transfer_routes.py
"""
import os, sys, tempfile
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, numpy as np, tensorflow as tf
import tfdp

DELTA = 1e-5
TMP = tempfile.mkdtemp()
rng = np.random.default_rng(0)
X = rng.normal(size=(256, 4)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


def compile_fit(model, steps):
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=0.8),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(X, Y, batch_size=64, epochs=1, steps_per_epoch=steps, verbose=0)
    return model


def encoder(name="enc"):
    inp = keras.Input((4,))
    return keras.Model(inp, keras.layers.Dense(8, activation="tanh", name="enc_dense")(inp), name=name)


def model_on(enc, name):
    inp = keras.Input((4,))
    return tfdp.DPModel(inp, keras.layers.Dense(2, name="head")(enc(inp)), name=name)


def trained_a():
    return compile_fit(model_on(encoder(), "A"), steps=20)


def route_same_layer(a):
    return model_on(a.get_layer("enc"), "B")


def route_submodel_save_weights(a):
    path = os.path.join(TMP, "enc.weights.h5")
    a.get_layer("enc").save_weights(path)        # plain keras.Model.save_weights of the nested encoder
    enc = encoder(); enc.load_weights(path)
    return model_on(enc, "B")


def route_submodel_save_load_model(a):
    path = os.path.join(TMP, "enc.keras")
    a.get_layer("enc").save(path)                 # plain keras save of the nested encoder
    return model_on(keras.models.load_model(path), "B")


def route_functional_from_layers(a):
    inp = keras.Input((4,))
    feats = keras.Model(inp, a.get_layer("enc")(inp), name="feats")
    path = os.path.join(TMP, "feats.keras"); feats.save(path)
    return model_on(keras.models.load_model(path), "B")


def route_tf_checkpoint(a):
    prefix = tf.train.Checkpoint(enc=a.get_layer("enc")).save(os.path.join(TMP, "ck"))
    enc = encoder(); tf.train.Checkpoint(enc=enc).restore(prefix).expect_partial()
    return model_on(enc, "B")


def route_dp_save_weights_skip_mismatch(a):
    path = os.path.join(TMP, "a.weights.h5"); a.save_weights(path)
    b = model_on(encoder(), "B")
    b.load_weights(path, skip_mismatch=True)
    return b


def route_dp_load_model_then_layer(a):
    path = os.path.join(TMP, "a.keras"); a.save(path)
    return model_on(tfdp.load_model(path).get_layer("enc"), "B")


ROUTES = {k[6:]: v for k, v in globals().items() if k.startswith("route_")}

if __name__ == "__main__":
    solo = compile_fit(model_on(encoder("fresh"), "solo"), steps=20).privacy.epsilon(DELTA)
    a_eps = None
    for name in sys.argv[1:] or ROUTES:
        keras.utils.set_random_seed(0)
        a = trained_a(); a_eps = a.privacy.epsilon(DELTA)
        try:
            b = compile_fit(ROUTES[name](a), steps=20)
            e = b.privacy.epsilon(DELTA)
            both = e > solo * 1.2
            print(f"{name:36s} B eps {e:.3f} (B alone {solo:.3f}, A {a_eps:.3f}) "
                  f"{'CARRIED' if both else 'LOST: statement omits A'}")
        except Exception as err:  # noqa
            print(f"{name:36s} REFUSED {type(err).__name__}: {' '.join(str(err).split())[:200]}")
        sys.stdout.flush()
