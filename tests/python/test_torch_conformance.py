"""streamsafe's own tests of what PyTorch users rely on beyond plain tensors (docs/pytorch.md):
MemPool outside a capture (use_mem_pool, a pool's own allocator, use_on_oom, one pool's snapshot
and empty_cache, live-allocation checks), caching_allocator_enable(False), statistics
(small_pool / large_pool, device-wide peaks), and CUDA IPC of tensors between two processes with its control.
"""

import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def _pool_segments(pool_id):
    return [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pool_id)]


def _wait_released(pool_id, ss, timeout_s=10.0):
    end = time.time() + timeout_s
    while time.time() < end:
        ss.reclaim()
        if not _pool_segments(pool_id):
            return True
        time.sleep(0.01)
    return False


def test_use_mem_pool_routes_only_the_calling_thread(ss):
    pool = torch.cuda.MemPool()
    assert pool.use_count() == 1
    other = {}

    def elsewhere():
        other["t"] = torch.empty(MiB, device="cuda")

    with torch.cuda.use_mem_pool(pool):
        assert pool.use_count() == 2
        x = torch.empty(4 * MiB, device="cuda")
        th = threading.Thread(target=elsewhere)
        th.start()
        th.join()
    assert pool.use_count() == 1
    y = torch.empty(4 * MiB, device="cuda")  # after the block: not the pool's
    addresses = {b["address"] for s in pool.snapshot() for b in s["blocks"] if b["state"] == "active_allocated"}
    assert x.data_ptr() in addresses
    assert other["t"].data_ptr() not in addresses
    assert y.data_ptr() not in addresses
    for s in pool.snapshot():
        assert tuple(s["segment_pool_id"]) == tuple(pool.id)
    del x, y, other, pool
    gc.collect()


def test_nested_use_mem_pool_innermost_wins(ss):
    p1, p2 = torch.cuda.MemPool(), torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(p1):
        a = torch.empty(MiB, device="cuda")
        with torch.cuda.use_mem_pool(p2):
            b = torch.empty(MiB, device="cuda")
        c = torch.empty(MiB, device="cuda")

    def live(pool):
        return {b_["address"] for s in pool.snapshot() for b_ in s["blocks"] if b_["state"] == "active_allocated"}

    assert {a.data_ptr(), c.data_ptr()} <= live(p1)
    assert b.data_ptr() in live(p2) and b.data_ptr() not in live(p1)
    del a, b, c, p1, p2
    gc.collect()


def test_empty_cache_keeps_a_live_pool_and_releases_it_with_the_pool(ss):
    torch.cuda.empty_cache()
    pool = torch.cuda.MemPool()
    pool_id = pool.id
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(8 * MiB, device="cuda")
    del x
    torch.cuda.empty_cache()  # PyTorch: a MemPool in use keeps its cache
    ss.reclaim()
    assert len(pool.snapshot()) >= 1
    del pool  # ~MemPool: emptyCache(its id)
    gc.collect()
    assert _wait_released(pool_id, ss), _pool_segments(pool_id)


def test_empty_cache_of_one_pool_in_threads(ss):
    pools = [torch.cuda.MemPool() for _ in range(4)]
    errors = []

    def work(pool):
        try:
            with torch.cuda.use_mem_pool(pool):
                t = torch.randn(1024, device="cuda")
                del t
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p,)) for p in pools]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for p in pools:
        assert len(p.snapshot()) == 1  # the live pools kept their cached segment
    del pools
    gc.collect()


def _pluggable_allocator(ss):
    path = ss._library("libstreamsafe_torch.so", "STREAMSAFE_TORCH_LIB")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "streamsafe_torch_alloc", "streamsafe_torch_free")
    lib = ctypes.CDLL(path)
    lib.streamsafe_torch_stats_json.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)

    def allocated():
        buf = ctypes.create_string_buffer(1 << 16)
        assert lib.streamsafe_torch_stats_json(torch.cuda.current_device(), buf, len(buf)) >= 0
        return json.loads(buf.value.decode())["allocated_bytes.all.current"]

    return alloc, allocated


def test_mempool_with_its_own_allocator(ss):
    # The pool's allocator here is streamsafe's pluggable library: a second allocator whose own
    # statistics show what the pool asked of it.
    alloc, allocated = _pluggable_allocator(ss)
    before = allocated()
    pool = torch.cuda.MemPool(alloc.allocator())
    with torch.cuda.use_mem_pool(pool):
        x = torch.full((MiB,), 3.0, device="cuda")
    assert allocated() >= before + 4 * MiB  # the pool's segment came from its allocator
    assert torch.cuda.memory_allocated() >= 4 * MiB  # and counts in the device's statistics
    assert len(pool.snapshot()) == 1
    assert float(x.sum()) == 3.0 * MiB
    del pool, alloc  # PyTorch keeps the allocator alive while the pool's memory lives
    gc.collect()
    assert allocated() >= before + 4 * MiB
    del x
    torch.cuda.empty_cache()  # the pool is gone and its memory free: back to its allocator
    assert allocated() == before


def _settle(ss):
    """Waits (up to 10 s) until nothing empty_cache() queued is left behind a fence."""
    deadline = time.monotonic() + 10
    while ss.pending_release_bytes() and time.monotonic() < deadline:
        ss.reclaim()
        time.sleep(0.001)
    assert ss.pending_release_bytes() == 0


@contextlib.contextmanager
def _cap_above_reserved(ss, extra_bytes):
    """set_per_process_memory_fraction to what stays reserved once the cache is emptied, plus
    extra_bytes; the fraction as before on exit. Yields the device's total memory."""
    torch.cuda.empty_cache()
    # Memory behind a pending fence is still reserved: the cap starts from what stays reserved.
    _settle(ss)
    _, total = torch.cuda.mem_get_info()
    fraction0 = torch.cuda.get_per_process_memory_fraction()
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + extra_bytes) / total)
    try:
        yield total
    finally:
        torch.cuda.set_per_process_memory_fraction(fraction0)


@contextlib.contextmanager
def _own_allocator_pool(ss, **kwargs):
    """A MemPool whose allocator is streamsafe's pluggable library; dropped and its memory given
    back on exit."""
    alloc, _ = _pluggable_allocator(ss)
    pool = torch.cuda.MemPool(alloc.allocator(), **kwargs)
    try:
        yield pool
    finally:
        del pool
        gc.collect()
        torch.cuda.empty_cache()


def test_use_on_oom_pool_serves_an_allocation_that_found_no_memory(ss):
    with _own_allocator_pool(ss, use_on_oom=True) as pool, _cap_above_reserved(ss, 48 * MiB):
        with torch.cuda.use_mem_pool(pool):
            a = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
        address = a.data_ptr()
        del a  # cached in the pool
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        c = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")  # from the pool's cache
        assert c.data_ptr() == address
        del c


def test_pool_with_its_own_allocator_at_the_cap_takes_the_default_pools_cache(ss):
    # One cap for the device: a pool whose allocator finds no room under it gets the memory the
    # default pool holds cached (given back first), as PyTorch's out-of-memory path does.
    with _own_allocator_pool(ss) as pool, _cap_above_reserved(ss, 48 * MiB) as total:
        a = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
        del a  # cached in the default pool
        with torch.cuda.use_mem_pool(pool):
            b = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_reserved() <= torch.cuda.get_per_process_memory_fraction() * total
        del b


def test_check_pool_live_allocations(ss):
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(MiB, device="cuda")
        y = torch.empty(MiB, device="cuda")
    device = torch.cuda.current_device()
    check = torch._C._cuda_checkPoolLiveAllocations
    assert check(device, pool.id, {x.data_ptr(), y.data_ptr()})
    assert not check(device, pool.id, {x.data_ptr()})
    del y
    assert check(device, pool.id, {x.data_ptr()})
    del x, pool
    gc.collect()


def test_caching_allocator_disabled_goes_to_cuda_malloc(ss):
    stream = torch.cuda.current_stream().cuda_stream
    start = torch.cuda.memory_stats()["requested_bytes.all.allocated"]
    torch.cuda.caching_allocator_enable(False)
    try:
        p = torch._C._cuda_cudaCachingAllocator_raw_alloc(MiB, stream)
        assert torch.cuda.memory_stats()["requested_bytes.all.allocated"] == start
        torch._C._cuda_cudaCachingAllocator_raw_delete(p)
        t = torch.ones(1000, device="cuda")
        assert float(t.sum()) == 1000.0
        del t
    finally:
        torch.cuda.caching_allocator_enable(True)
    p = torch._C._cuda_cudaCachingAllocator_raw_alloc(MiB, stream)
    assert torch.cuda.memory_stats()["requested_bytes.all.allocated"] == start + MiB
    torch._C._cuda_cudaCachingAllocator_raw_delete(p)


def test_reserved_read_right_after_empty_cache_on_an_idle_device(ss):
    """Read at once after empty_cache() (defer mode) on an idle device, memory_reserved() counts
    none of what that call queued: every fence has completed, so the statistics read finishes
    those releases first. A cap set from it then holds as after PyTorch's synchronous
    empty_cache() (4 GiB queued, some 200 driver unmaps, would still be in flight otherwise)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _settle(ss)
    held = torch.cuda.memory_reserved()
    xs = [torch.ones(64 * MiB, dtype=torch.uint8, device="cuda") for _ in range(64)]
    del xs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    assert reserved == held, (reserved - held) / MiB
    assert ss.pending_release_bytes() == 0
    # The cap a program derives from that read: two 40 MiB tensors fit in 100 MiB, a third does not.
    _, total = torch.cuda.mem_get_info()
    fraction0 = torch.cuda.get_per_process_memory_fraction()
    torch.cuda.set_per_process_memory_fraction((reserved + 100 * MiB) / total)
    try:
        a = torch.ones(40 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.ones(40 * MiB, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError):
            torch.ones(40 * MiB, dtype=torch.uint8, device="cuda")
        del a, b
    finally:
        torch.cuda.set_per_process_memory_fraction(fraction0)


def test_count_peaks_not_below_current(ss):
    side = torch.cuda.Stream()
    keep = [torch.empty(1024, device="cuda") for _ in range(8)]
    with torch.cuda.stream(side):
        keep += [torch.empty(1024, device="cuda") for _ in range(8)]
    stats = torch.cuda.memory_stats()
    for key in ("allocation", "active", "segment"):
        assert stats[f"{key}.all.peak"] >= stats[f"{key}.all.current"], key
    del keep


COUNTERS = ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
            "requested_bytes", "allocation", "segment", "active")


def _check_kinds_add_up(stats):
    for c in COUNTERS:
        for f in ("current", "allocated", "freed"):
            total = stats[f"{c}.small_pool.{f}"] + stats[f"{c}.large_pool.{f}"]
            assert total == stats[f"{c}.all.{f}"], (c, f)
        for kind in ("all", "small_pool", "large_pool"):
            assert stats[f"{c}.{kind}.peak"] >= stats[f"{c}.{kind}.current"], (c, kind)


def test_pool_kind_statistics_split_at_one_mib(ss):
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    with torch.cuda.stream(side):
        small = torch.empty(MiB, dtype=torch.uint8, device="cuda")  # 1 MiB exactly: small pool
        large = torch.empty(MiB + 512, dtype=torch.uint8, device="cuda")
    after = torch.cuda.memory_stats()
    for kind, size in (("small_pool", MiB), ("large_pool", MiB + 512)):
        assert after[f"allocation.{kind}.current"] - before[f"allocation.{kind}.current"] == 1, kind
        assert after[f"requested_bytes.{kind}.current"] - before[f"requested_bytes.{kind}.current"] == size
        assert after[f"segment.{kind}.current"] >= 1, kind
        assert after[f"reserved_bytes.{kind}.current"] > 0, kind
    _check_kinds_add_up(after)
    del small, large
    _check_kinds_add_up(torch.cuda.memory_stats())


def test_device_wide_peaks_of_two_streams(ss):
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    stats = torch.cuda.memory_stats()
    for c in COUNTERS:
        if c in ("reserved_bytes", "inactive_split_bytes"):
            continue  # memory being released behind fences may still count as reserved
        for kind in ("all", "small_pool", "large_pool"):
            assert stats[f"{c}.{kind}.peak"] == stats[f"{c}.{kind}.current"], (c, kind)
    base = stats["allocation.all.current"]
    base_small = stats["allocation.small_pool.current"]
    # a holds 4 blocks, b 1; a frees its 4, b takes 3 more. Device-wide peak: 5 blocks (neither
    # the sum of the streams' peaks, 8, nor the larger stream's, 4).
    with torch.cuda.stream(a):
        on_a = [torch.empty(64 * 1024, dtype=torch.uint8, device="cuda") for _ in range(4)]
    with torch.cuda.stream(b):
        on_b = [torch.empty(64 * 1024, dtype=torch.uint8, device="cuda")]
    del on_a
    with torch.cuda.stream(b):
        on_b += [torch.empty(64 * 1024, dtype=torch.uint8, device="cuda") for _ in range(3)]
    stats = torch.cuda.memory_stats()
    assert stats["allocation.all.current"] == base + 4
    assert stats["allocation.all.peak"] == base + 5
    assert stats["allocation.small_pool.peak"] == base_small + 5
    assert stats["active.all.peak"] >= base + 5
    _check_kinds_add_up(stats)
    del on_b


def test_graph_pool_counts_in_its_pool_kind(ss):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        a = torch.ones(4 * MiB // 4, device="cuda")  # 4 MiB: large pool
        pre = torch.cuda.memory_stats()
        g = torch.cuda.CUDAGraph()
        g.capture_begin()
        out = a.clone() + 1
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    post = torch.cuda.memory_stats()
    assert post["allocation.large_pool.current"] - pre["allocation.large_pool.current"] >= 1
    assert post["reserved_bytes.large_pool.current"] > pre["reserved_bytes.large_pool.current"]
    _check_kinds_add_up(post)
    g.replay()
    assert out.sum().item() == 2 * a.numel()
    del g, out
    gc.collect()
    _check_kinds_add_up(torch.cuda.memory_stats())


def _ipc(conf, mode):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.pop("STREAMSAFE_TORCH_INSTALL", None)
    p = subprocess.run([sys.executable, os.path.join(HERE, "ipc_scenario.py"), conf, mode], env=env,
                       capture_output=True, text=True, timeout=600)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0 and lines, p.stdout + p.stderr
    out = json.loads(lines[-1])
    print(out)
    return out


@pytest.mark.parametrize("conf", ["backend:expandable", "backend:cuda_malloc"])
def test_ipc_consumer_reads_while_producer_frees_and_allocates(ss, conf):
    out = _ipc(conf, "hold")
    assert out["consumer_error"] is None, out
    assert not out["reused"], out  # the sent block was held for the consumer
    assert out["read_ok"] and out["late_ok"], out


@pytest.mark.parametrize("conf", ["backend:expandable", "backend:cuda_malloc"])
def test_ipc_control_without_the_hold_reads_wrong_data(ss, conf):
    out = _ipc(conf, "control")
    if not out["reused"]:
        pytest.skip(f"the producer did not take the released block again: {out}")
    # The late read is queued after the producer wrote 9 into the block it took again.
    assert out["consumer_error"] is not None or out["late_ok"] is False, out
