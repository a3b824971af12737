"""An encoder whose weights carry a DP training, and a DP model built on a
layer (the encoder, or a TFSMLayer of its export), for the carried-ledger
tests of `.keras`/`.weights.h5` files and SavedModels."""

import keras

import tfdp


def encoder(name="enc"):
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(8, activation="tanh", name="enc_dense")(inputs),
                       name=name)


def model_on(layer, name):
    inputs = keras.Input((4,))
    return tfdp.DPModel(inputs, keras.layers.Dense(2, name="head")(layer(inputs)), name=name)
