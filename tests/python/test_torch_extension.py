"""streamsafe.torch.install(): every torch.cuda memory call reaches streamsafe (values asserted)."""

import gc
import json
import time

import pytest

from conftest import run_child

torch = pytest.importorskip("torch")

MiB = 1 << 20


def test_installed_and_tensors_come_from_streamsafe(ss):
    before = ss.stats()["allocated_bytes.all.current"]
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    assert ss.stats()["allocated_bytes.all.current"] - before == 3 * MiB
    del x
    assert ss.stats()["allocated_bytes.all.current"] == before


def test_memory_stats_keys_and_values(ss):
    torch.cuda.synchronize()
    s0 = torch.cuda.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
                "active_bytes.all.current", "inactive_split_bytes.all.current", "requested_bytes.all.current",
                "allocation.all.current", "segment.all.current", "num_alloc_retries", "num_ooms",
                "num_device_alloc", "num_device_free", "num_sync_all_streams"):
        assert key in s0, key
    a0 = torch.cuda.memory_allocated()
    x = torch.empty(1000, dtype=torch.uint8, device="cuda")  # 1000 B asked, 1024 B block
    y = torch.empty(10 * MiB, dtype=torch.uint8, device="cuda")
    s1 = torch.cuda.memory_stats()
    assert torch.cuda.memory_allocated() - a0 == 1024 + 10 * MiB
    assert s1["allocated_bytes.all.current"] == ss.stats()["allocated_bytes.all.current"]
    assert s1["requested_bytes.all.current"] - s0["requested_bytes.all.current"] == 1000 + 10 * MiB
    assert s1["allocation.all.current"] - s0["allocation.all.current"] == 2
    assert s1["active_bytes.all.current"] >= s1["allocated_bytes.all.current"]
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    assert torch.cuda.memory_reserved() == ss.stats()["reserved_bytes.all.current"]
    del x, y
    assert torch.cuda.memory_allocated() == a0


def test_max_and_reset_peak(ss):
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    assert torch.cuda.max_memory_allocated() == base
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del x
    assert torch.cuda.max_memory_allocated() == base + 64 * MiB
    assert torch.cuda.max_memory_reserved() >= base + 64 * MiB
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() == base
    torch.cuda.reset_accumulated_memory_stats()
    assert torch.cuda.memory_stats()["allocated_bytes.all.allocated"] == 0
    y = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_stats()["allocated_bytes.all.allocated"] == 2 * MiB
    del y


def test_empty_cache_releases(ss):
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    del x
    torch.cuda.synchronize()
    r0 = torch.cuda.memory_reserved()
    assert r0 >= 256 * MiB
    torch.cuda.empty_cache()
    ss.reclaim()
    assert torch.cuda.memory_reserved() <= r0 - 256 * MiB
    assert ss.pending_release_bytes() == 0


def test_accelerator_calls_reach_streamsafe(ss):
    acc = torch.accelerator
    assert acc.current_accelerator().type == "cuda"
    if not hasattr(acc, "memory_allocated"):
        pytest.skip("torch.accelerator has no memory API in this torch")
    assert acc.memory_allocated() == torch.cuda.memory_allocated()
    assert acc.memory_reserved() == torch.cuda.memory_reserved()
    x = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
    del x
    torch.cuda.synchronize()
    r0 = acc.memory_reserved()
    acc.empty_cache()
    ss.reclaim()
    assert acc.memory_reserved() <= r0 - 128 * MiB
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == acc.memory_allocated()
    assert acc.memory_stats()["allocated_bytes.all.current"] == ss.stats()["allocated_bytes.all.current"]


def test_record_stream_reaches_streamsafe(ss):
    side = torch.cuda.Stream()
    plain = torch.empty(MiB, dtype=torch.uint8, device="cuda")
    e0 = ss.stats()["events_recorded"]
    del plain
    assert ss.stats()["events_recorded"] == e0  # a free without recorded uses records nothing
    x = torch.ones(MiB, dtype=torch.uint8, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2
    x.record_stream(side)
    e1 = ss.stats()["events_recorded"]
    del x
    assert ss.stats()["events_recorded"] == e1 + 1  # the free fenced the recorded use on `side`
    torch.cuda.synchronize()
    assert int(y[0]) == 2


def test_memory_summary_runs(ss):
    x = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    text = torch.cuda.memory_summary()
    assert "Allocated memory" in text and "GPU reserved memory" in text
    del x


def test_mem_get_info(ss):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ss.reclaim()
    free0, total = torch.cuda.mem_get_info()
    x = torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda")
    free1, total1 = torch.cuda.mem_get_info()
    assert total1 == total
    assert free0 - free1 >= 1000 * MiB
    del x


def test_memory_fraction_oom_and_observer(ss):
    calls = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *a: calls.append(a))
    total = torch.cuda.get_device_properties(0).total_memory
    ooms0 = torch.cuda.memory_stats()["num_ooms"]
    torch.cuda.set_per_process_memory_fraction(0.05)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="streamsafe") as info:
            torch.empty(int(total * 0.10), dtype=torch.uint8, device="cuda")
        assert "CUDA out of memory" in str(info.value)
        assert "allowed;" in str(info.value)  # PyTorch's form: "<cap> allowed;"
        x = torch.empty(int(total * 0.02), dtype=torch.uint8, device="cuda")  # within the cap
        del x
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert len(calls) == 1 and calls[0][0] == 0
    assert torch.cuda.memory_stats()["num_ooms"] == ooms0 + 1
    y = torch.empty(int(total * 0.10), dtype=torch.uint8, device="cuda")  # cap lifted
    del y


def test_snapshot_history_and_memory_viz(ss):
    torch.cuda.memory._record_memory_history(max_entries=10000)
    try:
        x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        ptr = x.data_ptr()
        snap = torch.cuda.memory._snapshot()
        blocks = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == ptr]
        assert len(blocks) == 1 and blocks[0]["state"] == "active_allocated" and blocks[0]["size"] == 8 * MiB
        assert any("test_torch_extension.py" in f["filename"] for f in blocks[0]["frames"])
        for s in snap["segments"]:
            assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["addr"] == ptr]
        assert allocs and allocs[-1]["size"] == 8 * MiB and allocs[-1]["frames"]
        del x
        snap = torch.cuda.memory._snapshot()
        actions = [e["action"] for e in snap["device_traces"][0] if e["addr"] == ptr]
        assert "free_requested" in actions and "free_completed" in actions
        from torch.cuda import _memory_viz
        assert "<html" in _memory_viz.trace_plot(snap).lower()
        assert "<html" in _memory_viz.segment_plot(snap).lower()
        assert "segment" in _memory_viz.segsum(snap)
        assert torch.cuda.memory_snapshot()  # the list of segments
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _capture(pool=None):
    static_in = torch.full((1 << 20,), 3.0, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            static_in * 2 + 1
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        static_out = (static_in * 2 + 1).sqrt()
    return g, static_in, static_out


def test_cuda_graph_private_and_shared_pools(ss):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ss.reclaim()
    r0 = torch.cuda.memory_reserved()
    g1, in1, out1 = _capture()
    g2, in2, out2 = _capture(pool=g1.pool())  # a pool shared between graphs
    in1.fill_(4.0)
    in2.fill_(12.0)
    g1.replay()
    g2.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out1, torch.full_like(out1, 3.0))
    assert torch.allclose(out2, torch.full_like(out2, 5.0))
    r1 = torch.cuda.memory_reserved()
    assert r1 > r0
    del g1, g2, out1, out2, in1, in2
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # releasePool ran for both graphs: their pool is releasable now
    ss.reclaim()
    assert torch.cuda.memory_reserved() <= r0


def test_mempool(ss):
    pool = torch.cuda.MemPool()
    # A MemPool as a graph pool works (it is a private graph pool then).
    g, static_in, static_out = _capture(pool=pool.id)
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(static_out, torch.full_like(static_out, 7.0 ** 0.5))
    # The same pool outside a capture (use_mem_pool): test_torch_conformance.py.
    with torch.cuda.use_mem_pool(pool):
        y = torch.empty(MiB, device="cuda")
    x = torch.empty(MiB, device="cuda")
    del x, y, g, static_out, static_in, pool
    gc.collect()


def test_ipc_handle_is_streamsafe_s(ss):
    x = torch.empty(MiB, dtype=torch.uint8, device="cuda")
    shared = x.untyped_storage()._share_cuda_()
    handle = shared[1]
    assert handle.startswith(b"streamsafe-ipc/1"), handle[:16]
    del shared, x
    gc.collect()


def test_compile_reduce_overhead(ss):
    f = torch.compile(lambda t: (t * 2 + 1).relu(), mode="reduce-overhead")
    t = torch.randn(1 << 16, device="cuda")
    try:
        for _ in range(4):
            out = f(t)
    except Exception as e:  # must name what is unsupported
        assert "streamsafe" in str(e) and "not supported" in str(e), str(e)
        print("torch.compile(mode='reduce-overhead'):", str(e).splitlines()[0])
        return
    torch.cuda.synchronize()
    assert torch.allclose(out, (t * 2 + 1).relu())


def test_version_guard(ss):
    with pytest.raises(RuntimeError, match="built for torch 2.10.0"):
        ss._check_version("2.10.0")
    ss._check_version(torch.__version__)


def test_install_refused_after_pytorch_allocated():
    rc, out = run_child(
        "import torch; x = torch.empty(1, device='cuda')\n"
        "import streamsafe.torch as s\n"
        "try:\n    s.install()\nexcept RuntimeError as e:\n    print('REFUSED', e)\n")
    assert rc == 0 and "REFUSED" in out and "already holds" in out, out


def test_environment_route():
    rc, out = run_child(
        "import torch, streamsafe.torch as s\n"
        "x = torch.empty(1 << 20, device='cuda')\n"
        "print('MODE', s.installed(), s.stats()['allocated_bytes.all.current'])\n",
        env={"STREAMSAFE_TORCH_INSTALL": "1", "STREAMSAFE_ALLOC_CONF": "backend:cuda_malloc"})
    assert rc == 0 and "MODE extension 4194304" in out, out


def test_defer_mode_never_blocks_and_reclaims():
    code = r'''
import json, time, torch, streamsafe.torch as s
s.install("backend:expandable,empty_cache:defer")
busy = torch.cuda.Stream()
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
busy.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(busy):
    a @ a  # cuBLAS set up on this stream first
torch.cuda.synchronize()
with torch.cuda.stream(busy):  # x written, then the stream spins about 1.5 s (3e9 cycles)
    x = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(4):
        a @ a
    x.fill_(1)
    torch.cuda._sleep(3_000_000_000)
del x
r0 = torch.cuda.memory_reserved()
t = time.perf_counter(); torch.cuda.empty_cache(); dt = time.perf_counter() - t
r1 = torch.cuda.memory_reserved()
pending = s.pending_release_bytes()
busy_done = busy.query()
torch.cuda.synchronize()
s.reclaim()
torch.cuda.empty_cache()
print("R", json.dumps({"ms": dt * 1e3, "pending": pending, "after": s.pending_release_bytes(), "busy_done": busy_done,
                       "released_at_call": r0 - r1, "released_in_all": r0 - torch.cuda.memory_reserved()}))
'''
    rc, out = run_child(code)
    assert rc == 0, out
    r = json.loads(out.split("R ", 1)[1].splitlines()[0])
    print("defer:", r)
    assert not r["busy_done"], r          # the busy stream was still running at the call
    assert r["released_at_call"] < 512 << 20, r  # the busy stream's block was not released under it
    assert r["released_at_call"] + r["pending"] <= r["released_in_all"], r
    assert r["released_in_all"] >= 512 << 20, r
    assert r["after"] == 0, r
    assert r["ms"] < 50, r                # no wait on the busy stream (its matmuls take longer)
