"""Tests of otclr_jax/views.py: the OT view options on small photographs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import datasets

from configs import cifar10
from otclr_jax import augment
from otclr_jax import data
from otclr_jax import experiment
from otclr_jax import methods
from otclr_jax import ot
from otclr_jax import rundir
from otclr_jax import step as step_lib
from otclr_jax import views
from otclr_jax.evaluation import metrics
from tests.helpers import tiny_config

KEY = jax.random.key(7)
OPTIONS = {'ot.source': views.SOURCES, 'ot.detail': views.DETAILS,
           'ot.colour': views.COLOURS}
# Every option away from the paper's view at once.
ALL_ON = {'ot.source': 'weak', 'ot.detail': 'residual', 'ot.colour': 'after'}


@pytest.fixture(scope='module')
def photos():
  """16 photographs [16, 32, 32, 3] in [0, 1]: 128 px patches of
  scikit-learn's two sample images, averaged down 4 x 4."""
  sources = datasets.load_sample_images().images
  rng = np.random.default_rng(0)
  out = []
  for i in range(16):
    image = sources[i % 2]
    row = rng.integers(0, image.shape[0] - 128)
    col = rng.integers(0, image.shape[1] - 128)
    patch = image[row:row + 128, col:col + 128].astype(np.float32) / 255
    out.append(patch.reshape(32, 4, 32, 4, 3).mean(axis=(1, 3)))
  return jnp.asarray(np.stack(out))


def _config(**fields):
  """CIFAR-10's config (OTCLR, 32 px, m = 16) with dotted `fields` set."""
  config = cifar10.get_config()
  config.update_from_flattened_dict(fields)
  return config


def _views(config, images, key=KEY):
  return jax.jit(lambda x, k: views.make_views(config, x, k))(images, key)


@pytest.fixture(scope='module')
def option_views(photos):
  """`get(**fields)`: `make_views` of `_config(**fields)` on the photographs,
  computed once per module."""
  cache = {}

  def get(**fields):
    name = tuple(sorted(fields.items()))
    if name not in cache:
      cache[name] = _views(_config(**fields), photos)
    return cache[name]

  return get


def _pair_ratio(out):
  """Mean L2 between the two views over that between the strong views."""
  v1, v2, s1, s2 = out
  return float(metrics.pixel_l2(v1, v2) / metrics.pixel_l2(s1, s2))


def _high_freq_ratio(out):
  v1, v2, s1, s2 = (np.asarray(a) for a in out)
  power = metrics.high_frequency_power
  return (power(v1) + power(v2)) / (power(s1) + power(s2))


class TestOptions:
  """The OT view options: the paper's view by default, each option's effect."""

  @pytest.mark.parametrize('kind', ['ot', 'augment'])
  def test_defaults_are_bit_equal_to_the_paper_views(self, photos, kind):
    config = _config(views=kind, method='simclr')

    def paper(images, key):
      k1, k2 = jax.random.split(key)
      params = views.recipe(config).augment
      xs1 = augment.simclr_augment(k1, images, params)
      xs2 = augment.simclr_augment(k2, images, params)
      if kind == 'augment':
        return xs1, xs2, xs1, xs2
      generate = functools.partial(
          ot.ot_views, alpha=jnp.float32(0.5), grid_size=16, epsilon=0.05,
          num_iters=20, core='separable')
      return generate(images, xs1), generate(images, xs2), xs1, xs2

    expected = jax.jit(paper)(photos, KEY)
    for got, want in zip(_views(config, photos), expected):
      np.testing.assert_array_equal(got, want)

  @pytest.mark.parametrize('field, choices', OPTIONS.items())
  def test_an_unknown_option_fails_in_one_line_naming_the_field(
      self, field, choices):
    config = _config(**{field: 'x'})
    message = f"config.{field} must be one of {choices}, got 'x'."
    with pytest.raises(ValueError) as raised:
      views.recipe(config)
    assert str(raised.value) == message
    with pytest.raises(experiment.ConfigError) as raised:
      experiment.validate_config(config)
    assert str(raised.value) == message
    for value in choices:
      experiment.validate_config(_config(**{field: value}))

  @pytest.mark.parametrize('field', OPTIONS)
  def test_the_options_are_part_of_the_run_identity(self, field):
    default, changed = _config(), _config(**{field: OPTIONS[field][1]})
    assert field in rundir.identity(default.to_dict())
    assert rundir.result_changing_diff(default.to_dict(),
                                       changed.to_dict()) == [field]
    # The jitted step is keyed by (and closes over) every other field.
    assert field.split('.')[0] not in rundir.STEP_UNREAD_FIELDS

  def test_strong_source_transports_each_strong_view_to_itself(
      self, option_views):
    default = option_views()
    out = option_views(**{'ot.source': 'strong'})
    v1, v2, s1, s2 = out
    # The strong views are those of the default's keys.
    np.testing.assert_array_equal(s1, default[2])
    np.testing.assert_array_equal(s2, default[3])
    for view, strong in ((v1, s1), (v2, s2)):
      np.testing.assert_allclose(view, ot.ot_views(strong, strong), rtol=0,
                                 atol=1e-6)
    # No shared source: the views lie much farther apart.
    assert _pair_ratio(out) > _pair_ratio(default) + 0.2

  def test_weak_source_is_an_independent_crop_per_view(
      self, photos, option_views):
    default = option_views()
    out = option_views(**{'ot.source': 'weak'})
    np.testing.assert_array_equal(out[2], default[2])
    assert _pair_ratio(out) > _pair_ratio(default) + 0.1
    # With crops of the whole image and no flip, every weak crop is the image.
    whole = {'augment.crop_scale': (1.0, 1.0), 'augment.flip_prob': 0.0}
    np.testing.assert_allclose(
        _views(_config(**whole, **{'ot.source': 'weak'}), photos),
        _views(_config(**whole), photos), rtol=0, atol=1e-6)

  def test_residual_detail_restores_the_high_frequencies(
      self, photos, option_views):
    default = option_views()
    out = option_views(**{'ot.detail': 'residual'})
    assert _high_freq_ratio(default) < 0.4
    assert _high_freq_ratio(out) > 0.6
    # Transporting a strong view to itself and adding back what that removes
    # gives the strong view, up to float32 rounding.
    same = _views(_config(**{'ot.source': 'strong', 'ot.detail': 'residual'}),
                  photos)
    np.testing.assert_allclose(same[0], same[2], rtol=0, atol=1e-5)
    np.testing.assert_allclose(same[1], same[3], rtol=0, atol=1e-5)

  def test_colour_after_applies_the_strong_views_colour_draws(
      self, photos, option_views):
    default = option_views()
    out = option_views(**{'ot.colour': 'after'})
    np.testing.assert_array_equal(out[2], default[2])
    np.testing.assert_array_equal(out[3], default[3])
    assert float(jnp.abs(out[0] - default[0]).max()) > 0.05
    # Without colour operations, 'after' and 'before' are the same views.
    plain = {'augment.jitter_prob': 0.0, 'augment.grayscale_prob': 0.0,
             'augment.blur_prob': 0.0}
    np.testing.assert_allclose(
        _views(_config(**plain, **{'ot.colour': 'after'}), photos),
        _views(_config(**plain), photos), rtol=0, atol=1e-6)
    # Grayscale after the transport leaves grey views; before it, the colour
    # of the shared source leaks into them.
    grey = {**plain, 'augment.grayscale_prob': 1.0}
    spread = lambda v: float(jnp.max(v.max(-1) - v.min(-1)))
    after = _views(_config(**grey, **{'ot.colour': 'after'}), photos)
    before = _views(_config(**grey), photos)
    assert spread(after[0]) == 0.0 and spread(after[1]) == 0.0
    assert spread(before[0]) > 0.05

  def test_the_options_together_keep_views_in_range(
      self, photos, option_views):
    out = option_views(**ALL_ON)
    for view in out:
      assert view.shape == photos.shape
      assert float(view.min()) >= 0.0 and float(view.max()) <= 1.0

  @pytest.mark.parametrize('method', methods.NAMES)
  def test_every_method_steps_with_the_options_on(self, data_dir, method):
    config = tiny_config(data_dir, method=method, views='ot', **ALL_ON)
    experiment.validate_config(config)
    mesh = experiment.make_mesh()
    batch = data.load_split('digits', 'train', 8, data_dir).images[:16]
    if method == 'simclr':
      _, state, step = step_lib.build(config, 2, mesh)
      state, metrics_ = step(state, batch, jax.random.key(1))
      assert np.isfinite(float(metrics_['loss']))
      assert bool(np.all(metrics_['state_finite']))
      return
    # The others share the views: tracing and lowering their step suffices.
    run = step_lib.setup(config, 2)
    state = jax.eval_shape(functools.partial(
        step_lib.init_state, config, run.method, run.model, run.tx),
                           jax.random.key(0))
    step = step_lib.jit_train_step(run.method, config, run.model, run.tx,
                                   run.schedule, mesh, total_steps=4,
                                   steps_per_epoch=2)
    step.lower(state, batch, jax.random.key(1))
