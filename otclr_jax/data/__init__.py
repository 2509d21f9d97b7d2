"""Host input pipeline: whole splits as cached uint8 arrays, batched on host."""

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
from otclr_jax.data.types import MissingExtraError
from otclr_jax.data.types import NotEvaluableError
from otclr_jax.data.types import Split
from otclr_jax.data.types import SplitNotFoundError
