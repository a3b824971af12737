"""What SA-DPSGD's check that the energy set is not training data catches
(issue 14, item 5): exact duplicates only, and the documentation says so."""

import os

import numpy as np
import pytest

from tfdp.data import public
from tfdp.optimizers import sadpsgd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_check_catches_exact_duplicates_only_and_says_so():
    """Broken variant caught: documentation promising more than the check
    does (the old docstring and README did not say that a near-copy of a
    training record passes)."""
    rng = np.random.default_rng(0)
    train = rng.normal(size=(50, 4)).astype(np.float32)
    copied = train[:3].copy()
    with pytest.raises(ValueError, match="3 of the 3 examples"):
        public.check_disjoint_from_training_data(public.row_hashes(copied), train, "x", "It steers")
    # One float32 rounding step away: the same record for any practical
    # purpose, and the check does not see it.
    nudged = np.nextafter(copied, np.float32(np.inf))
    public.check_disjoint_from_training_data(public.row_hashes(nudged), train, "x", "It steers")
    assert "EXACT duplicates only" in public.check_disjoint_from_training_data.__doc__
    assert "only exact duplicates" in sadpsgd.SADPSGD.__doc__
    with open(os.path.join(ROOT, "docs", "mechanisms", "sadpsgd.md"), encoding="utf-8") as page:
        assert "detects exact duplicates\nonly" in page.read()
