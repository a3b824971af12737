"""The 2D scattering transform as a Keras layer (ScatterNet features).

Tramer and Boneh (2021) train private models on the scattering transform of
the images: fixed Morlet wavelet filters, modulus and low-pass averaging, a
transform with no weights, so it costs no privacy and needs no per-example
rule. This layer computes it in TensorFlow with FFT convolutions, so that it
runs inside `fit`, on a GPU, and is exported with the model. It reproduces
kymatio 0.3.0's `Scattering2D` (the reference implementation; see
benchmarks/scattering_reference.py) coefficient for coefficient.

Example:

>>> import numpy as np
>>> layer = Scattering2D(J=2, L=8)
>>> layer(np.zeros([2, 28, 28, 1], "float32")).shape
TensorShape([2, 7, 7, 81])
"""

import keras
import tensorflow as tf

from tfdp.layers.scattering_filters import filter_bank
from tfdp.per_example import declare_per_example


def num_coefficients(J, L, max_order=2):
    """Scattering channels per input channel: 1 + J L (+ L^2 J (J - 1) / 2).

    >>> num_coefficients(2, 8)
    81
    """
    second = L * L * J * (J - 1) // 2 if max_order == 2 else 0
    return 1 + J * L + second


def padded_size(size, J):
    """kymatio's padded size: the next multiple of 2^J above size + 2^J."""
    return ((size + 2**J) // 2**J + 1) * 2**J


def _subsample_fourier(x, k):
    """Spectrum of the signal subsampled by k in both spatial axes: the mean
    of the k x k aliased blocks of the spectrum (summed as slices, which on CPU
    is about twice as fast as a complex reduce_mean over a reshape)."""
    if k == 1:
        return x
    m, n = x.shape[-2] // k, x.shape[-1] // k
    rows = tf.add_n([x[..., a * m:(a + 1) * m, :] for a in range(k)])
    folded = tf.add_n([rows[..., b * n:(b + 1) * n] for b in range(k)])
    return folded / (k * k)


def _modulus_spectrum(spectrum):
    """FFT of |IFFT(spectrum)|: the modulus non-linearity, in Fourier."""
    return tf.signal.fft2d(tf.cast(tf.abs(tf.signal.ifft2d(spectrum)), tf.complex64))


@declare_per_example  # each image's features depend on that image alone
@keras.saving.register_keras_serializable(package="tfdp")
class Scattering2D(keras.layers.Layer):
    """2D scattering transform of images (kymatio's `Scattering2D`, in Keras).

    For each input channel: the order-0 coefficient x * phi, the J L
    first-order |x * psi_(j, theta)| * phi and, with `max_order=2`, the
    L^2 J (J - 1) / 2 second-order ||x * psi_(j1, theta1)| * psi_(j2, theta2)|
    * phi for j2 > j1, each subsampled by 2^J. The image is padded by
    reflection to kymatio's size first. Coefficients are in kymatio's order
    (order 0; order 1 by (j, theta); order 2 by (j1, theta1, j2, theta2)),
    input channel major: output channel c * K + k is kymatio's coefficient k
    of input channel c, K = 1 + J L + L^2 J (J - 1) / 2.

    The layer has no weights and builds its filters from the input's spatial
    size. Tramer and Boneh's setting is J=2, L=8 on pixels in [0, 1]: 28x28x1
    images give 7x7x81 features.

    Args:
        J: number of scales; the output is subsampled by 2^J.
        L: number of wavelet angles.
        max_order: 1 or 2.
        **kwargs: `keras.layers.Layer` arguments (`name`, ...).

    Input shape: [B, H, W, C] (channels last) with H and W known, both >= 2^J.
    Output shape: [B, H // 2^J, W // 2^J, C * K].

    Example:

    >>> import keras
    >>> model = keras.Sequential([keras.Input((28, 28, 1)), Scattering2D(J=2),
    ...                           keras.layers.Flatten(), keras.layers.Dense(10)])
    >>> model.output_shape
    (None, 10)
    """

    def __init__(self, J=2, L=8, max_order=2, **kwargs):
        super().__init__(trainable=False, **kwargs)
        for name, value, low in (("J", J, 1), ("L", L, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(
                    f"Expected `{name}` to be an integer >= {low}. Received: {name}={value!r}"
                )
        if max_order not in (1, 2):
            raise ValueError(f"Expected `max_order` in (1, 2). Received: max_order={max_order!r}")
        self.J = J
        self.L = L
        self.max_order = max_order
        self._bank = None

    def build(self, input_shape):
        if len(input_shape) != 4:
            raise ValueError(
                "Expected a 4D input [batch, height, width, channels]. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        height, width, channels = input_shape[1:]
        if height is None or width is None or channels is None:
            raise ValueError(
                "Scattering2D needs the input's height, width and channels. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        if min(height, width) < 2**self.J:
            raise ValueError(
                f"Expected height and width >= 2^J = {2**self.J}. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        self._padding = []
        for size in (height, width):
            extra = padded_size(size, self.J) - size
            before, after = extra // 2, (extra + 1) // 2
            if after >= size:
                raise ValueError(
                    f"Images are too small for J={self.J}: reflection padding of "
                    f"{after} pixels needs a side > {after}. Received: input_shape="
                    f"{tuple(input_shape)}"
                )
            self._padding.append([before, after])
        self._bank = filter_bank(
            padded_size(height, self.J), padded_size(width, self.J), self.J, self.L
        )
        super().build(input_shape)

    def compute_output_shape(self, input_shape):
        batch, height, width, channels = input_shape
        return (
            batch,
            height // 2**self.J,
            width // 2**self.J,
            channels * num_coefficients(self.J, self.L, self.max_order),
        )

    def _low_pass(self, spectrum, res):
        """Coefficients (real, unpadded) of a spectrum at resolution res."""
        filtered = spectrum * tf.complex(self._bank.phi[res], 0.0)
        filtered = _subsample_fourier(filtered, 2 ** (self.J - res))
        return tf.math.real(tf.signal.ifft2d(filtered))[..., 1:-1, 1:-1]

    def call(self, inputs):
        J, L = self.J, self.L
        _, height, width, channels = inputs.shape
        x = tf.cast(inputs, tf.float32)
        x = tf.reshape(tf.transpose(x, [0, 3, 1, 2]), [-1, height, width])
        x = tf.pad(x, [[0, 0]] + self._padding, mode="REFLECT")
        u0 = tf.signal.fft2d(tf.complex(x, tf.zeros_like(x)))
        paths = [self._low_pass(u0, 0)[:, None]]  # [N, 1, h, w]
        second = []
        for j1 in range(J):
            psi = tf.complex(self._bank.psi[j1][0], 0.0)  # [L, M, N]
            u1 = _modulus_spectrum(_subsample_fourier(u0[:, None] * psi, 2**j1))
            paths.append(self._low_pass(u1, j1))  # [N, L, h, w]
            if self.max_order < 2 or j1 == J - 1:
                continue
            per_j2 = []
            for j2 in range(j1 + 1, J):
                psi2 = tf.complex(self._bank.psi[j2][j1], 0.0)  # [L, m, n]
                u2 = u1[:, :, None] * psi2  # [N, L (theta1), L (theta2), m, n]
                u2 = _modulus_spectrum(_subsample_fourier(u2, 2 ** (j2 - j1)))
                per_j2.append(self._low_pass(u2, j2))
            # (theta1, j2, theta2) order within j1.
            s2 = tf.concat(per_j2, axis=2)
            second.append(tf.reshape(s2, [-1, L * L * (J - 1 - j1), *s2.shape[-2:]]))
        s = tf.concat(paths + second, axis=1)  # [B C, K, h, w]
        k, h, w = s.shape[1:]
        s = tf.reshape(s, [-1, channels, k, h, w])
        s = tf.reshape(tf.transpose(s, [0, 3, 4, 1, 2]), [-1, h, w, channels * k])
        return tf.cast(s, self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(J=self.J, L=self.L, max_order=self.max_order)
        config.pop("trainable", None)
        return config
