"""Data pipelines for DP training: Poisson sampling, sources on disk, datasets.

Example:

```python
from tfdp.data import PoissonSampler, make_dataset, load_dataset

(x_train, y_train), (x_test, y_test) = load_dataset("digits")
sampler = PoissonSampler(len(x_train), expected_batch_size=64)
dataset = make_dataset(sampler, (x_train, y_train))
```
"""

from tfdp.data.datasets import load_dataset, load_digits, load_fashion_mnist
from tfdp.data.poisson import PoissonSampler, make_dataset, padded_batch_size
from tfdp.data.records import read_records, write_records
from tfdp.data.sources import ArraySource, RecordSource
from tfdp.data.users import UserRecords, UserSampler

__all__ = [
    "PoissonSampler",
    "padded_batch_size",
    "make_dataset",
    "RecordSource",
    "ArraySource",
    "write_records",
    "read_records",
    "load_digits",
    "load_fashion_mnist",
    "load_dataset",
    "UserRecords",
    "UserSampler",
]
