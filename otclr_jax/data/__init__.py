"""Host input pipeline: whole datasets as uint8 arrays, deterministic batches.

A split is prepared once into a uint8 array `[N, S, S, 3]` plus int32 labels
(`sources`, decoded by `folder`, `tfds_sources` and `images`), cached under
`data_dir` bound to what it was made from (`cache`), and batched on the host
(`batches`); augmentation and the cast to float happen on the accelerator.
`check_evaluable` checks an evaluation dataset before training starts.

Memory: there is no streaming mode. A split whose uint8 array would exceed
`images.MAX_IN_MEMORY_BYTES` (8 GiB, e.g. imagenet2012 train at 64 px) is
refused before anything is decoded; imagenet2012 at 32 px (3.9 GB) and
imagenet300 up to 96 px fit. Only this package imports tensorflow-datasets,
and only to prepare a tfds dataset or decode a folder through ImageFolder:
reading a cache, `digits` and `folder:` datasets work without TensorFlow.

Errors a user can fix are `DataError`s (a ValueError) whose message is one
line naming the dataset, split, sizes or file; a command line turns them into
exit status 2.
"""

from otclr_jax.data.batches import epoch_permutation
from otclr_jax.data.batches import eval_batches
from otclr_jax.data.batches import steps_per_epoch
from otclr_jax.data.batches import train_batches
from otclr_jax.data.cache import load_split
from otclr_jax.data.cache import load_splits
from otclr_jax.data.checks import check_evaluable
from otclr_jax.data.checks import Evaluable
from otclr_jax.data.images import MIN_IMAGE_SIZE
from otclr_jax.data.sources import describe as describe_source
from otclr_jax.data.sources import FOLDER_PREFIX
from otclr_jax.data.sources import known_datasets
from otclr_jax.data.tfds_sources import TFDS_SPLITS
from otclr_jax.data.types import BatchSizeError
from otclr_jax.data.types import DataError
from otclr_jax.data.types import DatasetUnavailableError
from otclr_jax.data.types import NotEvaluableError
from otclr_jax.data.types import Split
from otclr_jax.data.types import SplitNotFoundError
