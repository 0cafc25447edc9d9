"""streamsafe: a stream-safe block-caching CUDA allocator.

The PyTorch integration is the submodule streamsafe.torch (docs/pytorch.md):

    import streamsafe.torch
    streamsafe.torch.install("backend:expandable,empty_cache:defer")   # before the first CUDA allocation

Importing this package imports nothing else (torch is imported by streamsafe.torch only).
"""

__version__ = "0.1.0"
