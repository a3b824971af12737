"""tfdp: differentially private training for Keras 3 on TensorFlow.

Two changes to a Keras script make it private:

>>> import keras, tfdp
>>> model = tfdp.DPSequential([keras.Input((64,)), keras.layers.Dense(10)])
>>> model.compile(
...     optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.1),
...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

Then `model.fit(...)` trains on Poisson-sampled batches with clipped, noised
per-example gradients, and `model.privacy.epsilon(delta=1e-5)` reads the
privacy ledger. `tfdp.accounting` answers privacy questions without training.
"""

from tfdp import accounting, callbacks, optimizers
from tfdp.models import DPModel, DPSequential

__version__ = "0.1.0"

__all__ = ["DPModel", "DPSequential", "accounting", "callbacks", "optimizers"]
