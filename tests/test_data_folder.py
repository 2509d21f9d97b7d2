"""Tests of otclr_jax.data.folder: both decoders, every format, bad files."""

import os
import re
import struct
import zlib

import numpy as np
from PIL import Image
import pytest

from otclr_jax import data
from otclr_jax.data import folder
from otclr_jax.data import images
from tests.folder_trees import make_tree
from tests.folder_trees import S


def test_folder_pillow_matches_imagefolder(tmp_path):
  root = str(tmp_path / 'tree')
  exact = make_tree(root)
  for split in ('train', 'test'):
    pil = folder.prepare(root, split, S, backend='pillow')
    tfds_path = folder.prepare(root, split, S, backend='tfds')
    np.testing.assert_array_equal(pil.images, tfds_path.images)
    np.testing.assert_array_equal(pil.labels, tfds_path.labels)
    assert pil.class_names == tfds_path.class_names == [
        'cat', 'dog', 'emu', 'zebra']
  train = folder.prepare(root, 'train', S, backend='pillow')
  np.testing.assert_array_equal(train.labels, [0, 0, 0, 1, 1, 1, 3])
  # Files sort by name within a class: a.PNG, b.png, c.png.
  np.testing.assert_array_equal(
      train.images[0], exact[os.path.join(root, 'train', 'cat', 'a.PNG')])
  np.testing.assert_array_equal(
      train.images[1], exact[os.path.join(root, 'train', 'cat', 'b.png')])
  test = folder.prepare(root, 'test', S, backend='pillow')
  np.testing.assert_array_equal(test.labels, [0, 2])


def test_split_too_large_for_memory_is_refused(tmp_path, monkeypatch):
  root = str(tmp_path / 'tree')
  make_tree(root)
  monkeypatch.setattr(images, 'MAX_IN_MEMORY_BYTES', 6 * S * S * 3)
  with pytest.raises(ValueError, match='no streaming mode'):
    data.load_split('folder:' + root, 'train', S, tmp_path / 'data')


def test_scan_fingerprint_follows_files_and_classes(tmp_path):
  root = str(tmp_path / 'tree')
  make_tree(root)
  first = folder.scan(root, 'train')
  assert folder.scan(root, 'train') == first
  # A file rewritten with other content (and size) changes the fingerprint.
  path = os.path.join(root, 'train', 'zebra', 'q.png')
  Image.fromarray(np.zeros((5, 7, 3), np.uint8)).save(path)
  second = folder.scan(root, 'train')
  assert second.digest != first.digest and second.files == first.files
  # Only the mtime changes: a touched file counts as changed too.
  stat = os.stat(path)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  assert folder.scan(root, 'train').digest != second.digest
  # A class added to another split changes the class list of this one.
  os.makedirs(os.path.join(root, 'test', 'ant'))
  assert folder.scan(root, 'train').class_names[0] == 'ant'


def _png16(path, array):
  """Writes uint16 [H, W, C] (C = 1, 2, 3, 4) as a 16-bit PNG (no encoder
  needed: Pillow cannot write 16-bit colour)."""
  height, width, channels = array.shape
  color_type = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
  raw = b''.join(b'\x00' + row.astype('>u2').tobytes() for row in array)

  def chunk(kind, payload):
    return (struct.pack('>I', len(payload)) + kind + payload +
            struct.pack('>I', zlib.crc32(kind + payload) & 0xFFFFFFFF))

  with open(path, 'wb') as f:
    f.write(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack(
        '>IIBBBBB', width, height, 16, color_type, 0, 0, 0)) +
            chunk(b'IDAT', zlib.compress(raw)) + chunk(b'IEND', b''))


def test_both_backends_decode_every_format_identically(tmp_path):
  rng = np.random.default_rng(0)
  root = tmp_path / 'tree'
  cls = root / 'train' / 'a'
  cls.mkdir(parents=True)
  rgb = rng.integers(0, 256, (S, S, 3), dtype=np.uint8)
  gray16 = rng.integers(0, 65536, (S, S), dtype=np.uint16)
  Image.fromarray(gray16).save(cls / '01_gray16_pillow.png')
  _png16(cls / '02_gray16.png', gray16[..., None])
  _png16(cls / '03_gray_alpha16.png',
         rng.integers(0, 65536, (S, S, 2), dtype=np.uint16))
  _png16(cls / '04_rgb16.png', rng.integers(0, 65536, (S, S, 3),
                                            dtype=np.uint16))
  _png16(cls / '05_rgba16.png', rng.integers(0, 65536, (S, S, 4),
                                             dtype=np.uint16))
  image = Image.fromarray(rgb)
  image.convert('1').save(cls / '06_bilevel.png')
  image.convert('LA').save(cls / '07_gray_alpha.png')
  image.convert('P').save(cls / '08_palette.png')
  image.convert('P').save(cls / '09_palette_transparent.png', transparency=0)
  Image.fromarray(np.dstack([rgb, rgb[..., 0]])).save(cls / '10_rgba.png')
  image.convert('CMYK').save(cls / '11_cmyk.jpg', quality=95)
  image.convert('L').save(cls / '12_gray.jpg', quality=90)
  pil = folder.prepare(str(root), 'train', S, backend='pillow')
  tfds_path = folder.prepare(str(root), 'train', S, backend='tfds')
  for index, name in enumerate(sorted(os.listdir(cls))):
    np.testing.assert_array_equal(pil.images[index], tfds_path.images[index],
                                  err_msg=name)
  # 16-bit gray keeps its high byte (Pillow's convert('RGB') clips to 255).
  expected = np.repeat((gray16 >> 8).astype(np.uint8)[..., None], 3, axis=-1)
  np.testing.assert_array_equal(pil.images[0], expected)
  np.testing.assert_array_equal(pil.images[1], expected)


@pytest.mark.parametrize('backend', ['pillow', 'tfds'])
@pytest.mark.parametrize('content', ['truncated', 'empty', 'text'])
def test_undecodable_folder_file_is_named(tmp_path, backend, content):
  root = str(tmp_path / 'tree')
  make_tree(root)
  bad = os.path.join(root, 'train', 'dog', 'w.jpg')
  with open(os.path.join(root, 'train', 'dog', 'y.jpg'), 'rb') as f:
    jpeg = f.read()
  with open(bad, 'wb') as f:
    f.write({'truncated': jpeg[:len(jpeg) // 2], 'empty': b'',
             'text': b'<html>404 Not Found</html>'}[content])
  with pytest.raises(ValueError, match=re.escape(bad)):
    folder.prepare(root, 'train', S, backend=backend)
  # The other split is unaffected.
  assert len(folder.prepare(root, 'test', S, backend=backend).labels) == 2
