"""What a config is: its checks, its method and model, its devices, its run."""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Iterable

from absl import logging
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np

from otclr_jax import checkpoint
from otclr_jax import cli
from otclr_jax import config_files
from otclr_jax import conv
from otclr_jax import data
from otclr_jax import models
from otclr_jax import optim
from otclr_jax import ot
from otclr_jax import ot_checks
from otclr_jax import rundir
from otclr_jax import views as views_lib
from otclr_jax.methods import base


class ConfigError(cli.UsageError):
  """A config field is invalid, or conflicts with the workdir's stored run."""


def _require(ok: bool, field: str, rule: str, value: Any) -> None:
  if not ok:
    raise ConfigError(f'config.{field} {rule}, got {value!r}.')


def _is_number(value: Any) -> bool:
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value))


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


# Integer fields and their smallest value (batch_size: contrastive losses
# need negatives; total_steps 0: use num_epochs).
_INT_MINIMA = (
    ('batch_size', 2), ('log_every_steps', 1), ('checkpoint_every_steps', 1),
    ('keep_checkpoints', 1), ('total_steps', 0), ('model.proj_hidden_dim', 1),
    ('model.proj_dim', 1), ('ot.grid_size', 2), ('ot.num_iters', 1),
    ('eval.batch_size', 1), ('eval.probe_steps', 1),
    ('eval.num_view_images', 1), ('monitor.num_train', 1),
    ('monitor.num_test', 1), ('image_size', data.MIN_IMAGE_SIZE))
# (fields, rule, test) of finite-number fields, as in `base.BLOCK_RULES`.
_NUMBER_RULES = (
    (('num_epochs', 'optim.warmup_epochs', 'ot.beta'), 'must be >= 0',
     lambda v: v >= 0),
    (('loss.temperature', 'ot.epsilon'), 'must be > 0', lambda v: v > 0),
    (('ot.alpha',), 'must lie in [0, 1]', lambda v: 0 <= v <= 1))
_OPTIM_RULES = (
    (('base_lr', 'weight_decay'), 'must be >= 0', lambda v: v >= 0),
    (('momentum',), 'must lie in [0, 1)', lambda v: 0 <= v < 1),
    (('eta',), 'must be > 0', lambda v: v > 0),
    (('clip_grad',), 'must be >= 0 (0: off)', lambda v: v >= 0))
_CHOICES = (('mode', ('train', 'eval')), ('dtype', tuple(base.DTYPES)),
            ('model.stem', models.STEMS), ('model.conv_impl', conv.CONV_IMPLS),
            ('ot.core', ot.CORES))


def _field(config: ml_collections.ConfigDict, name: str) -> Any:
  for part in name.split('.'):
    config = config[part]
  return config


def _check_numbers(block: Any, prefix: str, rules) -> None:
  """Checks the fields named in `rules` that `block` holds."""
  for fields, rule, ok in rules:
    for name in (f for f in fields if f.split('.')[0] in block):
      value = _field(block, name)
      _require(_is_number(value) and ok(value), prefix + name, rule, value)


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Checks every field before anything is created (workdir, data caches).

  Raises:
    ConfigError: naming the field, its value and the rule.
  """
  c = config
  for name, value in config_files.flatten(c.to_dict()).items():
    numbers = value if isinstance(value, (list, tuple)) else [value]
    # A float that is not finite is never a setting (inf saturation, NaN
    # crop bounds): refused here, not reported later as a divergence.
    if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
      raise ConfigError(f'config.{name} must be finite, got {value!r}.')
  for name, choices in _CHOICES:
    _require(_field(c, name) in choices, name, f'must be one of {choices}',
             _field(c, name))
  try:
    method = views_lib.recipe(c).method.name
  except ValueError as e:
    raise ConfigError(str(e)) from e
  # Seeds become uint32 PRNG key data (jax.random.key) and NumPy seeds.
  _require(_is_int(c.seed) and 0 <= c.seed < 2**32, 'seed',
           'must be an integer in [0, 2**32)', c.seed)
  _require(isinstance(c.dataset, str) and c.dataset, 'dataset',
           'must name a dataset', c.dataset)
  for name, low in _INT_MINIMA:
    value = _field(c, name)
    _require(_is_int(value) and value >= low, name,
             f'must be an integer >= {low}', value)
  for name in ('ot.learn_alpha', 'eval.at_end', 'eval.figures'):
    _require(isinstance(_field(c, name), bool), name, 'must be True or False',
             _field(c, name))
  _check_numbers(c, '', _NUMBER_RULES)
  if c.total_steps <= 0 and c.num_epochs <= 0:
    raise ConfigError('Set config.num_epochs > 0 or config.total_steps > 0.')
  block = c.get(method, {})
  for path, opt in (('optim', c.optim), (f'{method}.optim',
                                         block.get('optim'))):
    if opt is not None:
      _require(opt.name in optim.OPTIMIZERS, f'{path}.name',
               f'must be one of {optim.OPTIMIZERS}', opt.name)
      _check_numbers(opt, f'{path}.', _OPTIM_RULES)
      _require(isinstance(opt.clip_lr, bool), f'{path}.clip_lr',
               'must be True or False', opt.clip_lr)
  _check_numbers(block, f'{method}.', base.BLOCK_RULES)
  if c.ot.grid_size > c.image_size:
    raise ConfigError(f'config.ot.grid_size ({c.ot.grid_size}) must not '
                      f'exceed config.image_size ({c.image_size}).')
  if c.ot.epsilon < ot_checks.MIN_EPSILON:
    raise ConfigError(
        f'config.ot.epsilon={c.ot.epsilon} is below '
        f'{ot_checks.MIN_EPSILON:.5f}, the smallest safe value: the Sinkhorn '
        'kernel exp(-C / epsilon) on the max-1 cost C in [0, 1] underflows '
        'float32 below it, which gives NaN views and loss.')
  if c.ot.learn_alpha and not 0.0 < c.ot.alpha < 1.0:
    raise ConfigError('config.ot.learn_alpha starts from sigmoid(logit) = '
                      f'config.ot.alpha, which must lie in (0, 1); got '
                      f'{c.ot.alpha}.')
  sizes = c.model.stage_sizes
  _require(isinstance(sizes, tuple) and len(sizes) == 4
           and all(_is_int(n) and n >= 1 for n in sizes), 'model.stage_sizes',
           'must be 4 integers >= 1 (blocks per stage)', sizes)
  datasets = c.eval.datasets
  _require(isinstance(datasets, (tuple, list)) and len(datasets) >= 1
           and all(isinstance(d, str) and d for d in datasets),
           'eval.datasets', 'must be a non-empty tuple of dataset names',
           datasets)
  _require(isinstance(c.eval.views_dataset, str), 'eval.views_dataset',
           "must be a dataset name or ''", c.eval.views_dataset)
  _require(_is_int(c.monitor.every_steps) and c.monitor.every_steps >= 0
           and c.monitor.every_steps % c.log_every_steps == 0,
           'monitor.every_steps', '(the kNN monitor) must be 0 (off) or a '
           'multiple of config.log_every_steps (it is logged with that '
           "step's line)", c.monitor.every_steps)
  if method == 'moco':
    # The queue takes a whole batch of keys per step (methods/moco.py).
    _require(_is_int(c.moco.queue_size)
             and c.moco.queue_size >= c.batch_size, 'moco.queue_size',
             f'must be an integer >= config.batch_size ({c.batch_size})',
             c.moco.queue_size)


def title_of(config: ml_collections.ConfigDict) -> str:
  """The run's row name as the paper writes it ('MoCo + OT views', 'OTCLR')."""
  return views_lib.recipe(config).title


def create_model(config: ml_collections.ConfigDict):
  """The trained (online) network of the run's method."""
  return views_lib.recipe(config).method.create_model(config)


def count_params(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


def make_mesh(devices=None) -> Mesh:
  devices = np.asarray(jax.devices() if devices is None else devices)
  return Mesh(devices, ('data',))


def global_batch(batch: np.ndarray, mesh: Mesh) -> jax.Array:
  """This process's rows of the global host batch, as one global array."""
  n = jax.process_count()
  if batch.shape[0] % n or (batch.shape[0] // n) % (mesh.size // n or 1):
    raise ValueError(f'Global batch {batch.shape[0]} must split evenly over '
                     f'{n} processes and {mesh.size} devices.')
  local = batch.shape[0] // n
  rows = batch[jax.process_index() * local:(jax.process_index() + 1) * local]
  return jax.make_array_from_process_local_data(
      NamedSharding(mesh, P('data')), rows, batch.shape)


def init_key(config: ml_collections.ConfigDict) -> jax.Array:
  """The key the network is initialised from."""
  return jax.random.split(jax.random.key(config.seed))[0]


def train_key(config: ml_collections.ConfigDict) -> jax.Array:
  """The key every step folds its step number into."""
  return jax.random.split(jax.random.key(config.seed))[1]


@functools.lru_cache(maxsize=8)
def _compiled_init(model) -> Callable[..., Any]:
  # Compiling dominates the init's cost: training and evaluation share it.
  return jax.jit(functools.partial(model.init, train=False))


def initial_variables(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The untrained network's `{'params', 'batch_stats'}`, as training has."""
  model = create_model(config)
  dummy = np.zeros((1, config.image_size, config.image_size, 3), np.float32)
  variables = _compiled_init(model)({'params': init_key(config)}, dummy)
  return {'params': variables['params'],
          'batch_stats': variables['batch_stats']}


def restore_variables(config: ml_collections.ConfigDict, workdir: str,
                      step: int) -> dict[str, Any]:
  """The network's `{'params', 'batch_stats'}` of checkpoint `step`.

  Nothing else is read; a learnt logit comes back under `'alpha_logit'`.

  Raises:
    FileNotFoundError: no checkpoint `step` in `workdir`.
  """
  # Abstract shapes: no compilation of the network for the template.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  template = jax.tree_util.tree_map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
      jax.eval_shape(functools.partial(initial_variables, config)))
  item = {'params': {'net': template['params']},
          'batch_stats': template['batch_stats']}
  if config.ot.learn_alpha:
    item['params']['alpha_logit'] = np.zeros((), np.float32)
  restored = checkpoint.restore_part(workdir, step, item)
  params = dict(restored['params'])  # 'net', and 'alpha_logit' if learnt
  return {'params': params.pop('net'),
          'batch_stats': restored['batch_stats'], **params}


def run_config(workdir: str) -> tuple[dict[str, Any], str] | None:
  """`(config, source)` of `workdir`'s run; None without config and checkpoint.

  The config stored in the newest checkpoint that holds one is the run's;
  config.json stands in only where no checkpoint holds a config. Every
  reader (resume, evaluation, export, figures, sweeps) comes here.

  Raises:
    rundir.CorruptFileError: config.json is not a JSON object.
    ConfigError: config.json disagrees with the checkpoint's config in a
      result-changing field, or checkpoints whose config is recorded nowhere.
  """
  json_path = os.path.join(workdir, rundir.CONFIG_FILE)
  from_json = rundir.read_config(workdir)
  found = checkpoint.stored_config(workdir)
  if found is None:
    if (from_json is None
        and rundir.latest_checkpoint_step(workdir) is not None):
      raise ConfigError(
          f'{workdir} has checkpoints but no {rundir.CONFIG_FILE}, and no '
          'checkpoint holds its config: the settings it was trained with are '
          'unknown, so it can be neither resumed nor evaluated. Use another '
          '--workdir.')
    return None if from_json is None else (from_json, json_path)
  stored, step = found
  source = rundir.checkpoint_dir(workdir, step)
  if from_json is not None:
    names = rundir.result_changing_diff(stored, from_json, length=True)
    if names:
      shown = rundir.describe_diff(stored, from_json, names[:3])
      more = f' and {len(names) - 3} more' if len(names) > 3 else ''
      raise ConfigError(
          f'{json_path} disagrees with the config stored in checkpoint '
          f'{source}, which is the run\'s ({shown}{more}; checkpoint -> '
          f'config.json). Restore {rundir.CONFIG_FILE} or delete it (the '
          'checkpoint\'s config is used then).')
  return stored, source


def adopt_run_config(config: ml_collections.ConfigDict, workdir: str,
                     overridden: Iterable[str] = ()) -> None:
  """Gives `config` the result-changing settings and length of `workdir`'s run.

  A field missing on either side keeps this invocation's value, and no field
  is added (`config` may be locked).

  Raises:
    ConfigError: an override in `overridden` (dotted names) contradicts it,
      or `workdir` has checkpoints whose settings are unknown (`run_config`).
  """
  found = run_config(workdir)
  if found is None:
    return
  stored, source = found
  new = config.to_dict()
  flat_stored = config_files.flatten(stored)
  flat_new = config_files.flatten(new)
  names = [n for n in rundir.result_changing_diff(stored, new, length=True)
           if n in flat_stored and n in flat_new]
  clashes = [n for n in names if n in set(overridden)]
  if clashes:
    raise ConfigError(
        f'{", ".join(f"--config.{n}" for n in clashes)} contradicts the run '
        f'in {source} ({rundir.describe_diff(stored, new, clashes)}, stored '
        '-> flag); a trained run is evaluated with its own settings. Drop the '
        'flag, or point --workdir at a run trained that way.')
  for name in names:
    parent, _, leaf = name.rpartition('.')
    block = _field(config, parent) if parent else config
    block[leaf] = config_files.tuples(flat_stored[name])
  if names:
    logging.info('Using the settings of the run in %s for: %s.', source,
                 ', '.join(names))


def alpha_of(config: ml_collections.ConfigDict,
             variables: dict[str, Any]) -> float:
  """The run's interpolation coefficient: learnt (`'alpha_logit'`) or fixed."""
  params = {'alpha_logit': variables.get('alpha_logit')}
  return float(views_lib.current_alpha(config, params))
