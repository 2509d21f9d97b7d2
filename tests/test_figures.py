"""Tests of otclr_jax.figures: interpolation on tiny images; t-SNE, top-5,
curves and report on tiny evaluated digits runs."""

import json
import os
import pathlib

import jax
import numpy as np
import pytest
from PIL import Image
from sklearn import metrics

from otclr_jax import config_files
from otclr_jax import data
from otclr_jax.evaluation import features
from otclr_jax.evaluation import probe
from otclr_jax.evaluation import view_quality
from otclr_jax import figures
from otclr_jax import main
from otclr_jax import rundir
from otclr_jax import tables
from otclr_jax.figures import __main__ as figures_cli
from otclr_jax.figures import common
from otclr_jax.figures import curves
from otclr_jax.figures import interpolation
from otclr_jax.figures import report
from otclr_jax.figures import top5
from otclr_jax.figures import tsne
from tests import helpers


def _blob_image(size, center_col, center_row=None):
  """Grey image, one bright Gaussian blob on black, `[size, size, 3]`."""
  center_row = size / 2 - 0.5 if center_row is None else center_row
  rows, cols = np.meshgrid(np.arange(size), np.arange(size), indexing='ij')
  blob = np.exp(-((rows - center_row) ** 2 + (cols - center_col) ** 2) / 4.0)
  return np.repeat(blob[..., None], 3, axis=-1).astype(np.float32)


def test_interpolation_figure_is_written(tmp_path):
  rng = np.random.default_rng(0)
  source = tmp_path / 'tiny.png'
  # Non-square, to go through the centre crop.
  Image.fromarray(rng.integers(0, 256, (20, 28, 3), np.uint8)).save(source)
  out = tmp_path / 'figs' / 'interp.png'
  assert figures_cli.main([
      'figures', 'interpolation', '--image', str(source), '--out', str(out),
      '--size', '16', '--grid_size', '4', '--num_iters', '3',
      '--alphas=0,0.5,1']) == 0
  with Image.open(out) as png:
    width, height = png.size
    assert png.format == 'PNG'
  # Three columns, two rows: wider than tall.
  assert width > height > 100
  pdf = out.with_suffix('.pdf')
  assert pdf.read_bytes()[:5] == b'%PDF-'


def test_rows_endpoints():
  # The figure command's size and grid: its eager programs.
  rng = np.random.default_rng(1)
  x, xs = rng.random((2, 16, 16, 3), np.float32)
  m = 4
  linear, displaced = interpolation.interpolation_rows(x, xs, [0.0, 0.5, 1.0],
                                                       grid_size=m)
  assert linear.shape == displaced.shape == (3, 16, 16, 3)
  # (1 - a) x + a xs in float32: at a = 0 and 1 one product is exactly 0 and
  # the other exactly the image; at a = 1/2 both products are exact and the
  # sum rounds once, as halving x + xs does (scaling by 2 commutes with
  # rounding).
  np.testing.assert_array_equal(linear[0], x)
  np.testing.assert_array_equal(linear[1], 0.5 * (x + xs))
  np.testing.assert_array_equal(linear[2], xs)

  # At alpha = 0 the OT view is the source seen through the m x m grid.
  def low_res(img):
    small = jax.image.resize(img, (m, m, 3), 'linear', antialias=True)
    return np.clip(jax.image.resize(small, img.shape, 'linear'), 0.0, 1.0)

  np.testing.assert_allclose(displaced[0], low_res(x), atol=1e-5)
  # At alpha = 1, the strong view up to Sinkhorn's column-marginal error.
  np.testing.assert_allclose(displaced[2], low_res(xs), atol=5e-3)


def test_ot_row_moves_mass_instead_of_ghosting():
  size = 16
  x, xs = _blob_image(size, 3.0), _blob_image(size, 12.0)
  linear, displaced = interpolation.interpolation_rows(x, xs, [0.5])
  profile_lin = linear[0, size // 2, :, 0]
  profile_ot = displaced[0, size // 2, :, 0]
  # Linear interpolation: two half-bright copies at the endpoints, dark between.
  assert profile_lin[3] > 0.45 and profile_lin[12] > 0.45
  assert profile_lin[7] < 0.1
  # OT: one blob half-way, nothing left at the endpoints.
  assert 6 <= int(np.argmax(profile_ot)) <= 9
  assert profile_ot[7] > 0.45
  assert max(profile_ot[3], profile_ot[12]) < 0.05


def test_load_default_image_and_strong_view():
  x = interpolation.load_image(None, 16)
  assert x.shape == (16, 16, 3) and x.dtype == np.float32
  assert 0.0 <= x.min() and x.max() <= 1.0 and x.std() > 0.05
  a = interpolation.strong_view(x, seed=3)
  np.testing.assert_array_equal(a, interpolation.strong_view(x, seed=3))
  assert a.shape == x.shape
  assert np.abs(a - interpolation.strong_view(x, seed=4)).max() > 0.05


# ----------------------------------------------------------------------------
# Figures of evaluated runs: tiny digits runs, trained 4 steps and evaluated.


@pytest.fixture(scope='module')
def runs(evaluated_run, simclr_run, tmp_path_factory):
  """Copies of two evaluated tiny runs, {'otclr': workdir, 'simclr': workdir}:
  `evaluated_run`, whose evaluation drew its figures, and `simclr_run`, whose
  evaluation did not."""
  return {name: helpers.copy_run(run[1], tmp_path_factory.mktemp(name))
          for name, run in (('otclr', evaluated_run), ('simclr', simclr_run))}


def _assert_png_and_pdf(png):
  png = pathlib.Path(png)
  with Image.open(png) as image:
    assert image.format == 'PNG'
    assert min(image.size) > 200
  assert png.with_suffix('.pdf').read_bytes()[:5] == b'%PDF-'


def test_evaluate_draws_tsne_and_curves(runs):
  figs = pathlib.Path(runs['otclr']) / 'eval' / 'figures'
  for name in ('tsne.png', 'curves.png'):
    _assert_png_and_pdf(figs / name)
  assert not (pathlib.Path(runs['simclr']) / 'eval' / 'figures').exists()
  config = json.loads((pathlib.Path(runs['simclr']) / 'eval' /
                       'config.json').read_text())
  assert config['method'] == 'simclr' and config['ot']['grid_size'] == 4


def test_figure_failure_does_not_fail_evaluation(runs, evaluated_run,
                                                 monkeypatch, caplog):
  def broken(*args, **kwargs):
    raise RuntimeError('no figures today')

  monkeypatch.setattr(figures, 'report_single', broken)
  helpers.small_digits(monkeypatch)
  results = main.evaluate_and_draw(evaluated_run[0], runs['otclr'])
  assert results['step'] == 4
  assert 'Drawing the figures failed' in caplog.text


@pytest.mark.parametrize('method', ['otclr', 'simclr'])
def test_probe_file_reproduces_reported_top1(runs, method):
  workdir = runs[method]
  results = json.loads((pathlib.Path(workdir) / 'eval' /
                        'results.json').read_text())
  path = probe.probe_path(workdir, 4, 'digits')
  assert path == os.path.join(workdir, 'eval', 'probe_step4_digits.npz')
  fitted = probe.load_probe(path)
  assert fitted.w.shape == (512, 10) and fitted.b.shape == (10,)
  assert fitted.weight_decay == results['linear']['digits']['weight_decay']
  feats, labels = features.load_features(workdir, 4, 'digits', 'test', 8)
  assert len(labels) == 10 * helpers.SMALL_DIGITS[1]
  top1 = 100.0 * np.mean(fitted.logits(feats).argmax(axis=1) == labels)
  # The same correct predictions: 100 k / 60 in float64 both ways, up to
  # the order of the division, the mean and the product (3 roundings).
  assert top1 == pytest.approx(results['linear']['digits']['top1'], rel=0,
                               abs=100 * helpers.rounding_tol(
                                   3, eps=helpers.EPS64))
  # The same probe written out in NumPy, float64.
  logits = ((feats - fitted.mean) / fitted.std) @ fitted.w + fitted.b
  np.testing.assert_allclose(fitted.logits(feats), logits, rtol=1e-4,
                             atol=1e-4)


def test_missing_probe_says_to_evaluate(tmp_path):
  with pytest.raises(FileNotFoundError, match='run the evaluation first'):
    probe.load_probe(str(tmp_path / 'probe_step1_digits.npz'))
  with pytest.raises(FileNotFoundError, match='run the evaluation first'):
    top5.top5_for_runs([str(tmp_path)], str(tmp_path / 'top5.png'))


def test_tsne_command(runs, tmp_path, monkeypatch):
  helpers.small_digits(monkeypatch)
  out = tmp_path / 'tsne.png'
  assert figures_cli.main(['figures', 'tsne', '--workdir', runs['simclr'],
                           '--n', '12', '--perplexity', '5', '--out',
                           str(out)]) == 0
  _assert_png_and_pdf(out)


def test_tsne_points_and_classwise_silhouette():
  rng = np.random.default_rng(0)
  n, labels = 12, np.repeat(np.arange(3), 4)
  unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
  centres = 5.0 * rng.normal(size=(3, 16))
  anchors = unit(centres[labels] + rng.normal(size=(n, 16)))
  pair = lambda s: tuple(unit(centres[labels] + s * rng.normal(size=(n, 16)))
                         for _ in range(2))
  views = view_quality.ViewEmbeddings(np.arange(n), anchors, pair(3.0),
                                      pair(0.5),
                                      0.1)
  points = tsne.tsne_points(views, perplexity=5)
  assert points['anchor'].shape == (n, 2)
  assert points['simclr'].shape == points['otclr'].shape == (2 * n, 2)
  np.testing.assert_array_equal(
      points['otclr'], tsne.tsne_points(views, perplexity=5)['otclr'])
  with pytest.raises(ValueError, match='perplexity'):
    tsne.tsne_points(views, perplexity=5 * n)
  sil = tsne.classwise_silhouette(views, labels, 4)
  z = np.concatenate(views.otclr)
  reference = metrics.silhouette_samples(z, np.tile(labels, 2))
  # The same sklearn call on the same embeddings and the same NumPy means.
  np.testing.assert_array_equal(sil['otclr'][:3],
                                [reference[np.tile(labels, 2) == c].mean()
                                 for c in range(3)])
  assert np.isnan(sil['otclr'][3])
  # Tighter views around the class centres separate the classes better.
  assert np.all(sil['otclr'][:3] > sil['simclr'][:3])


def test_the_tsne_map_shows_a_seeded_sample_and_the_panels_all(
    tmp_path, monkeypatch):
  rng = np.random.default_rng(0)
  n, labels = 40, np.repeat(np.arange(4), 10)  # class-ordered, as splits are
  unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
  pair = lambda: tuple(unit(rng.normal(size=(n, 8))) for _ in range(2))
  views = view_quality.ViewEmbeddings(np.arange(n), unit(rng.normal(
      size=(n, 8))), pair(), pair(), 0.1)
  test = data.Split(np.zeros((n, 8, 8, 3), np.uint8), labels.astype(np.int32),
                    4, ['a', 'b', 'c', 'd'])
  mapped, silhouettes = [], []
  real = tsne.tsne_points
  monkeypatch.setattr(tsne, 'tsne_points', lambda v, **k: mapped.append(
      v.indices) or real(v, **k))
  monkeypatch.setattr(tsne, 'classwise_silhouette', lambda v, *a: (
      silhouettes.append(v.indices),
      {'simclr': np.zeros(4), 'otclr': np.zeros(4)})[1])
  tsne.draw_tsne(views, test, tmp_path / 't.png', map_images=12,
                 perplexity=5, title='T')
  (indices,), (every,) = mapped, silhouettes
  assert len(indices) == 12 and len(set(labels[indices])) > 1
  np.testing.assert_array_equal(every, np.arange(n))
  _assert_png_and_pdf(tmp_path / 't.png')


def test_top5_command(runs, tmp_path, monkeypatch, capsys):
  helpers.small_digits(monkeypatch)
  out = tmp_path / 'top5.png'
  assert figures_cli.main(['figures', 'top5', '--workdir', runs['simclr'],
                           '--workdir', runs['otclr'], '--index', '3',
                           '--out', str(out)]) == 0
  _assert_png_and_pdf(out)
  preds = [top5.probe_predictions(w, 'digits', json.loads(
      (pathlib.Path(w) / 'eval' / 'results.json').read_text()), 8)
           for w in (runs['simclr'], runs['otclr'])]
  # float64 softmax over 10 classes: their sum (10), the division (1) and
  # the sum checked here (10).
  for p in preds:
    np.testing.assert_allclose(p.probs.sum(axis=1), 1.0,
                               rtol=helpers.rounding_tol(21, eps=helpers.EPS64))
  capsys.readouterr()
  assert figures_cli.main(['figures', 'top5', '--workdir', runs['otclr'],
                           '--index', '60', '--out', str(out)]) == 2
  assert '--index' in capsys.readouterr().err


def test_top5_draws_only_the_probe_its_results_were_made_with(
    runs, tmp_path, monkeypatch, capsys):
  helpers.small_digits(monkeypatch)
  workdir = pathlib.Path(helpers.copy_run(runs['otclr'], tmp_path))
  (probe_file,) = (workdir / 'eval').glob('probe_step*_digits*.npz')
  results_file = workdir / 'eval' / 'results.json'
  results = json.loads(results_file.read_text())
  assert probe_file.name in results['files']
  top5_cli = ['figures', 'top5', '--workdir', str(workdir),
              '--out', str(tmp_path / 't.png')]
  # A later evaluation, stopped after fitting its probe, rewrote it.
  original = probe_file.read_bytes()
  with open(probe_file, 'ab') as f:
    f.write(b'\0')
  assert figures_cli.main(top5_cli) == 2
  assert 'does not belong to' in capsys.readouterr().err
  probe_file.write_bytes(original)
  # An evaluation without the probe evaluator binds none.
  del results['files'][probe_file.name]
  results_file.write_text(json.dumps(results))
  assert figures_cli.main(top5_cli) == 2
  assert 'is not the probe of' in capsys.readouterr().err


def test_pick_index_finds_first_disagreement():
  def preds(top):
    probs = np.full((len(top), 4), 0.1)
    probs[np.arange(len(top)), top] = 0.7
    return top5.Predictions('run', probs, np.zeros(len(top), int), 8)

  assert top5.pick_index([preds([0, 1, 2, 3]), preds([0, 1, 3, 2])]) == 2
  assert top5.pick_index([preds([0, 1]), preds([0, 1])]) == 0


def _write_metrics(workdir, records):
  workdir.mkdir(parents=True)
  with open(workdir / 'metrics.jsonl', 'w') as f:
    for record in records:
      f.write(json.dumps(record) + '\n')


def test_curves_command(tmp_path, capsys):
  base = dict(epoch=0.0, grad_norm=1.0, images_per_sec=100.0)
  _write_metrics(tmp_path / 'sim', [
      dict(base, step=s, loss=5.0 - s / 10, nce=5.0 - s / 10, top1=0.1,
           lr=0.1) for s in (5, 10, 15)])
  # A resumed run logs step 10 twice: the later record counts.
  _write_metrics(tmp_path / 'ot', [
      dict(base, step=s, loss=l, nce=l, top1=0.2, lr=0.1, sinkhorn=-1.0,
           alpha=0.5) for s, l in ((5, 4.0), (10, 9.0), (10, 3.5), (15, 3.0))])
  m = curves.read_metrics(str(tmp_path / 'ot'))
  np.testing.assert_array_equal(m['step'], [5, 10, 15])
  np.testing.assert_array_equal(m['loss'], [4.0, 3.5, 3.0])
  fig = curves.plot_curves({'sim': curves.read_metrics(
      str(tmp_path / 'sim')), 'ot': m})
  titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
  # Sinkhorn is logged by one run; a constant alpha is not a curve.
  assert any('Sinkhorn' in t for t in titles)
  assert not any('alpha' in t for t in titles)
  out = tmp_path / 'figs' / 'curves.png'
  assert figures_cli.main(['figures', 'curves', '--workdir',
                           str(tmp_path / 'sim'), '--workdir',
                           str(tmp_path / 'ot'), '--out', str(out)]) == 0
  _assert_png_and_pdf(out)
  assert figures_cli.main(['figures', 'curves', '--workdir',
                           str(tmp_path / 'sim')]) == 0
  _assert_png_and_pdf(tmp_path / 'sim' / 'eval' / 'figures' / 'curves.png')
  with pytest.raises(FileNotFoundError, match='metrics.jsonl'):
    curves.curves_for_runs([str(tmp_path / 'none')], str(tmp_path / 'c.png'))
  capsys.readouterr()
  assert figures_cli.main(['figures', 'curves', '--workdir',
                           str(tmp_path / 'none')]) == 2
  err = capsys.readouterr().err
  assert 'metrics.jsonl' in err and 'Traceback' not in err


def test_report_draws_every_figure(runs, monkeypatch, capsys):
  helpers.small_digits(monkeypatch)
  figs = pathlib.Path(runs['simclr']) / 'eval' / 'figures'
  assert figures_cli.main(['figures', 'report', '--workdir', runs['simclr'],
                           '--compare', runs['otclr'], '--n', '12',
                           '--perplexity', '5']) == 0
  for name in ('tsne.png', 'curves.png', 'top5.png'):
    _assert_png_and_pdf(figs / name)
  assert 'skipped' not in capsys.readouterr().out


def test_run_config_from_file_and_overrides(tmp_path, monkeypatch, capsys):
  seen = []
  monkeypatch.setattr(tsne, 'tsne_for_run',
                      lambda workdir, config, out, **_: seen.append(config))
  tsne_cli = ['figures', 'tsne', f'--workdir={tmp_path}']
  assert figures_cli.main(tsne_cli + [
      '--config=configs/default.py', '--config.method=simclr',
      '--config.ot.epsilon=0.1', "--config.eval.datasets=('digits',)",
      '--config.dataset=folder:/data/x']) == 0
  config = seen.pop()
  assert (config.method, config.ot.epsilon, tuple(config.eval.datasets),
          config.dataset) == ('simclr', 0.1, ('digits',), 'folder:/data/x')
  (tmp_path / 'eval').mkdir()
  (tmp_path / 'eval' / 'config.json').write_text(config.to_json())
  assert figures_cli.main(tsne_cli) == 0
  assert (seen[0].method, seen[0].ot.epsilon) == ('simclr', 0.1)
  with pytest.raises(FileNotFoundError, match='run the evaluation first'):
    common.load_run_config(str(tmp_path / 'other'))
  capsys.readouterr()
  # Overrides need the config file they apply to.
  assert figures_cli.main(tsne_cli + ['--config.ot.grid_size=8']) == 2
  assert 'config.ot.grid_size' in capsys.readouterr().err


def test_a_config_file_takes_the_runs_own_settings(tmp_path, monkeypatch,
                                                   capsys):
  seen = []
  monkeypatch.setattr(tsne, 'tsne_for_run',
                      lambda workdir, config, out, **_: seen.append(config))
  trained = config_files.load('configs/digits.py')
  trained.ot.grid_size, trained.seed = 4, 3
  (tmp_path / 'config.json').write_text(trained.to_json())
  tsne_cli = ['figures', 'tsne', f'--workdir={tmp_path}',
              '--config=configs/digits.py']
  assert figures_cli.main(tsne_cli) == 0
  assert (seen[0].ot.grid_size, seen[0].seed) == (4, 3)
  capsys.readouterr()
  # A flag that contradicts the run would draw another run's views.
  assert figures_cli.main(tsne_cli + ['--config.ot.grid_size=8']) == 2
  assert 'ot.grid_size' in capsys.readouterr().err


def test_tilde_in_paths_is_the_home_directory(tmp_path, monkeypatch):
  monkeypatch.setenv('HOME', str(tmp_path))
  monkeypatch.chdir(tmp_path)
  _write_metrics(tmp_path / 'run', [dict(step=1, loss=2.0)])
  assert figures_cli.main(['figures', 'curves', '--workdir=~/run',
                           '--out=~/c.png']) == 0
  _assert_png_and_pdf(tmp_path / 'c.png')
  assert not (tmp_path / '~').exists()


def test_density_level_matches_gaussian_hdr():
  # Standard 2-d normal: the 50% highest-density region is the disc of
  # radius^2 = 2 ln 2, where the density is exp(-ln 2) / (2 pi) = 1 / (4 pi).
  xy = np.random.default_rng(0).normal(size=(20000, 2))
  pdf = np.exp(-0.5 * np.sum(xy**2, axis=1)) / (2 * np.pi)
  assert tsne.density_level(pdf, 0.5) == pytest.approx(1 / (4 * np.pi),
                                                       rel=0.02)
  assert np.mean(pdf >= tsne.density_level(pdf, 0.8)) == pytest.approx(
      0.8, abs=1e-3)
  with pytest.raises(ValueError, match='mass'):
    tsne.density_level(pdf, 1.0)


@pytest.mark.parametrize('num_classes', [2, 5])
def test_plot_tsne_panels(num_classes):
  rng = np.random.default_rng(0)
  labels = np.repeat(np.arange(num_classes), 6)
  n = len(labels)
  points = {'anchor': rng.normal(size=(n, 2)),
            'simclr': rng.normal(size=(2 * n, 2)),
            'otclr': rng.normal(size=(2 * n, 2))}
  rows = {g: {k: 0.5 for k, _, _ in tables.VIEW_METRICS +
              tables.CLUSTER_METRICS} for g in ('simclr', 'otclr')}
  sil = {'simclr': np.zeros(num_classes), 'otclr': np.full(num_classes, 0.1)}
  names = [f'kind{c}' for c in range(num_classes)]
  fig = tsne.plot_tsne(points, labels, names, view_rows=rows,
                       silhouettes=sil, max_classes=4)
  titles = [ax.get_title() for ax in fig.axes]
  shown = min(num_classes, 4)
  assert [t for t in titles if t.startswith('kind')] == [
      f'kind{c} (6 images)' for c in range(shown)]
  assert any('silhouette' in t for t in titles)
  assert any('P = OTCLR' in t for t in titles)
  with pytest.raises(ValueError, match='labels'):
    tsne.plot_tsne(points, labels[:-1], names)


def test_labels_and_panel_order_follow_the_runs_title(tmp_path, monkeypatch):
  # SimCLR with OT views is OTCLR, as the published sweeps spell it: the
  # figures had taken `method` alone and called it SimCLR, and put its top-5
  # panel first, where the SimCLR baseline's belongs.
  config = config_files.load('configs/default.py')
  config.method, config.views = 'simclr', 'ot'
  assert 'embedded by the OTCLR network' in tsne.figure_title(config, 4,
                                                              'digits', 8)
  runs = {}
  for views, title in (('ot', 'OTCLR'), ('augment', 'SimCLR')):
    runs[views] = str(tmp_path / views)
    rundir.write_json(os.path.join(runs[views], 'eval', 'results.json'), {
        'method': 'simclr', 'view_generator': views, 'title': title})
  assert common.run_label(runs['ot'], rundir.read_results(runs['ot'])) == (
      'OTCLR (ot)')
  order = []
  monkeypatch.setattr(top5, 'top5_for_runs',
                      lambda runs, *_, **__: order.extend(runs) or [])
  monkeypatch.setattr(curves, 'curves_for_runs', lambda *_: [])
  report.report(runs['ot'], config, compare=runs['augment'])
  assert order == [runs['augment'], runs['ot']]


def test_an_evaluation_without_views_still_draws_the_curves(tmp_path):
  # The t-SNE needs the views evaluator; the curves do not (a KeyError had
  # ended the figures).
  run = tmp_path / 'run'
  _write_metrics(run, [dict(epoch=0.0, grad_norm=1.0, images_per_sec=1.0,
                            step=s, loss=5.0, nce=5.0, top1=0.1, lr=0.1)
                       for s in (5, 10)])
  config = config_files.load('configs/digits.py')
  paths = report.report_single(config, str(run), views=None, test=None,
                               results={'step': 10, 'title': 'OTCLR'})
  assert [os.path.basename(p) for p in paths] == ['curves.png', 'curves.pdf']
