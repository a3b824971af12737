"""A test double shared by the tests: DP-SGD with its noise removed.

With no noise one step's update is the clipped mean exactly, so a test can
compare two runs of a step (eager and XLA, chunked and unsplit) or a DP step
with plain SGD.

Example: `model.compile(optimizer=NoiselessDPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), ...)`.
"""

import tfdp


class NoiselessDPSGD(tfdp.optimizers.DPSGD):
    """DPSGD whose noise standard deviation is 0."""

    def noise_stddev(self):
        return 0.0
