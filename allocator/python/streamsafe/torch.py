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

import contextlib
import ctypes
import json
import os

import torch

__all__ = [
    "install", "install_pluggable", "installed", "config", "stats", "pending_release_bytes",
    "reclaim", "empty_cache", "memory_breakdown", "BUILT_FOR",
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
        lib.streamsafe_torch_ext_segments_json.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
        lib.streamsafe_torch_ext_pending_release_bytes.restype = ctypes.c_size_t
        lib.streamsafe_torch_ext_reclaim.restype = ctypes.c_size_t
        lib.streamsafe_torch_ext_empty_cache.restype = ctypes.c_size_t
        buf = (ctypes.c_char_p, ctypes.c_size_t)
        lib.streamsafe_torch_ext_tag_push.argtypes = (ctypes.c_char_p, ctypes.c_int) + buf
        lib.streamsafe_torch_ext_tag_pop.argtypes = buf
        lib.streamsafe_torch_ext_pause.argtypes = (ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int) + buf
        lib.streamsafe_torch_ext_resume.argtypes = (ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int) + buf
        lib.streamsafe_torch_ext_wait_resumed.argtypes = (ctypes.c_char_p, ctypes.c_int, ctypes.c_longlong) + buf
        lib.streamsafe_torch_ext_tag_status.argtypes = (ctypes.c_char_p, ctypes.c_int) + buf
        lib.streamsafe_torch_ext_empty_cache_tag.argtypes = (ctypes.c_char_p,) + buf
        lib.streamsafe_torch_ext_trim.argtypes = (ctypes.c_size_t,) + buf
        lib.streamsafe_torch_ext_settings.argtypes = (ctypes.c_char_p,) + buf
        lib.streamsafe_torch_ext_settings.restype = ctypes.c_int
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
    _route_allocator_settings(lib)
    return rc == 0


def _route_allocator_settings(lib):
    """torch.cuda.memory._set_allocator_settings goes to PyTorch's own parser first (its
    ValueError for a malformed setting stays), then to streamsafe: a key streamsafe cannot
    honour raises RuntimeError naming it (docs/pytorch.md, settings table)."""
    memory = torch.cuda.memory
    original = memory._set_allocator_settings
    if getattr(original, "_streamsafe", False):
        return

    def _set_allocator_settings(env):
        result = original(env)
        err = ctypes.create_string_buffer(4096)
        if lib.streamsafe_torch_ext_settings(str(env).encode(), err, len(err)) < 0:
            raise RuntimeError(err.value.decode())
        return result

    _set_allocator_settings._streamsafe = True
    _set_allocator_settings.__doc__ = original.__doc__
    memory._set_allocator_settings = _set_allocator_settings


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
    by the release worker now), release_worker_releases, pending_release_bytes, and the
    extension's backed_bytes (device memory of every streamsafe allocator of the device, what
    set_per_process_memory_fraction caps), limit_bytes (that cap, 0 = none), pool_instances)."""
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


def memory_breakdown(device=None):
    """What holds device memory now (the compiled extension): a dict of mapped bytes by holder,
    each also split into live blocks and free cache:
      "tags":        {tag: {"mapped", "allocated", "paused"}} of ordinary pools (paused: given
                     back by pause, mapped again at resume)
      "graph_pools": {tag or "": {...}} of CUDA graphs' private pools, by the tag they were
                     captured under ("" for none)
      "untagged":    {"mapped", "allocated"}: everything else (inputs, RNG state, cuBLAS
                     workspaces, cached free memory)
    plus "reserved" (the sum of "mapped"), "pending_release_bytes" (queued behind fences, still
    mapped) and the IPC counts "ipc_exports", "ipc_held_frees", "ipc_imports", "ipc_closing"."""
    if _mode != "extension":
        raise RuntimeError("streamsafe: memory_breakdown needs the compiled extension (install())")
    if device is None:
        device = torch.cuda.current_device()
    elif isinstance(device, torch.device):
        device = device.index if device.index is not None else torch.cuda.current_device()
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = _ext.streamsafe_torch_ext_segments_json(int(device), buf, len(buf))
        if n < 0:
            raise RuntimeError(f"streamsafe: memory_breakdown({device}) failed: {buf.value.decode()}")
        if n < size:
            break
        size = n + 1
    raw = json.loads(buf.value.decode())
    out = {"tags": {}, "graph_pools": {}, "untagged": {"mapped": 0, "allocated": 0}, "reserved": 0}
    for seg in raw["segments"]:
        if seg["graph"]:
            slot = out["graph_pools"].setdefault(seg["tag"], {"mapped": 0, "allocated": 0, "paused": 0})
        elif seg["tag"]:
            slot = out["tags"].setdefault(seg["tag"], {"mapped": 0, "allocated": 0, "paused": 0})
        else:
            slot = out["untagged"]
        slot["mapped"] += seg["mapped"]
        slot["allocated"] += seg["allocated"]
        if "paused" in slot:
            slot["paused"] += seg["paused"]
        out["reserved"] += seg["mapped"]
    for k in ("pending_release_bytes", "ipc_exports", "ipc_held_frees", "ipc_imports", "ipc_closing"):
        out[k] = raw.get(k, 0)
    return out


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


# ---- tags and sleep/wake (docs/sleep.md) ------------------------------------------------------

def _sleep_call(name, *args):
    if _mode != "extension":
        raise RuntimeError(
            f"streamsafe: {name} needs the compiled extension: call streamsafe.torch.install() "
            f"(the pluggable allocator has no tags)")
    out = ctypes.create_string_buffer(4096)
    rc = getattr(_ext, "streamsafe_torch_ext_" + name)(*args, out, len(out))
    result = json.loads(out.value.decode() or "{}")
    if rc < 0:
        if result.get("kind") == "out_of_memory":
            raise torch.OutOfMemoryError(result.get("error", name))
        raise RuntimeError(result.get("error", f"streamsafe: {name} failed"))
    return result


def _device_index(device):
    if device is None:
        return -1
    return torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index


@contextlib.contextmanager
def tag(name, all_threads=True):
    """Allocations made inside the block belong to the tag `name` (1 to 64 printable characters):
    they come from segments of their own, which pause(name) gives back to the driver and
    resume(name) maps again at the same addresses.

    all_threads=True (default) also tags allocations of threads with no tag of their own while
    the block runs, such as autograd's backward; all_threads=False tags the calling thread only.
    Blocks nest; the innermost wins.
    """
    _sleep_call("tag_push", name.encode(), int(bool(all_threads)))
    try:
        yield
    finally:
        _sleep_call("tag_pop")


def pause(name, mode="offload", wait=False, device=None):
    """Gives the tag's memory on `device` (default: the current device) back to the driver behind
    the release fence of every stream that may touch it; the addresses stay reserved, tensors of
    the tag keep their pointers, and touching them before resume() is an illegal address.

    mode: "offload" (contents copied to pinned host memory, stream-ordered, and restored by
    resume) or "discard" (contents lost, as for a KV cache). wait=False never blocks: the release
    worker finishes what is still behind a fence (tag_status() reports it); wait=True returns when
    all of it is back. Allocating under the tag raises RuntimeError until resume(). Returns the
    tag's status (a dict: phase, released_bytes, pending_bytes, offloaded_host_bytes,
    allocated_bytes, reserved_bytes). Needs backend:expandable.
    """
    if mode not in ("offload", "discard"):
        raise ValueError(f"streamsafe: pause mode {mode!r}: expected 'offload' or 'discard'")
    return _sleep_call("pause", name.encode(), _device_index(device), int(mode == "offload"), int(bool(wait)))


def resume(name, device=None, stream=None, wait=True):
    """Maps memory at the tag's addresses again and restores offloaded contents. Work enqueued
    after the call on the tag's streams and on `stream` (default: the current stream) sees the
    contents; the host does not wait for the device. Raises torch.OutOfMemoryError when the memory
    is not there (that part stays paused; call it again once memory is free). A no-op for an
    active tag. Returns the tag's status.

    wait=False hands the mapping to the release worker and returns at once (phase "resuming");
    call wait_resumed(name) before using the tag's tensors, which orders the streams then."""
    if stream is None:
        stream = torch.cuda.current_stream(device)
    return _sleep_call("resume", name.encode(), _device_index(device),
                       ctypes.c_void_p(stream.cuda_stream), int(not wait))


def wait_resumed(name, device=None, timeout_s=60.0):
    """Returns once a resume(name, wait=False) has mapped and restored the tag (or at the
    timeout: the status then says "resuming"); an out-of-memory on the worker is in "error"."""
    return _sleep_call("wait_resumed", name.encode(), _device_index(device), int(timeout_s * 1000))


def tag_status(name, device=None):
    """The tag's phase ("active", "pausing", "paused") and bytes (see pause())."""
    return _sleep_call("tag_status", name.encode(), _device_index(device))


def empty_cache_tag(name):
    """The tag's cached free memory (every device) back to the driver; returns bytes released."""
    return _sleep_call("empty_cache_tag", name.encode())["released_bytes"]


def trim(bytes_to_keep):
    """Gives cached free memory back, largest blocks first, until at most bytes_to_keep bytes stay
    cached on each device; returns bytes released."""
    return _sleep_call("trim", int(bytes_to_keep))["released_bytes"]


_route = os.environ.get("STREAMSAFE_TORCH_INSTALL", "").strip().lower()
if _route in ("1", "true", "yes", "ext", "extension"):
    install()
elif _route == "pluggable":
    install_pluggable()
elif _route not in ("", "0", "false", "no"):
    raise RuntimeError(f"streamsafe: STREAMSAFE_TORCH_INSTALL={_route!r}: expected 1 (extension), pluggable or 0")
