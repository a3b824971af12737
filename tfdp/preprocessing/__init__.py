"""Preprocessing state with a provenance: adapted privately or declared public.

Keras preprocessing layers (`StringLookup`, `IntegerLookup`,
`TextVectorization`, `Normalization`, `Discretization`) keep state computed
from data, and the trained model carries it. `DPModel.fit` accepts such a
layer only if its state was adapted privately (`adapt_privately`, charged
to the model's privacy ledger) or declared public (`declare_public`); both
are named in the privacy statement. Anything else is refused before the
first step (`provenance`).

Example:

>>> import keras, numpy as np
>>> from tfdp import preprocessing
>>> words = keras.layers.StringLookup(name="word")
>>> words.adapt(np.array(["a", "b"]))
>>> preprocessing.declare_public(words, source="a public word list")["kind"]
'public'
"""

from tfdp.preprocessing.private_adapt import adapt_privately
from tfdp.preprocessing.provenance import charge_pending, check_model, declare_public

__all__ = ["adapt_privately", "charge_pending", "check_model", "declare_public"]
