"""A compiled DP step adds noise of exactly the claimed standard deviation.

The ledger charges noise multiplier sigma; the step must add N(0, (sigma C)^2)
to every coordinate of the clipped sum, not 0.99 of it. The model's inputs
are 0, so every per-example gradient is 0 and the update of plain SGD with
learning rate 1 is minus the noise divided by the expected batch size: 2M
noise draws in one step, whose sample standard deviation has a relative
standard error of 1 / sqrt(2 * 2M) = 0.05%. The check allows 0.3% (6 standard
errors): the std scaled by 0.99 is off by 1% (20 standard errors).
"""

import keras
import numpy as np

import tfdp

CLIP, SIGMA, BATCH = 0.5, 1.3, 8
TOLERANCE = 0.003


class QuieterDPSGD(tfdp.optimizers.DPSGD):
    """Negative control: adds 0.99 of the noise it claims."""

    def noise_stddev(self):
        return 0.99 * super().noise_stddev()


def noise_of_one_step(optimizer_class):
    """The noise one compiled step added to the clipped sum (all gradients 0)."""
    model = tfdp.DPSequential(
        [keras.Input((1000,)), keras.layers.Dense(2000, use_bias=False, kernel_initializer="zeros")]
    )
    model.compile(
        optimizer=optimizer_class(1.0, l2_norm_clip=CLIP, noise_multiplier=SIGMA, seed=11),
        loss="mse",
    )
    x = np.zeros((BATCH, 1000), np.float32)
    y = np.ones((BATCH, 2000), np.float32)  # a nonzero loss: gradients are 0 only through x
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=1, verbose=0)
    assert model.privacy.steps == 1
    # update = -(sum + noise) / b with sum = 0, learning rate 1.
    return -model.layers[-1].kernel.numpy().astype(np.float64) * BATCH


def test_step_adds_the_claimed_noise_std_to_0_3_percent():
    noise = noise_of_one_step(tfdp.optimizers.DPSGD)
    claimed = SIGMA * CLIP
    assert abs(noise.mean()) < 6 * claimed / np.sqrt(noise.size)
    assert abs(noise.std() / claimed - 1) < TOLERANCE, noise.std() / claimed
    # Negative control: 0.99 of the noise, through the same step, fails the check.
    quieter = noise_of_one_step(QuieterDPSGD)
    assert abs(quieter.std() / claimed - 1) > TOLERANCE, quieter.std() / claimed
