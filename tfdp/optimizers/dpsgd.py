"""`DPSGD`: DP-SGD (Abadi et al. 2016) with keras.optimizers.SGD's arguments."""

import keras

from tfdp.optimizers.dp_optimizer import DPOptimizer, noise_multiplier_or_default


@keras.saving.register_keras_serializable(package="tfdp")
class DPSGD(DPOptimizer):
    """DP-SGD: `DPOptimizer` around `keras.optimizers.SGD`.

    Args:
        learning_rate: float or `keras.optimizers.schedules` schedule
            (default 0.01, as SGD).
        momentum: float >= 0 (default 0), as SGD.
        nesterov: bool (default False), as SGD.
        l2_norm_clip: clipping bound C > 0 on each example's gradient norm.
        noise_multiplier: sigma > 0 (noise std sigma * C on the clipped sum;
            default 1.0, or chosen by `fit` with `target_epsilon`).
        target_unclipped_quantile: None (fixed C) or gamma in (0, 1): C
            starts at `l2_norm_clip` and follows the gamma quantile of the
            gradient norms (adaptive clipping, Andrew et al. 2021; same
            epsilon as fixed clipping at `noise_multiplier`). See
            `DPOptimizer`, as for `clip_learning_rate` (default 0.2),
            `clipped_count_stddev` (default batch_size / 20) and
            `clip_update` ("geometric").
        weight_decay: see `DPOptimizer`, as are `weight_decay_placement`,
            `seed`, `name`, `target_epsilon`, `target_delta` and
            `sparse_embeddings`.
        use_ema, ema_momentum, ema_overwrite_frequency: as SGD (default
            False, 0.99, None): keep an exponential moving average of the
            weights, swapped into the model at the end of `fit` (and for
            validation with `keras.callbacks.SwapEMAWeights`). The average is
            a function of the noisy updates only, so it is post-processing:
            the privacy ledger is unchanged (docs/guides/augmentation.md).

    Example (the Fashion-MNIST settings of SA-DPSGD's Table 2):

    >>> import tfdp
    >>> opt = tfdp.optimizers.DPSGD(learning_rate=4.0, l2_norm_clip=0.1,
    ...                             noise_multiplier=2.15)
    >>> float(opt.learning_rate)
    4.0

    Adaptive clipping to the median norm (C logged as `clip_norm` by fit):

    >>> opt = tfdp.optimizers.DPSGD(learning_rate=0.5, l2_norm_clip=1.0,
    ...                             noise_multiplier=1.1, target_unclipped_quantile=0.5)
    >>> opt.clip_learning_rate, opt.clip_update
    (0.2, 'geometric')
    """

    def __init__(
        self,
        learning_rate=0.01,
        momentum=0.0,
        nesterov=False,
        l2_norm_clip=1.0,
        noise_multiplier=None,
        weight_decay=0.0,
        weight_decay_placement="before_clip",
        seed=None,
        name=None,
        target_unclipped_quantile=None,
        clip_learning_rate=None,
        clipped_count_stddev=None,
        clip_update="geometric",
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        **kwargs,
    ):
        inner = keras.optimizers.SGD(
            learning_rate=learning_rate, momentum=momentum, nesterov=nesterov,
            use_ema=use_ema, ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
        )
        super().__init__(
            inner,
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier_or_default(noise_multiplier, kwargs),
            weight_decay=weight_decay,
            weight_decay_placement=weight_decay_placement,
            seed=seed,
            name=name,
            target_unclipped_quantile=target_unclipped_quantile,
            clip_learning_rate=clip_learning_rate,
            clipped_count_stddev=clipped_count_stddev,
            clip_update=clip_update,
            **kwargs,
        )

    def get_config(self):
        config = super().get_config()
        inner = config.pop("inner_optimizer")["config"]
        config.update(
            learning_rate=inner["learning_rate"],
            momentum=inner["momentum"],
            nesterov=inner["nesterov"],
            use_ema=inner["use_ema"],
            ema_momentum=inner["ema_momentum"],
            ema_overwrite_frequency=inner["ema_overwrite_frequency"],
        )
        return config
