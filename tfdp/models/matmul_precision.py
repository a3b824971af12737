"""Matmuls that TensorFlow rewrites to lower precision are refused in a DP fit.

The rounding bounds that make clipping hold for any record (the per-example
page's "Why clipping holds") assume that a float32 matmul rounds as float32:
unit roundoff 2^-24. Grappler's automatic mixed precision options
(`auto_mixed_precision`, `auto_mixed_precision_onednn_bfloat16` and its old
name `auto_mixed_precision_mkl`, `auto_mixed_precision_cpu`) rewrite float32
matmuls to float16 or bfloat16 inputs and outputs when the step is compiled,
where tfdp cannot see it: a crafted record then moved the clipped sum 1.56
times the clip norm (a review of this round). `fit` refuses them before the
first step; Keras's own mixed precision (`keras.mixed_precision`) is what a
DP model uses instead, and its rounding is covered.

Example:

>>> rewriting_options({"auto_mixed_precision_onednn_bfloat16": True,
...                    "disable_meta_optimizer": False})
['auto_mixed_precision_onednn_bfloat16']
"""

import tensorflow as tf


def rewriting_options(options):
    """The automatic mixed precision options switched on in `options` (a dict
    of `tf.config.optimizer.get_experimental_options()`), sorted."""
    return sorted(name for name, value in options.items()
                  if name.startswith("auto_mixed_precision") and value)


def refuse_rewritten_matmuls(model):
    """Raises ValueError if Grappler would rewrite the DP step's float32
    matmuls to a lower precision."""
    found = rewriting_options(tf.config.optimizer.get_experimental_options())
    if found:
        raise ValueError(
            f"Model '{model.name}' cannot train privately while TensorFlow's automatic mixed "
            f"precision rewrite is on ({', '.join(found)}): it computes float32 matmuls in "
            "float16 or bfloat16 when the step is compiled, outside the rounding bounds that "
            "make clipping hold for every record. Switch it off "
            "(tf.config.optimizer.set_experimental_options({name: False})) and use Keras's "
            "mixed precision instead (keras.mixed_precision.set_global_policy"
            "('mixed_bfloat16')). Received: " + ", ".join(f"{name}=True" for name in found)
        )
