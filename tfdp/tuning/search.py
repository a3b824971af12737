"""`PrivateRandomSearch`: a KerasTuner-style random search charged as one DP release.

A search draws the number of trials K from a law (Papernot & Steinke, ICLR
2022), draws every trial's hyperparameters independently, trains each trial
with DP, scores it by a noisy count on a validation split carved from the
private data (or exactly, on data declared public), keeps the best and
charges its ledger one `RepeatAndSelectDpEvent` over a trial's releases
(`tfdp.accounting.search`, `PrivacyLedger.charge_selection`). The chosen
model, its hyperparameters and its score are the output; the other trials'
models and scores, and K, stay in the child process that runs the search
(`tfdp.tuning.process`).

Example:

>>> import keras, numpy as np, tfdp
>>> x = np.random.default_rng(0).normal(size=(200, 4)).astype("float32")
>>> y = (x[:, 0] > 0).astype("int32")
>>> def build(hp):
...     model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
...     model.compile(
...         optimizer=tfdp.optimizers.DPSGD(
...             hp.Float("learning_rate", 0.1, 1.0, sampling="log"),
...             l2_norm_clip=1.0, noise_multiplier=1.0),
...         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
...     return model
>>> tuner = PrivateRandomSearch(build, mean_trials=2, distribution="geometric")
>>> tuner.search(x, y, batch_size=40, epochs=1, validation_split=0.2)
>>> model = tuner.get_best_models()[0]
>>> "private hyperparameter search" in model.privacy.statement(delta=1e-5)
True
"""

import weakref

import dp_accounting
import keras_tuner
import numpy as np

from tfdp.accounting._validation import check_real, show
from tfdp.accounting.search import (
    check_mean_trials,
    draw_trial_count,
    repeat_and_select_event,
    trial_count_shape,
)
from tfdp.models import input_checks
from tfdp.tuning import hiding, hyperparameters, process, scores, settings

# Tests that patch what a trial calls run the search in their own process;
# everyone else runs it in a child process (tfdp.tuning.process).
_IN_PROCESS = False


class PrivateRandomSearch:
    """Random search over a KerasTuner hypermodel, private as a whole.

    Args:
        hypermodel: `build(hp)` returning a NEW compiled `tfdp.DPModel` /
            `tfdp.DPSequential` (DPSGD or DPOptimizer, a fixed
            `noise_multiplier`, no seed), or a `keras_tuner.HyperModel`.
            Hyperparameters are KerasTuner's (`hp.Float`, `hp.Choice`, ...);
            those that change the privacy event (noise multiplier, optimizer
            class) must not vary: a search whose trials could differ is
            refused, naming the hyperparameter.
        mean_trials: the expected number of trials, >= 1. The number drawn
            is secret; the cost grows with the mean (see the guide).
        distribution: the law of the number of trials: "geometric"
            (default), "poisson", "logarithmic" or "negative_binomial".
        shape: the negative binomial's shape (0, inf); only with that law.
        score: optional `fn(y_true, y_pred)` returning one value per
            example, clipped to [0, 1]; higher is better. It is called on
            one validation example at a time (batches of one, shape (1,)
            returned), and the model predicts each example alone.
            Default: accuracy (arg-max class equals the label).
        score_noise_multiplier: sigma of the Gaussian noise on the sum of
            the per-example scores of private validation data (default 10:
            the score's standard deviation is 10 / n_validation).
        max_trials: refused unless None: a fixed number of trials has no
            repeat-and-select bound (use `mean_trials`).

    A search that drew its number of trials and released no model (a
    Poisson search that drew none, or one that failed or was stopped in a
    trial) spends the tuner: it refuses another search, since retrying
    until a model is released changes the law of the number of trials.

    Only `get_best_models()`, `get_best_hyperparameters()` and `best_score`
    release results; they are safe to print. The number of trials and the
    search's duration are not released (the wall-clock time of `search`
    grows with it: do not publish it). `search` runs the trials in a child
    process (`tfdp.tuning.process`), so that TensorFlow's process-wide
    counters in yours do not count them: the hypermodel and the score must
    be picklable with cloudpickle, and an error in a trial comes back with
    its type but not its message.
    """

    def __init__(self, hypermodel, mean_trials=None, distribution="geometric", shape=None,
                 score=None, score_noise_multiplier=10.0, max_trials=None):
        if max_trials is not None:
            raise ValueError(
                "A private search draws the number of trials at random: best-of-K with a "
                "fixed K has no repeat-and-select bound (Papernot & Steinke 2022), and it "
                "costs about K times one trial. Pass mean_trials instead (the expected "
                f"number of trials), e.g. PrivateRandomSearch(build, mean_trials={show(max_trials)}). "
                f"Received: max_trials={show(max_trials)}"
            )
        if mean_trials is None:
            raise ValueError(
                "A private search needs `mean_trials`, the expected number of trials (the "
                "number run is drawn at random and kept secret), e.g. "
                "PrivateRandomSearch(build, mean_trials=5). Received: mean_trials=None"
            )
        self._build = hyperparameters.build_function(hypermodel)
        self.mean_trials = check_mean_trials(mean_trials)
        self.distribution = distribution
        self.shape = trial_count_shape(distribution, shape)
        if score is not None and not callable(score):
            raise TypeError(f"Expected `score` to be callable or None. Received: score={score!r}")
        self._score = scores.accuracy if score is None else score
        self.score_noise_multiplier = check_real(
            "score_noise_multiplier", score_noise_multiplier, low=0.0)
        self._searches = []  # the event of every search this tuner ran: a rerun pays again
        self._best = None
        # A search drew its number of trials and released no model: no retry on this tuner.
        self._released_nothing = False

    def search_space_summary(self):
        """The search space and the law of the number of trials, as text.

        Builds the hypermodel once at its defaults (no data is read, so the
        summary is safe to print). Like KerasTuner's, but returned: print
        it.

        Example: `print(tuner.search_space_summary())`.
        """
        hp = keras_tuner.HyperParameters()
        self._build(hp)
        law = self.distribution + (f" (shape {self.shape:g})" if self.distribution ==
                                   "negative_binomial" else "")
        lines = [f"Search space: {len(hp.space)} hyperparameters; the number of trials is "
                 f"drawn from the {law} law with mean {self.mean_trials:g} (kept secret)"]
        for h in hp.space:
            config = h.get_config()
            shown = {k: v for k, v in config.items()
                     if k not in ("name", "conditions") and v is not None}
            lines.append(f"{h.name} ({type(h).__name__}): " + ", ".join(
                f"{k}={v!r}" for k, v in shown.items()))
        return "\n".join(lines)

    # -- the search ----------------------------------------------------------

    def search(self, x, y, batch_size, epochs=1, validation_split=None, validation_data=None,
               validation_data_is_public=False, physical_batch_size=None, **kwargs):
        """Runs the search; the best model is `get_best_models()[0]`.

        Args:
            x, y: the private training data (arrays; N = len(x) is public).
            batch_size, epochs, physical_batch_size: as in `DPModel.fit`,
                the same for every trial.
            validation_split: the probability that a trial holds a record
                out to score on, with noise (each record drawn independently,
                fresh for every trial). Every trial samples its batches from
                all N records at rate batch_size / N, the held-out ones with
                weight 0: a batch holds batch_size * (1 - validation_split)
                training records on average.
            validation_data: (x_val, y_val) instead: scored with noise, or
                exactly when `validation_data_is_public=True` (then it must
                be data you could publish; no charge for the score).
            kwargs: refused (callbacks, verbose, ...): a callback that stops
                or steers a trial from its metrics makes its privacy cost
                depend on the data, and logs would count the trials.

        Raises:
            ValueError: for a fixed number of trials, trials whose privacy
                settings could differ (before any record is read), missing
                or contradictory validation arguments, and a non-private
                score of private data.
            TypeError: for a hypermodel, score or data that cannot be
                pickled for the child process.
            Exception: any error of a trial comes back with its type and a
                message that does not count the trials.
        """
        if self._released_nothing:
            raise ValueError(
                _RELEASED_NOTHING + " The tuner refuses another search: searching until one "
                "releases a model changes the law of the number of trials (the Poisson law "
                "conditioned on K >= 1 has a larger mean than the one charged), and a failure "
                "can depend on the data. That search still counts: if it drew no trial or "
                "failed for a reason that does not depend on the data, add one search's "
                "epsilon (tfdp.tuning.search_epsilon) to any later search's, in any tuner; "
                "a failure caused by one record is covered by no epsilon. The geometric, "
                "logarithmic and negative binomial laws always run a trial."
            )
        if kwargs:
            raise ValueError(
                "search() takes only the data, batch_size, epochs, physical_batch_size and "
                "the validation arguments: callbacks that stop or steer a trial from its "
                "metrics would make its privacy cost depend on the data, and progress output "
                f"would count the trials. Received: {sorted(kwargs)}"
            )
        validation = _Validation(x, y, validation_split, validation_data,
                                 validation_data_is_public, self.score_noise_multiplier)
        num_examples = validation.num_examples
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or not 1 <= batch_size <= num_examples:
            raise ValueError(
                f"Expected `batch_size` to be an int in [1, {num_examples}] (the records each "
                f"trial samples from). Received: batch_size={show(batch_size)}"
            )
        self._best = None
        trials = Trials(self._build, self._score, self.mean_trials, self.distribution,
                        self.shape, validation, batch_size, epochs, physical_batch_size,
                        earlier=tuple(self._searches), draw_count=draw_trial_count)
        try:
            outcome = trials.run_here() if _IN_PROCESS else process.run(trials)
        except BaseException:
            self._released_nothing = trials.count_drawn  # failed or stopped after the draw
            raise
        if outcome is None:  # the Poisson law drew no trial: nothing is released
            self._released_nothing = True
            return
        model, hp, score, event = outcome
        self._searches.append(event)
        self._best = (model, hp, score)

    # -- results (the only releases) ------------------------------------------

    def _chosen(self):
        if self._released_nothing:
            raise ValueError(_RELEASED_NOTHING)
        if self._best is None:
            raise ValueError(
                "No model to return: call search() first."
            )
        return self._best

    def get_best_models(self, num_models=1):
        """[the chosen model]: its ledger charges the whole search."""
        _only_one(num_models, "num_models")
        return [self._chosen()[0]]

    def get_best_hyperparameters(self, num_trials=1):
        """[the chosen trial's keras_tuner.HyperParameters]."""
        _only_one(num_trials, "num_trials")
        return [self._chosen()[1]]

    @property
    def best_score(self):
        """The chosen trial's score (noisy for private validation data)."""
        return self._chosen()[2]


_RELEASED_NOTHING = (
    "No model to return: this tuner's last search drew its number of trials and released "
    "no model (it drew no trial, which the Poisson law does with probability "
    "exp(-mean_trials), or it failed or was stopped after the draw)."
)


class Trials:
    """One search's trials: drawn, checked, trained and scored where `run` is
    called (in the search's child process: `tfdp.tuning.process`).

    `run` returns the chosen trial's model, charged the whole search, with
    its training history and metric states cleared (the compiled metrics
    counted the held-out rows, which train with weight 0), its
    `keras_tuner.HyperParameters`, its score, the search's event and Keras's
    name counters after its build; or None when no trial was drawn.
    `count_drawn` turns True when the number of trials is drawn: an error
    raised before that cannot depend on it.
    """

    def __init__(self, build, score, mean_trials, distribution, shape, validation, batch_size,
                 epochs, physical_batch_size, earlier, draw_count):
        self.build, self.score = build, score
        self.mean_trials, self.distribution, self.shape = mean_trials, distribution, shape
        self.validation, self.batch_size, self.epochs = validation, batch_size, epochs
        self.physical_batch_size = physical_batch_size
        self.earlier, self.draw_count = earlier, draw_count
        self.count_drawn = False

    def run(self, counters):
        """(model, hp, score, event, names) of the chosen trial, or None."""
        best = self._search(counters)
        if best is None:
            return None
        model, hp, score, trial_event, names = best
        event = repeat_and_select_event(trial_event, self.mean_trials, self.distribution,
                                        None if self.distribution != "negative_binomial"
                                        else self.shape)
        model.privacy.charge_selection(event, earlier=self.earlier)
        model.reset_metrics()
        model.history = None
        return model, hp, score, event, names

    def run_here(self):
        """(model, hp, score, event) from `run` in this process, for tests
        that patch what a trial calls: TensorFlow's process-wide counters
        then count the trials."""
        counters = hiding.NameCounters()
        failure = None
        try:  # nothing that depends on the number of trials outlives this block
            with hiding.quiet_trials():
                outcome = self.run(counters)
        except BaseException as error:  # noqa: BLE001 - Ctrl-C too: its frames hold the trials
            failure = hiding.without_frames(error)
            counters.leave()
        if failure is not None:
            raise failure
        if outcome is None:
            counters.leave()
            return None
        counters.leave(outcome[-1])
        return outcome[:-1]

    def _search(self, counters):
        """Draws the trials, checks them all before any record is read, runs them."""
        rng = np.random.default_rng()  # fresh OS entropy; K and the draws are never kept
        num_examples = self.validation.num_examples
        batch_size = self.batch_size

        def build(hp):
            return counters.build(self.build, hp)

        def setting_at(values):
            return settings.privacy_setting(_build_at(build, values), num_examples, batch_size)

        default_values, default_model = hyperparameters.defaults(build)
        reference = settings.privacy_setting(default_model, num_examples, batch_size)
        self.validation.check_against(default_model)  # before the draw: its message is kept
        checked = _checked_against(default_model)
        del default_model
        trials = []
        owned = _Owned()
        self.count_drawn = True
        for _ in range(self.draw_count(rng, self.mean_trials, self.shape)):
            values, model = hyperparameters.draw(build, rng)  # checked before any record is read
            if settings.privacy_setting(model, num_examples, batch_size) != reference:
                names = settings.differing(setting_at, reference, values, default_values)
                raise hiding.Refusal(
                    "Every trial of a private search must release the same privacy event, "
                    "but these hyperparameters change it: "
                    f"{', '.join(names)} (drawn {', '.join(f'{n}={values[n]!r}' for n in names)}"
                    f"; the defaults give {reference}). Fix them, or run one search per "
                    "setting (each charged). Received: a search space whose trials differ in "
                    "their privacy setting"
                )
            drawn = _checked_against(model)
            if drawn != checked:
                raise hiding.Refusal(
                    "Every trial of a private search must keep the Input dtypes, Embedding "
                    "vocabularies and output shapes of its default trial, against which the ids "
                    "and labels were checked before the search drew its trials (a trial failing "
                    "on one record would reveal it). Received: ((dtype, input_dims) per input, "
                    f"output shapes) {drawn} drawn, {checked} by default"
                )
            settings.check_fresh(model)
            owned.check_and_add(model)
            trials.append(values)
        return self._train(trials, rng, build, counters, reference)

    def _train(self, trials, rng, build, counters, reference):
        """Trains and scores every trial; keeps only the best (None for no trial)."""
        validation, batch_size = self.validation, self.batch_size
        best = None
        trial_event = None
        owned = _Owned()
        for values in trials:
            hp, model = hyperparameters.rebuild(build, values)
            names = counters.after()
            if settings.privacy_setting(model, validation.num_examples, batch_size) != reference:
                raise RuntimeError(
                    "build(hp) gave a different privacy setting for the same hyperparameter "
                    "values: it must depend on nothing but hp."
                )
            settings.check_fresh(model)
            owned.check_and_add(model)
            (x_train, y_train, weights), (x_val, y_val) = validation.split(rng)
            model.fit(x_train, y_train, sample_weight=weights, batch_size=batch_size,
                      epochs=self.epochs, verbose=0,
                      physical_batch_size=self.physical_batch_size)
            values_ = scores.per_example(self.score, y_val, scores.predict_each(model, x_val))
            score, score_event = scores.release_score(values_, validation.count,
                                                      validation.noise, rng)
            released = model.privacy.composed_event().events + (
                [] if score_event is None else [score_event])
            event = dp_accounting.ComposedDpEvent(released)
            if trial_event is None:
                trial_event = event
            elif event != trial_event:
                raise RuntimeError(
                    "Two trials released different privacy events although their settings "
                    "agreed; refusing to charge the search as repeats of one mechanism."
                )
            if best is None or score > best[2]:
                best = (model, hp, score, trial_event, names)
            del model
        return best


def _checked_against(model):
    """What a search checks the data against before its draw: each Input's
    dtype and Embedding vocabularies, and the model's output shapes."""
    return (input_checks.embedding_vocabularies(model),
            [tuple(output.shape[1:]) for output in model.outputs])


def _only_one(number, name):
    if number != 1:
        raise ValueError(
            "A private search releases only its best trial: the others' models, scores "
            f"and their number are part of what the guarantee hides. Received: {name}={number!r}"
        )


def _build_at(build, values):
    import keras_tuner

    hp = keras_tuner.HyperParameters()
    hp.values.update(values)
    return build(hp)


class _Owned:
    """Refuses a trial model that shares a model, optimizer or variable with an
    earlier trial (training that one would change the kept model, or carry a
    discarded trial's data into another). Holds weak references only."""

    def __init__(self):
        self._refs = {}

    def _objects(self, model):
        return [model, model.optimizer, *model.variables]

    def check_and_add(self, model):
        for item in self._objects(model):
            ref = self._refs.get(id(item))
            if ref is not None and ref() is item:
                raise hiding.Refusal(
                    "build(hp) must create a new model, optimizer and weights for every "
                    "trial: this trial shares "
                    f"{getattr(item, 'path', None) or type(item).__name__} with an earlier "
                    "one, so one trial's training would leak into another's (or into the "
                    "chosen model). Received: a build function that reuses objects"
                )
        for item in self._objects(model):
            self._refs[id(item)] = weakref.ref(item)


class _Validation:
    """Where trials train and what they score on."""

    def __init__(self, x, y, split, data, public, noise):
        self._x, self._y = np.asarray(x), np.asarray(y)
        total = len(self._x)
        if len(self._y) != total or total == 0:
            raise ValueError(
                f"Expected x and y with the same, non-zero number of records. Received: "
                f"{total} and {len(self._y)}"
            )
        if (split is None) == (data is None):
            raise ValueError(
                "Give exactly one of validation_split (held out from the private data, "
                "scored with noise) and validation_data. Received: "
                f"validation_split={show(split)}, validation_data="
                f"{'None' if data is None else '(...)'}"
            )
        if public and data is None:
            raise ValueError(
                "validation_data_is_public=True names public validation data, but a split of "
                "the private training data is private. Received: validation_split="
                f"{show(split)}"
            )
        self.noise = None if public else noise
        self.num_examples = total
        self._data = None
        self._fraction = None
        if data is not None:
            x_val, y_val = data
            self._data = (np.asarray(x_val), np.asarray(y_val))
            self.count = len(self._data[0])
            if self.count == 0 or len(self._data[1]) != self.count:
                raise ValueError(
                    "Expected validation_data (x_val, y_val) with the same, non-zero number of "
                    "records: a trial's score is a mean over them. Received: "
                    f"{self.count} and {len(self._data[1])} records"
                )
        else:
            self._fraction = check_real("validation_split", split, low=0.0, high=1.0)
            self.count = self._fraction * total  # public: the split's realised size is not

    def check_against(self, model):
        """Refuses labels out of the range of `model`'s outputs and ids beyond
        the vocabulary of an Embedding that an input feeds, as `fit` does
        (`input_checks`): a trial that failed on one record would reveal it."""
        if not getattr(model, "outputs", None):
            raise ValueError(
                "build(hp) must return a model whose inputs and outputs are known before it "
                "trains (start it with keras.Input), so that the search can check the labels "
                "and ids before it draws its trials: a trial failing on one record would reveal "
                f"it. Received: {type(model).__name__} '{model.name}' without outputs"
            )
        units = model.outputs[0].shape[-1]
        input_checks.check_label_values(self._y, units)
        input_checks.check_embedding_ids(model, self._x)
        if self._data is not None:
            input_checks.check_label_values(self._data[1], units, "validation_data's y")
            input_checks.check_embedding_ids(model, self._data[0], "validation_data's x")

    def split(self, rng):
        """((x, y, sample_weight), (x_val, y_val)) for one trial.

        A split of the private data holds out each record independently with
        probability `validation_split` (fresh draws each trial): one record
        changes no other record's side. Every trial then trains on all N
        rows at rate batch_size / N, the held-out ones with weight 0, so the
        rate and the batch size do not depend on how many were held out.
        """
        if self._data is not None:
            return (self._x, self._y, None), self._data
        held_out = rng.random(len(self._x)) < self._fraction
        weights = (~held_out).astype(np.float32)
        return (self._x, self._y, weights), (self._x[held_out], self._y[held_out])
