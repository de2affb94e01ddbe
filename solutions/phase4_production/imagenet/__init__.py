"""The capstone: an ImageNet trainer (torchvision models, ImageFolder data, AMP, resumable, a
validated YAML config), its benchmark, configs and deployment files.

* ``benchmark``: The capstone's throughput: images/s, step breakdown and MFU beside
  torchvision's reference step.
* ``config``: The capstone's configuration: YAML files, ``key=value`` overrides, validated
  before launch.
* ``data``: The capstone's data: an ImageFolder or synthetic images, v2 transforms, loaders that
  feed a GPU.
* ``eval``: Top-1 / top-5 accuracy over the whole validation set, computed by every rank
  together.
* ``model``: The capstone's model: a torchvision network, channels_last, optionally compiled, in
  DDP.
* ``monitoring``: What the capstone shows while it runs: a progress bar on rank 0, and 4.5's
  monitor.
* ``recipe``: The ImageNet recipe: who gets weight decay, the learning rate over time, the loss.
* ``trainer``: The capstone: a resumable, multi-node ImageNet trainer built from the course's
  pieces.
"""
