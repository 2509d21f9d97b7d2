"""`python -m otclr_jax.bench views`: pixel and feature statistics of the
configured view generator's positive pairs on test images (no training).

Each statistic compares the encoder's views (v1, v2) with the two strong
augmentations of the same keys (s1, s2); for 'augment' views they coincide.
"""

from __future__ import annotations

from absl import app
from absl import flags
import jax
import ml_collections
import numpy as np

# Frequencies above this many cycles per pixel count as detail.
CUTOFF = 0.25
# Pixels of the image border ring compared with the inside.
RING = 3
# The printed table's columns: the views, then every `view_statistics` in
# its order but ring_clean.
TABLE_COLUMNS = ('Views', 'HF power / strong', 'L2 v1-v2 / s1-s2',
                 'Ring / inside, views', 'Ring / inside, strong',
                 'Retrieval, encoder: views', 'strong',
                 'Retrieval, pixels: views', 'strong')


def view_statistics(config: ml_collections.ConfigDict, images: np.ndarray,
                    seed: int = 0) -> dict[str, float]:
  """The positive pairs' statistics of `config`'s views of `images`.

  Args:
    config: a validated config (its views, `config.ot`, `config.augment`,
      and `config.model` with `config.seed` for the untrained encoder).
    images: uint8 [n, S, S, 3] test images, n >= 2; 100 per device call.
    seed: the views' key (`view_quality.paired_views`).

  Returns:
    `high_freq`: mean high-frequency power (`metrics.high_frequency_power`)
    of the views over the strong views'; `pair_l2`: mean L2 distance between
    v1 and v2 over that between s1 and s2; `ring_views`, `ring_strong`,
    `ring_clean`: border-ring to inside brightness ratios of the views, the
    strong views and the images; `retrieval_{encoder,pixels}_{views,strong}`:
    fraction of v1 (s1) whose cosine-nearest v2 (s2) among all n is its
    partner, on the untrained encoder's 512-d backbone features and on raw
    pixels.
  """
  # pylint: disable=g-import-not-at-top
  from otclr_jax import experiment
  from otclr_jax.evaluation import features
  from otclr_jax.evaluation import metrics
  from otclr_jax.evaluation import view_quality
  model = experiment.create_model(config)
  encoder = features.Encoder(model)
  variables = encoder.place(experiment.initial_variables(config))
  batch_size = -(-min(100, len(images)) // encoder.num_devices) * (
      encoder.num_devices)
  parts = []
  for x, pair, real in view_quality.paired_views(
      config, images, batch_size=batch_size, seed=seed):
    arrays = [np.asarray(a[:real]) for a in (x,) + tuple(pair)]
    hs = [np.asarray(encoder.embed(variables, a)[0])[:real]
          for a in pair]
    parts.append(arrays + hs)
  x, v1, v2, s1, s2, hv1, hv2, hs1, hs2 = (
      np.concatenate(p) for p in zip(*parts))
  flat = lambda a: a.reshape(len(a), -1)
  hf = lambda a, b: 0.5 * (metrics.high_frequency_power(a, CUTOFF)
                           + metrics.high_frequency_power(b, CUTOFF))
  ring = lambda *a: metrics.border_centre_ratio(np.concatenate(a), RING)
  return {
      'high_freq': hf(v1, v2) / hf(s1, s2),
      'pair_l2': float(metrics.pixel_l2(v1, v2) / metrics.pixel_l2(s1, s2)),
      'ring_views': ring(v1, v2),
      'ring_strong': ring(s1, s2),
      'ring_clean': ring(x),
      'retrieval_encoder_views': metrics.retrieval_rate(hv1, hv2),
      'retrieval_encoder_strong': metrics.retrieval_rate(hs1, hs2),
      'retrieval_pixels_views': metrics.retrieval_rate(flat(v1), flat(v2)),
      'retrieval_pixels_strong': metrics.retrieval_rate(flat(s1), flat(s2)),
  }


def run(fv: flags.FlagValues) -> int:
  """The `views` subcommand: prints `view_statistics` of `--dataset`'s test
  split, `--num_images` images chosen with `--seed`."""
  # pylint: disable=g-import-not-at-top
  from otclr_jax import data
  from otclr_jax import experiment
  from otclr_jax import views as views_lib
  from otclr_jax.evaluation import view_quality
  if fv.num_images < 2:
    raise app.UsageError(f'--num_images must be >= 2, got {fv.num_images}.')
  config = fv.config.copy_and_resolve_references()
  config.dataset = fv.dataset
  experiment.validate_config(config)
  test = data.load_split(fv.dataset, 'test', config.image_size,
                         config.data_dir or None)
  _, images = view_quality.choose_images(test.images, fv.num_images, fv.seed)
  stats = view_statistics(config, images, seed=fv.seed)
  method, kind, options = views_lib.recipe(config)[:3]
  generator = (f'OT views (source={options.source}, detail={options.detail}, '
               f'colour={options.colour}, alpha={config.ot.alpha:g})'
               if kind == 'ot' else 'strong augmentations')
  print(f'{method.name} with {generator}: {len(images)} {fv.dataset} test '
        f'images at {config.image_size} px (seed {fv.seed}), '
        f'{jax.devices()[0].platform}')
  print(f'views / strong views: high-frequency power (> {CUTOFF:g} '
        f'cycles/pixel) {stats["high_freq"]:.3f}; mean L2 v1-v2 over '
        f'mean L2 s1-s2 {stats["pair_l2"]:.3f}')
  print(f'border ring ({RING} px) / inside brightness: views '
        f'{stats["ring_views"]:.3f}, strong views {stats["ring_strong"]:.3f}, '
        f'clean images {stats["ring_clean"]:.3f}')
  print(f'partner retrieved among {len(images)} (cosine nearest '
        f'neighbour): untrained encoder views '
        f'{100 * stats["retrieval_encoder_views"]:.1f}%, strong '
        f'{100 * stats["retrieval_encoder_strong"]:.1f}%; raw pixels views '
        f'{100 * stats["retrieval_pixels_views"]:.1f}%, strong '
        f'{100 * stats["retrieval_pixels_strong"]:.1f}%')
  print('| ' + ' | '.join(TABLE_COLUMNS) + ' |')
  print('|' + '---|' * len(TABLE_COLUMNS))
  print(f'| {generator} | ' + ' | '.join(
      f'{100 * v:.1f}%' if k.startswith('retrieval') else f'{v:.3f}'
      for k, v in stats.items() if k != 'ring_clean') + ' |')
  return 0

