r"""Draws one figure: `python -m otclr_jax.figures FIGURE [flags]`.

    python -m otclr_jax.figures interpolation --out=fig5.png \
        [--image=PATH --size=128 --grid_size=16 --epsilon=0.05 --alphas=0,0.5,1]
    python -m otclr_jax.figures tsne --workdir=DIR [--n=100 --step=S]
    python -m otclr_jax.figures top5 --workdir=SIMCLR_DIR --workdir=OTCLR_DIR
    python -m otclr_jax.figures curves --workdir=DIR [--workdir=DIR2]
    python -m otclr_jax.figures report --workdir=DIR [--compare=DIR2]

tsne and report read DIR/eval/config.json, or --config=FILE [--config.a.b=v]
given the run's own result-changing settings (a flag contradicting them: 2).
Default --out: <first workdir>/eval/figures/<figure>.png, with a PDF beside.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from absl import flags
from ml_collections import config_flags

from otclr_jax import cli
from otclr_jax import config_files

FIGURES = ('interpolation', 'tsne', 'top5', 'curves', 'report')


def _define_flags(fv: flags.FlagValues, argv: list[str]) -> None:
  config_flags.DEFINE_config_file(
      'config', None, "The run's config file (default: "
      'DIR/eval/config.json, written by the evaluation).', flag_values=fv,
      lock_config=True, sys_argv=argv)
  define = lambda kind, name, default, text: kind(
      name, default, text, flag_values=fv)
  define(flags.DEFINE_multi_string, 'workdir', [], 'A run directory; top5 '
         'and curves take several.')
  define(flags.DEFINE_string, 'out', None, 'Output .png (a .pdf is written '
         'beside it); default <first workdir>/eval/figures/<figure>.png.')
  define(flags.DEFINE_string, 'compare', None, 'report: a second run (e.g. '
         'the SimCLR baseline): curves of both and the top-5 figure.')
  define(flags.DEFINE_integer, 'step', None, 'tsne: checkpoint step; '
         'default the latest.')
  define(flags.DEFINE_string, 'dataset', None, 'tsne, top5, report: test '
         "split; default the run's views dataset / the first one the runs "
         'share.')
  define(flags.DEFINE_integer, 'n', None, 'tsne, report: test images; '
         'default config.eval.num_view_images (the evaluation\'s views).')
  define(flags.DEFINE_float, 'perplexity', 30.0, 'tsne, report: perplexity.')
  define(flags.DEFINE_integer, 'max_classes', 12, 'tsne, report: at most '
         'this many class panels.')
  define(flags.DEFINE_integer, 'index', None, 'top5, report: test image; '
         'default the first the runs disagree on.')
  define(flags.DEFINE_integer, 'seed', None, 'tsne: t-SNE random_state '
         '(default 0); interpolation: seed of the strong view (default 1).')
  define(flags.DEFINE_string, 'image', None, "interpolation: image file; "
         "default scikit-learn's flower.jpg.")
  define(flags.DEFINE_integer, 'size', 128, 'interpolation: side of the '
         'square centre crop, in pixels.')
  define(flags.DEFINE_integer, 'grid_size', 16, 'interpolation: OT grid '
         'side m.')
  define(flags.DEFINE_float, 'epsilon', 0.05, 'interpolation: entropic '
         'regularisation.')
  define(flags.DEFINE_integer, 'num_iters', 20, 'interpolation: Sinkhorn '
         'iterations.')
  define(flags.DEFINE_list, 'alphas', ['0', '0.25', '0.5', '0.75', '1'],
         'interpolation: coefficients in [0, 1].')
  flags.DEFINE_enum('strong', 'geometric', ['geometric', 'simclr'],
                    'interpolation: strong augmentation of the image.',
                    flag_values=fv)


def _adopted_config(fv: flags.FlagValues, workdir: str):
  """--config with the run's own result-changing settings, as evaluation
  takes them: a figure is of the run that was trained."""
  from otclr_jax import experiment  # pylint: disable=g-import-not-at-top
  experiment.adopt_run_config(
      fv.config, workdir, config_flags.get_override_values(fv['config']))
  return fv.config


def _draw(figure: str, fv: flags.FlagValues) -> None:
  """Draws `figure` with the parsed flags; raises on missing inputs."""
  # Imported here: the figures load JAX and the models, --help needs neither.
  from otclr_jax.figures import common  # pylint: disable=g-import-not-at-top
  workdirs = [os.path.expanduser(w) for w in fv.workdir]
  if figure in ('tsne', 'report') and len(workdirs) != 1:
    raise config_files.UsageError(f'{figure} takes one --workdir.')
  if figure in ('top5', 'curves') and not workdirs:
    raise config_files.UsageError(f'{figure} takes at least one --workdir.')
  out = fv.out or (common.figures_dir(workdirs[0]) / f'{figure}.png'
                   if workdirs else None)
  if figure == 'interpolation':
    from otclr_jax.figures import interpolation  # pylint: disable=g-import-not-at-top
    if not fv.out:
      raise config_files.UsageError('interpolation needs --out=PATH.png.')
    interpolation.draw(
        out, image=fv.image and os.path.expanduser(fv.image), size=fv.size,
        grid_size=fv.grid_size, epsilon=fv.epsilon, num_iters=fv.num_iters,
        alphas=[float(a) for a in fv.alphas], strong=fv.strong,
        seed=1 if fv.seed is None else fv.seed)
  elif figure == 'tsne':
    from otclr_jax.figures import tsne  # pylint: disable=g-import-not-at-top
    config = (_adopted_config(fv, workdirs[0]) if fv.config is not None
              else common.load_run_config(workdirs[0]))
    tsne.tsne_for_run(workdirs[0], config, common.png_path(out),
                      step=fv.step, dataset=fv.dataset, num_images=fv.n,
                      perplexity=fv.perplexity, seed=fv.seed or 0,
                      max_classes=fv.max_classes)
  elif figure == 'top5':
    from otclr_jax.figures import top5  # pylint: disable=g-import-not-at-top
    top5.top5_for_runs(workdirs, common.png_path(out), dataset=fv.dataset,
                       index=fv.index)
  elif figure == 'curves':
    from otclr_jax.figures import curves  # pylint: disable=g-import-not-at-top
    curves.curves_for_runs(workdirs, common.png_path(out))
  else:
    from otclr_jax.figures import report  # pylint: disable=g-import-not-at-top
    for flag, path in (('--workdir', workdirs[0]), ('--compare', fv.compare)):
      if path and not os.path.isdir(os.path.expanduser(path)):
        raise config_files.UsageError(f'{flag}={path} is not a run directory.')
    written, skipped = report.report(
        workdirs[0],
        _adopted_config(fv, workdirs[0]) if fv.config is not None else None,
        compare=fv.compare and os.path.expanduser(fv.compare),
        num_images=fv.n, perplexity=fv.perplexity,
        max_classes=fv.max_classes, index=fv.index, dataset=fv.dataset)
    for line in skipped:
      print(f'skipped {line}')
    if not written:
      raise config_files.UsageError('no figure drawn (every input is missing, '
                                    'above).')
    print(f'{len(written) // 2} figure(s) in '
          f'{common.figures_dir(workdirs[0])}')


def main(argv: Sequence[str]) -> int:
  """The command line (module docstring); exit statuses: docs/operations.md."""
  try:
    with cli.stop_on_signals():
      parsed = config_files.parse_flags(argv, _define_flags, __doc__)
      if parsed is None:
        return 0
      fv, rest = parsed
      if len(rest) != 1 or rest[0] not in FIGURES:
        raise config_files.UsageError(
            f'name one figure of {", ".join(FIGURES)}, got {rest}; see '
            '--help.')
      _draw(rest[0], fv)
  except cli.StopRequested as e:
    print(f'Figures stopped by {e.name}; rerun to draw them.', file=sys.stderr)
    return cli.EXIT_STOPPED
  except Exception as e:  # pylint: disable=broad-except
    # The figures' ValueErrors all describe their inputs.
    return cli.report(e, usage_errors=(ValueError,))
  return 0


if __name__ == '__main__':
  config_files.run(main, usage_errors=(ValueError,))
