"""The trained encoder alone (backbone, no head), for other projects.

    from otclr_jax import export
    apply_fn, variables = export.load_encoder('encoder.msgpack')
    features = apply_fn(variables, images)  # [B, H, W, 3] in [0, 1] -> [B, 512]

Export a run's checkpoint, rebuilt from its config.json, with

    python -m otclr_jax.export --workdir=DIR [--step=S] [--out=PATH]
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any, Callable, Mapping, Sequence

from absl import flags
from flax import serialization
import jax
import jax.numpy as jnp
import numpy as np

from otclr_jax import cli
from otclr_jax import config_files
from otclr_jax import fileio
from otclr_jax import models
from otclr_jax import ot_checks
from otclr_jax import rundir

FORMAT = 'otclr_jax.encoder'
VERSION = 1
FEATURE_DIM = 512

_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


def _encoder_tree(variables: Mapping[str, Any]) -> dict[str, Any]:
  """The encoder's `{'params', 'batch_stats'}`, from the model's or its own."""
  out = {}
  for collection in ('params', 'batch_stats'):
    if collection not in variables:
      raise ValueError(
          f'variables need {collection!r} (the full SimCLRNet variables '
          f"{{'params': state.params['net'], 'batch_stats': "
          f"state.batch_stats}} or the encoder's own); got keys "
          f'{sorted(variables)}.')
    tree = variables[collection]
    tree = tree['encoder'] if 'encoder' in tree else tree
    out[collection] = jax.tree_util.tree_map(np.asarray, dict(tree))
  return out


def encoder_path(workdir: str, step: int | None = None) -> str:
  """`workdir/encoder/encoder.msgpack`, or `encoder_step<S>.msgpack`."""
  return os.path.join(workdir, rundir.encoder_file(step))


def export_encoder(path: str, variables: Mapping[str, Any], config, *,
                   step: int | None = None) -> None:
  """Writes the encoder of a trained model to `path` (msgpack), atomically.

  Args:
    variables: `{'params', 'batch_stats'}` of the full `SimCLRNet` or of the
      encoder alone; only the encoder is kept.
    config: the run's ConfigDict or dict; model settings and provenance are
      stored, with `step` when given.
  """
  model = config['model']
  meta = {
      'stem': model['stem'],
      # Runs stored before model.stage_sizes existed trained ResNet-18.
      'stage_sizes': list(model.get('stage_sizes', models.RESNET18)),
      'dtype': config['dtype'],
      'image_size': int(config['image_size']),
      'feature_dim': FEATURE_DIM,
      'method': config['method'],
      # SimCLR with OT views (OTCLR) differs from SimCLR only here.
      'views': config.get('views', ''),
      'dataset': config['dataset'],
      'seed': int(config['seed']),
  }
  if step is not None:
    meta['step'] = int(step)
  payload = {'format': FORMAT, 'version': VERSION,
             'config': json.dumps(meta, sort_keys=True),
             'variables': _encoder_tree(variables)}
  data = serialization.msgpack_serialize(payload)
  fileio.atomic_write(path, lambda f: f.write(data))


def _read(path: str) -> dict[str, Any]:
  with open(path, 'rb') as f:
    raw = f.read()
  try:
    payload = serialization.msgpack_restore(raw)
  except Exception as e:  # msgpack raises several unrelated types.
    raise ValueError(f'{path} is not a readable encoder file: {e}') from e
  if not isinstance(payload, dict) or payload.get('format') != FORMAT:
    raise ValueError(f'{path} is not an {FORMAT} file (written by '
                     'otclr_jax.export.export_encoder).')
  if payload.get('version') != VERSION:
    raise ValueError(f'{path} has encoder format version '
                     f'{payload.get("version")}; this code reads {VERSION}.')
  return payload


def load_encoder_config(path: str) -> dict[str, Any]:
  """The model settings stored with an exported encoder (stem, image_size)."""
  return json.loads(_read(path)['config'])


def _check_images(images, image_size: int) -> jax.Array:
  """The OT functions' input contract (`ot_checks`), plus the stored size."""
  if not isinstance(images, jax.core.Tracer):
    images = np.asarray(images)
  if images.ndim != 4 or images.shape[-1] != 3:
    raise ValueError(f'images must be [B, H, W, 3], got shape {images.shape}.')
  if images.shape[1:3] != (image_size, image_size):
    raise ValueError(
        f'images are {images.shape[1]} x {images.shape[2]}; this encoder was '
        f'trained at image_size {image_size} (load_encoder_config): resize '
        'them first.')
  if not jnp.issubdtype(images.dtype, jnp.floating):
    raise ValueError(f'images have dtype {images.dtype}; the encoder takes '
                     'float RGB in [0, 1] (divide uint8 data by 255).')
  ot_checks.check_finite('images', images)
  return ot_checks.check_image_values('images', images)


def _check_architecture(path: str, encoder, meta: dict[str, Any],
                        variables: Any) -> None:
  """Refuses weights that the stored architecture cannot apply, at load."""
  size = int(meta['image_size'])
  expected = jax.eval_shape(
      lambda: encoder.init(jax.random.key(0),
                           jnp.zeros((1, size, size, 3), jnp.float32),
                           train=False))
  shape = lambda tree: {
      jax.tree_util.keystr(k): tuple(v.shape)
      for k, v in jax.tree_util.tree_leaves_with_path(tree)}
  want = shape({c: expected[c] for c in ('params', 'batch_stats')})
  got = shape(variables)
  if want != got:
    wrong = sorted(set(want) ^ set(got)) or sorted(
        k for k in want if want[k] != got[k])
    raise ValueError(
        f'{path}: its weights do not fit the architecture it names (stem '
        f'{meta["stem"]!r}, stage_sizes {list(encoder.stage_sizes)}, '
        f'image_size {size}); first mismatch at '
        f'{wrong[0]} ({got.get(wrong[0], "absent")} stored, '
        f'{want.get(wrong[0], "absent")} expected). The file was edited or '
        'written by other code: export it again.')


def load_encoder(path: str) -> tuple[Callable[..., jax.Array], dict[str, Any]]:
  """Loads an encoder written by `export_encoder` from `path`.

  Returns:
    `(apply_fn, variables)`: jitted `apply_fn(variables, images)` maps float
    images [B, H, W, 3] in [0, 1] at the stored `image_size` to float32
    features [B, 512]; traced images outside [0, 1] give NaN features.

  Raises:
    FileNotFoundError: no file.
    ValueError: not an encoder file of this version, or weights that do not
      fit the stored architecture; concrete images off the contract.
  """
  payload = _read(path)
  meta = json.loads(payload['config'])
  if meta.get('dtype') not in _DTYPES:
    raise ValueError(f'{path}: dtype {meta.get("dtype")!r} is not one of '
                     f'{tuple(_DTYPES)}.')
  try:
    encoder = models.ResNet(
        stage_sizes=tuple(meta.get('stage_sizes', models.RESNET18)),
        stem=meta['stem'], dtype=_DTYPES[meta['dtype']])
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'{path}: cannot build its encoder ({e}).') from e
  variables = jax.tree_util.tree_map(jnp.asarray, payload['variables'])
  try:
    _check_architecture(path, encoder, meta, variables)
  except ValueError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'{path}: its stored architecture (stem '
                     f'{meta.get("stem")!r}) cannot be built: {e}') from e
  image_size = int(meta['image_size'])

  @jax.jit
  def features(variables, images):
    return encoder.apply(variables, images, train=False)

  @functools.wraps(features)
  def apply_fn(variables, images):
    return features(variables, _check_images(images, image_size))

  return apply_fn, variables


def export_checkpoint(workdir: str, step: int | None = None,
                      out: str | None = None) -> tuple[str, int]:
  """Exports checkpoint `step` (None: the newest) of the run in `workdir`.

  Returns:
    `(path written, step exported)`; `out` defaults to
    `encoder_path(workdir, step)`.

  Raises:
    FileNotFoundError: no stored config or no checkpoint in `workdir`.
    rundir.CorruptFileError: the stored config is not a run's config.
    ValueError: no checkpoint for `step`, or non-finite variables.
  """
  # Training-side imports, which `load_encoder` users do not need.
  # pylint: disable=g-import-not-at-top
  import ml_collections
  from otclr_jax import experiment
  from otclr_jax.evaluation import evaluate
  from otclr_jax.evaluation import features
  # pylint: enable=g-import-not-at-top
  if out is not None and os.path.isdir(out):
    raise config_files.UsageError(
        f'--out {out} is a directory; give the file to write, e.g. '
        f'{os.path.join(out, rundir.ENCODER_FILE)}.')
  found = experiment.run_config(workdir)
  if found is None:
    raise FileNotFoundError(
        f'{os.path.join(workdir, rundir.CONFIG_FILE)} does not exist and no '
        "checkpoint holds the run's config: the encoder is rebuilt from it "
        '(`python -m otclr_jax.main` writes both).')
  stored, source = found
  config = ml_collections.ConfigDict(config_files.tuples(stored))
  try:
    experiment.validate_config(config)
  except (AttributeError, KeyError, TypeError) as e:
    raise rundir.CorruptFileError(
        f'{source} is not a run config (it lacks or mistypes {e}); export '
        'rebuilds the encoder from it.') from None
  _, restored, step = evaluate.restore(config, workdir, step)
  variables = {'params': restored['params'],
               'batch_stats': restored['batch_stats']}
  features.check_finite_variables(variables, workdir, step)
  path = out or encoder_path(workdir, step)
  export_encoder(path, variables, config, step=step)
  return path, step


def _define_flags(fv: flags.FlagValues, argv: list[str]) -> None:
  del argv  # No --config: the run's stored config.json is the config.
  flags.DEFINE_string('workdir', None, "The run's directory (config.json, "
                      'checkpoints/).', flag_values=fv)
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: the newest '
                       'that restores).', flag_values=fv)
  flags.DEFINE_string('out', None, 'Output file (default: '
                      'WORKDIR/encoder/encoder_step<S>.msgpack).',
                      flag_values=fv)


def main(argv: Sequence[str]) -> int:
  """`python -m otclr_jax.export`; docs/operations.md "Exit statuses"."""
  try:
    with cli.stop_on_signals():
      parsed = config_files.parse_flags(argv, _define_flags, __doc__)
      if parsed is None:
        return 0
      fv, rest = parsed
      if rest or not fv.workdir:
        raise config_files.UsageError(
            'usage: python -m otclr_jax.export --workdir=DIR [--step=S] '
            '[--out=PATH]')
      workdir = os.path.expanduser(fv.workdir)
      rundir.check_directory(workdir, '--workdir')
      out = os.path.expanduser(fv.out) if fv.out else None
      path, step = export_checkpoint(workdir, fv.step, out)
  except cli.StopRequested as e:
    print(f'Export stopped by {e.name}; nothing was written.', file=sys.stderr)
    return cli.EXIT_STOPPED
  except Exception as e:  # pylint: disable=broad-except
    # This command's ValueErrors all describe its inputs.
    return cli.report(e, usage_errors=(ValueError,))
  print(f'Exported the encoder of step {step} to {path}')
  return 0


if __name__ == '__main__':
  config_files.run(main, usage_errors=(ValueError,))
