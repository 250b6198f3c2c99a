"""The suite tests the CPU: its expectations are computed on the CPU, and training's exact resume
and batch_threads are CPU promises. On a machine with a GPU, `train.device=auto` would put the
runs there (17 of the suite's first 350 tests failed on an H200 for that and for its older
packages), so CUDA is hidden from this process and the commands it starts, before torch is
imported. The GPU paths are measured by benchmarks/gpu/."""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""
