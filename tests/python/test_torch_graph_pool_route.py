"""Allocations routed into a CUDA graph's private pool with streamsafe installed
(docs/pytorch.md): what torch.compile's cudagraph trees do between captures
(beginAllocateCurrentThreadToPool / endAllocateToPool / releasePool), and side streams that
join a capture."""

import threading

import pytest

torch = pytest.importorskip("torch")

from test_torch_cudagraph_trees import _graph  # noqa: E402  (warm-up, then capture)

MiB = 1 << 20


def _pool_segments(pool):
    return [s for s in torch.cuda.memory_snapshot() if s["segment_pool_id"] == pool]


class _thread_to_pool:
    """The calling thread's allocations go to `pool` (on a stream of their own), as cudagraph
    trees route their warm-up and eager runs."""

    def __init__(self, pool):
        self.pool = pool
        self.device = torch.cuda.current_device()

    def __enter__(self):
        torch.cuda.synchronize()
        self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        self.ctx = torch.cuda.stream(self.stream)
        self.ctx.__enter__()
        torch._C._cuda_beginAllocateCurrentThreadToPool(self.device, self.pool)
        return self

    def __exit__(self, *exc):
        torch._C._cuda_endAllocateToPool(self.device, self.pool)
        torch._C._cuda_releasePool(self.device, self.pool)
        self.ctx.__exit__(*exc)
        torch.cuda.current_stream().wait_stream(self.stream)


def test_a_routed_thread_allocates_in_the_graph_pool_and_other_threads_do_not(ss):
    g, out = _graph(lambda: torch.ones(1024, device="cuda"))
    pool = g.pool()
    before = len(_pool_segments(pool))
    assert before >= 1
    others = []

    def elsewhere():
        others.append(torch.empty(8 * MiB, dtype=torch.uint8, device="cuda"))

    with _thread_to_pool(pool):
        routed = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    after_route = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    addrs = {b["address"] for s in _pool_segments(pool) for b in s["blocks"]
             if b["state"] == "active_allocated"}
    assert routed.data_ptr() in addrs
    assert others[0].data_ptr() not in addrs
    assert after_route.data_ptr() not in addrs
    assert len(_pool_segments(pool)) > before
    del routed, others, after_route, out, g


def test_the_pool_checkpoint_holds_routed_blocks_and_its_restore_frees_them(ss):
    g, out = _graph(lambda: torch.ones(1024, device="cuda"))
    pool = g.pool()
    device = torch.cuda.current_device()
    del out
    state = torch._C._cuda_getCheckpointState(device, pool)
    with _thread_to_pool(pool):
        routed = torch.ones(4 * MiB, dtype=torch.uint8, device="cuda")
    assert torch._C._cuda_checkPoolLiveAllocations(device, pool, {routed.data_ptr()})
    ptr = routed.data_ptr()
    torch._C._cuda_setCheckpointPoolState(device, state, [routed.untyped_storage()._cdata], [])
    live = {b["address"] for s in _pool_segments(pool) for b in s["blocks"]
            if b["state"] == "active_allocated"}
    assert ptr not in live
    assert torch._C._cuda_checkPoolLiveAllocations(device, pool, set())
    del routed, g


def test_a_graph_replays_correctly_after_eager_work_was_routed_into_its_pool(ss):
    x = torch.arange(1 << 16, device="cuda", dtype=torch.float32)

    def step():
        return (x * 2 + 1).sum()

    g, out = _graph(step)
    expected = float(step())
    for _ in range(5):
        with _thread_to_pool(g.pool()):
            junk = [torch.full((1 << 16,), 7.0, device="cuda") for _ in range(4)]
            del junk
        g.replay()
        torch.cuda.synchronize()
        assert float(out) == expected


def _capture_with_side_stream(x):
    """A capture on s0 computing z = x + 1, joined by s1 computing w = z * 2 (torch.cuda.Stream
    waits inside the capture), then joined back."""
    g = torch.cuda.CUDAGraph()
    s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
    s0.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s0):
        g.capture_begin()
        z = x + 1
    with torch.cuda.stream(s1):
        s1.wait_stream(s0)
        w = z * 2
    s0.wait_stream(s1)
    with torch.cuda.stream(s0):
        g.capture_end()
    return g, z, w


def test_a_side_stream_joined_into_a_capture_allocates_in_the_capture_pool(ss):
    existing = {s["segment_pool_id"] for s in torch.cuda.memory_snapshot()}
    x = torch.randn(10 * MiB, device="cuda")
    g, z, w = _capture_with_side_stream(x)
    new = [s for s in torch.cuda.memory_snapshot() if s["segment_pool_id"] not in existing]
    assert {s["segment_pool_id"] for s in new} == {g.pool()}
    addrs = {b["address"] for s in new for b in s["blocks"] if b["state"] == "active_allocated"}
    assert {z.data_ptr(), w.data_ptr()} <= addrs
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, (x + 1) * 2)
    del z, w, g


def test_a_side_stream_joined_into_a_capture_has_a_segment_of_its_own_in_the_pool(ss):
    # As PyTorch's allocator keeps one segment per pool and stream, expandable segments too.
    g, z, w = _capture_with_side_stream(torch.randn(10 * MiB, device="cuda"))
    assert len(_pool_segments(g.pool())) == 2
    del z, w, g


def _free_with_side_use_in_capture():
    """In a capture on s1: `a` read on s2, record_stream(s2), freed; one allocation before s1
    joins s2 back and one after. Returns a's address, the two allocations, b (= a * 3), g and
    the sink the graph writes."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        g.capture_begin()
        sink = torch.empty(64, device="cuda")
        a = torch.ones(64, device="cuda")
        a_ptr = a.data_ptr()
        s2.wait_stream(s1)
        with torch.cuda.stream(s2):
            b = a * 3
            a.record_stream(s2)
        del a
        before_join = torch.empty(64, device="cuda")
        s1.wait_stream(s2)
        sink.fill_(1.0)
        after_join = torch.empty(64, device="cuda")
        g.capture_end()
    torch.cuda.synchronize()
    return a_ptr, before_join, after_join, b, g, sink


def test_a_block_freed_with_a_side_stream_use_is_reused_in_the_capture_only_after_the_join(ss):
    a_ptr, before_join, after_join, b, g, sink = _free_with_side_use_in_capture()
    assert before_join.data_ptr() != a_ptr
    assert after_join.data_ptr() == a_ptr
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(b, torch.full_like(b, 3.0))
    del b, sink, before_join, after_join, g


def test_graph_capture_record_stream_reuse_false_holds_the_block_until_the_capture_ends(ss):
    try:
        torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:False")
        a_ptr, before_join, after_join, b, g, sink = _free_with_side_use_in_capture()
        assert after_join.data_ptr() != a_ptr  # held: PyTorch's meaning of False
        del before_join, after_join, b, g, sink
        torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
        a_ptr, before_join, after_join, b, g, sink = _free_with_side_use_in_capture()
        assert after_join.data_ptr() == a_ptr
        del before_join, after_join, b, g, sink
    finally:
        torch.cuda.memory._set_allocator_settings("")
