"""ImageNet-300 pretraining (1000 classes x 300 images, 32 x 32), batch 512, 20 epochs."""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = 'imagenet300'
  config.batch_size = 512
  config.eval.datasets = ('cifar10', 'cifar100', 'svhn_cropped', 'stl10',
                          'food101', 'oxford_iiit_pet')
  return config
