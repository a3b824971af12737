"""Whether tfdp's error messages may quote record values.

An error message reaches whoever reads a traceback, a log or a notebook's
output, which no epsilon covers, so tfdp's messages name a record by its
position, type or shape and withhold its values: the step's op errors
(`tfdp.models.step_errors`), the data sources' reading errors
(`tfdp.data.sources`, `tfdp.data.records`) and fit's checks
(`tfdp.models.input_checks`). Setting the environment variable
`TFDP_SHOW_STEP_ERRORS=1` shows the values, for debugging on data that is
not private. Read on every error, so a change takes effect at once; this
module imports nothing, so every part of tfdp can ask it.

Example:

>>> import os
>>> os.environ.pop(SHOW_ENV, None) and None
>>> record_values_shown()
False
"""

import os

SHOW_ENV = "TFDP_SHOW_STEP_ERRORS"


def record_values_shown():
    """Whether errors may quote record values: `TFDP_SHOW_STEP_ERRORS=1`."""
    return os.environ.get(SHOW_ENV) == "1"
