"""PyTorch reference for `python -m otclr_jax.bench resnet`: ResNet-18 fwd+bwd.

PyTorch is not a dependency of the project; run this in a side environment:

  python3 -m venv /work/venvs/torch
  /work/venvs/torch/bin/pip install torch==2.14.1 torchvision==0.29.1 absl-py
  /work/venvs/torch/bin/python launch/bench_torch.py --batch_size=256
"""

import statistics
import time

from absl import app
from absl import flags
import torch
import torchvision

_BATCH_SIZE = flags.DEFINE_integer('batch_size', 256, 'Images per step.')
_IMAGE_SIZE = flags.DEFINE_integer('image_size', 32, 'Image side in pixels.')
_THREADS = flags.DEFINE_integer('threads', 2, 'torch.set_num_threads (cpu).')
_DEVICE = flags.DEFINE_string('device', 'cpu', "'cpu' or 'cuda'.")
_STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed steps first.')


def _real_taps(size: int, kernel: int, stride: int, pad: int) -> int:
  """(output, kernel offset) pairs along one axis that read a real pixel."""
  out = (size + 2 * pad - kernel) // stride + 1
  return sum(pad <= i + stride * o < pad + size
             for o in range(out) for i in range(kernel))


def conv_flops(model: torch.nn.Module, x: torch.Tensor) -> float:
  """Forward FLOPs of conv and linear layers on real pixels, as XLA counts."""
  total = 0.0

  def hook(module, inputs, output):
    nonlocal total
    if isinstance(module, torch.nn.Conv2d):
      (kh, kw), (sh, sw) = module.kernel_size, module.stride
      (ph, pw), (h, w) = module.padding, inputs[0].shape[-2:]
      total += (2.0 * output.shape[0] * module.in_channels
                * module.out_channels * _real_taps(h, kh, sh, ph)
                * _real_taps(w, kw, sw, pw))
    elif isinstance(module, torch.nn.Linear):
      total += 2.0 * output.numel() * module.in_features

  handles = [m.register_forward_hook(hook) for m in model.modules()]
  with torch.no_grad():
    model(x)
  for h in handles:
    h.remove()
  return total


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  batch_size, image_size = _BATCH_SIZE.value, _IMAGE_SIZE.value
  device = torch.device(_DEVICE.value)
  torch.set_num_threads(_THREADS.value)
  torch.manual_seed(0)
  model = torchvision.models.resnet18().to(
      device, memory_format=torch.channels_last)
  model.train()
  x = torch.rand(batch_size, 3, image_size, image_size).to(
      device, memory_format=torch.channels_last)
  flops = 3.0 * conv_flops(model, x)  # forward + two backward products

  def step():
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    if device.type == 'cuda':  # kernels run asynchronously
      torch.cuda.synchronize()

  for _ in range(_WARMUP.value):
    step()
  times = []
  for _ in range(_STEPS.value):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  ms = 1e3 * statistics.median(times)
  where = (f'{torch.cuda.get_device_name()} (cuDNN TF32 '
           f'{torch.backends.cudnn.allow_tf32})' if device.type == 'cuda'
           else f'{torch.get_num_threads()} threads')
  print(f'torch {torch.__version__} torchvision {torchvision.__version__}, '
        f'{where}; ResNet-18 fwd+bwd, batch '
        f'{batch_size}, {image_size}x{image_size}, '
        f'channels-last float32: median {ms:.1f} ms/step (min '
        f'{1e3 * min(times):.1f}) over {_STEPS.value} steps, '
        f'{flops / ms / 1e6:.1f} GFLOP/s')


if __name__ == '__main__':
  app.run(main)
