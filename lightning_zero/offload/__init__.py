"""Storage tiers below the device that the ZeRO data path (``lightning_zero/zero/``) keeps tensors in:
host memory (``host.py``; page-locked on GPU machines). Nothing here imports ``zero/``: the arrow
points from the data path down to its storage."""
