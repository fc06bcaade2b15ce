"""Every private or version-dependent API of torch, transformers and torchao that tilefit
touches, wrapped here and nowhere else (tests/test_compat.py fails on a private torch import
outside this package).

- ``fake``: fake tensors, dispatch modes, aten schemas, pytrees, storage identity.
- ``modules``: which module is running (ModTracker), module paths on FX graph nodes, a
  module's parameter and buffer slots.
- ``amp``: GradScaler's private unscale and scale-update ops.
- ``compile``: Dynamo, AOTAutograd and Inductor (capture, partitioner, lowerings), and the
  rule a dispatch mode needs for functionalized mutating custom ops.
- ``distributed``: the fake process group, DTensor, storage resizes, DDP's bucket rebuild,
  MemTracker.
- ``transformers``: where transformers takes a different path on fake tensors, and its
  attention and checkpointing switches.
- ``torchao``: torchao's float8 training tensor and linear.
- ``cuda_memory``: the CUDA caching allocator's history (recorded requests, snapshots).

Importing this package imports nothing; each module imports torch.
"""
