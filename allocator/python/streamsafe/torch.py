"""streamsafe as PyTorch's CUDA allocator (docs/pytorch.md).

Two ways in, both before the first CUDA allocation of the process:

    import streamsafe.torch
    streamsafe.torch.install("backend:expandable,empty_cache:defer")   # the compiled extension
    streamsafe.torch.install_pluggable("backend:expandable")           # no compiled extension

or set STREAMSAFE_TORCH_INSTALL=1 (extension) / =pluggable before `import streamsafe.torch`.
install() makes streamsafe PyTorch's CUDA allocator (c10::cuda::CUDACachingAllocator): every
torch.cuda memory call (empty_cache, record_stream, memory_stats, _snapshot,
set_per_process_memory_fraction, CUDA graphs, torch.accelerator.*) reaches it.
install_pluggable() goes through torch.cuda.memory.CUDAPluggableAllocator over
libstreamsafe_torch.so with every hook PyTorch offers there wired.

Configuration: the string given, else STREAMSAFE_ALLOC_CONF ("key:value,...", the keys of
streamsafe's options). install() applies it on top of the defaults
"empty_cache:defer,release_worker:auto": torch.cuda.empty_cache() fences and queues the cached
memory and returns at once, and a release worker thread gives it back to the driver once the
fences complete (release_worker:auto is on for a GPU in defer mode; empty_cache:wait or
release_worker:off in the string override it). Library paths: STREAMSAFE_TORCH_EXT_LIB / STREAMSAFE_TORCH_LIB override
the copies installed in this package.
"""

import ctypes
import json
import os

import torch

__all__ = [
    "install", "install_pluggable", "installed", "config", "stats", "pending_release_bytes",
    "reclaim", "empty_cache", "BUILT_FOR",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
try:
    from ._build_info import TORCH_VERSION as BUILT_FOR  # the torch.__version__ built against
except ImportError:  # a development tree without an installed build
    BUILT_FOR = None

_ext = None        # ctypes.CDLL of libstreamsafe_torch_ext.so once loaded
_pluggable = None  # (ctypes.CDLL, CUDAPluggableAllocator) once install_pluggable() ran
_mode = None       # "extension" | "pluggable"


def _library(file_name, env):
    path = os.environ.get(env)
    if path:
        if not os.path.isfile(path):
            raise RuntimeError(f"streamsafe: {env}={path} does not exist")
        return path
    path = os.path.join(_HERE, file_name)
    if os.path.isfile(path):
        return path
    raise RuntimeError(
        f"streamsafe: {file_name} is not installed beside {__file__}; install the package with "
        f"`pip install --no-build-isolation .` from the repository (torch must be importable while it "
        f"builds), or point {env} at a built copy")


def _check_version(built):
    have = torch.__version__
    if built is None:
        return
    if have != built and have.split("+")[0] != built:
        raise RuntimeError(
            f"streamsafe: the PyTorch extension was built for torch {built}, but torch {have} is "
            f"imported; rebuild it (`pip install --no-build-isolation .`) against this torch. The "
            f"CUDAAllocator interface changes between PyTorch releases (built and tested: "
            f"2.11.0+cu130).")


def _load_ext():
    global _ext
    if _ext is None:
        lib = ctypes.CDLL(_library("libstreamsafe_torch_ext.so", "STREAMSAFE_TORCH_EXT_LIB"))
        lib.streamsafe_torch_ext_torch_version.restype = ctypes.c_char_p
        lib.streamsafe_torch_ext_install.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t)
        lib.streamsafe_torch_ext_install.restype = ctypes.c_int
        lib.streamsafe_torch_ext_installed.restype = ctypes.c_int
        lib.streamsafe_torch_ext_config.argtypes = (ctypes.c_char_p, ctypes.c_size_t)
        lib.streamsafe_torch_ext_stats_json.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
        lib.streamsafe_torch_ext_pending_release_bytes.restype = ctypes.c_size_t
        lib.streamsafe_torch_ext_reclaim.restype = ctypes.c_size_t
        lib.streamsafe_torch_ext_empty_cache.restype = ctypes.c_size_t
        _check_version(BUILT_FOR or lib.streamsafe_torch_ext_torch_version().decode())
        _ext = lib
    return _ext


def install(conf=None):
    """Makes streamsafe PyTorch's CUDA allocator (the compiled extension).

    conf: "key:value,..." (None: STREAMSAFE_ALLOC_CONF), applied over the defaults
    "empty_cache:defer,release_worker:auto" (the worker is on). Call it before the first CUDA
    allocation; raises RuntimeError when PyTorch's allocator already holds memory, when the
    extension was built for another torch, or for a bad configuration. Calling it again is a
    no-op (the first configuration stays).
    """
    global _mode
    if _mode == "pluggable":
        raise RuntimeError("streamsafe: install_pluggable() already ran in this process")
    lib = _load_ext()
    err = ctypes.create_string_buffer(4096)
    rc = lib.streamsafe_torch_ext_install(conf.encode() if conf else None, err, len(err))
    if rc < 0:
        raise RuntimeError(err.value.decode())
    _mode = "extension"
    return rc == 0


def install_pluggable(conf=None):
    """Makes libstreamsafe_torch.so PyTorch's CUDA allocator through CUDAPluggableAllocator.

    Wires every hook of PyTorch 2.11's pluggable allocator: empty_cache (set_reset_fn),
    record_stream, memory fraction (refused by name: use memory_fraction in the configuration),
    init, base allocation and the CUDA graph pool hooks. memory_stats() and _snapshot() are not
    reachable this way (PyTorch raises); use streamsafe.torch.stats(). conf sets
    STREAMSAFE_ALLOC_CONF for this process (read at the first allocation).
    """
    global _pluggable, _mode
    if _mode == "extension":
        raise RuntimeError("streamsafe: install() already ran in this process")
    if _pluggable is not None:
        return False
    if conf is not None:
        os.environ["STREAMSAFE_ALLOC_CONF"] = conf
    path = _library("libstreamsafe_torch.so", "STREAMSAFE_TORCH_LIB")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "streamsafe_torch_alloc", "streamsafe_torch_free")
    lib = ctypes.CDLL(path)
    hooks = alloc._allocator
    address = lambda name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # noqa: E731
    hooks.set_init_fn(address("streamsafe_torch_init"))
    hooks.set_reset_fn(address("streamsafe_torch_reset"))
    hooks.set_memory_fraction_fn(address("streamsafe_torch_memory_fraction"))
    hooks.set_base_alloc_fn(address("streamsafe_torch_base_alloc"))
    hooks.set_record_stream_fn(address("streamsafe_torch_record_stream_fn"))
    hooks.set_begin_allocate_to_pool(address("streamsafe_torch_begin_allocate_to_pool"))
    hooks.set_end_allocate_to_pool_fn(address("streamsafe_torch_end_allocate_to_pool"))
    hooks.set_release_pool(address("streamsafe_torch_release_pool"))
    torch.cuda.memory.change_current_allocator(alloc)
    lib.streamsafe_torch_stats_json.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    lib.streamsafe_torch_empty_cache.restype = ctypes.c_size_t
    lib.streamsafe_torch_reclaim.restype = ctypes.c_size_t
    lib.streamsafe_torch_pending_release_bytes.restype = ctypes.c_size_t
    lib.streamsafe_torch_last_error.restype = ctypes.c_char_p
    _pluggable = (lib, alloc)
    _mode = "pluggable"
    return True


def installed():
    """"extension", "pluggable" or None."""
    if _mode == "extension" and _ext is not None and _ext.streamsafe_torch_ext_installed():
        return "extension"
    return _mode if _mode == "pluggable" else None


def config():
    """The options in use, as streamsafe writes them (extension), or STREAMSAFE_ALLOC_CONF."""
    if _mode == "extension":
        buf = ctypes.create_string_buffer(4096)
        _ext.streamsafe_torch_ext_config(buf, len(buf))
        return buf.value.decode()
    return os.environ.get("STREAMSAFE_ALLOC_CONF", "")


def stats(device=None):
    """streamsafe's statistics of one device: PyTorch's flat keys ("allocated_bytes.all.current",
    ...) plus streamsafe's counters (events_recorded, stream_waits, fence_waits, fence_wait_ns,
    releases_deferred, bytes_released, release_queued_bytes, release_worker_bytes (being given back
    by the release worker now), release_worker_releases, pending_release_bytes, ...)."""
    if device is None:
        device = torch.cuda.current_device()
    elif isinstance(device, torch.device):
        device = device.index if device.index is not None else torch.cuda.current_device()
    buf = ctypes.create_string_buffer(1 << 16)
    if _mode == "extension":
        n = _ext.streamsafe_torch_ext_stats_json(int(device), buf, len(buf))
    elif _mode == "pluggable":
        n = _pluggable[0].streamsafe_torch_stats_json(int(device), buf, len(buf))
    else:
        raise RuntimeError("streamsafe: not installed (call streamsafe.torch.install() first)")
    if n < 0:
        raise RuntimeError(f"streamsafe: stats({device}) failed: {buf.value.decode()}")
    return json.loads(buf.value.decode())


def pending_release_bytes():
    """Bytes freed by empty_cache() in defer mode that still wait behind their fences or are being
    given back by the release worker."""
    if _mode == "extension":
        return int(_ext.streamsafe_torch_ext_pending_release_bytes())
    if _mode == "pluggable":
        return int(_pluggable[0].streamsafe_torch_pending_release_bytes())
    return 0


def reclaim():
    """Finishes deferred releases whose fences completed (never blocks); returns bytes released."""
    if _mode == "extension":
        return int(_ext.streamsafe_torch_ext_reclaim())
    if _mode == "pluggable":
        return int(_pluggable[0].streamsafe_torch_reclaim())
    return 0


def empty_cache():
    """streamsafe's empty_cache (the configured mode); returns the bytes released by this call.
    torch.cuda.empty_cache() does the same but returns nothing."""
    if _mode == "extension":
        return int(_ext.streamsafe_torch_ext_empty_cache())
    if _mode == "pluggable":
        return int(_pluggable[0].streamsafe_torch_empty_cache())
    return 0


_route = os.environ.get("STREAMSAFE_TORCH_INSTALL", "").strip().lower()
if _route in ("1", "true", "yes", "ext", "extension"):
    install()
elif _route == "pluggable":
    install_pluggable()
elif _route not in ("", "0", "false", "no"):
    raise RuntimeError(f"streamsafe: STREAMSAFE_TORCH_INSTALL={_route!r}: expected 1 (extension), pluggable or 0")
