"""CUDA graph pools' checkpoints with streamsafe installed (docs/pytorch.md): what
torch.compile(mode="reduce-overhead")'s cudagraph trees do with getCheckpointState and
setCheckpointPoolState, and a model trained that way to the same loss as with PyTorch's
allocator."""

import gc
import json
import os

import pytest

from conftest import run_child

torch = pytest.importorskip("torch")


def _pool_blocks(pool):
    """(address, [(size, state), ...]) of each segment of the pool, free runs merged."""
    out = []
    for seg in torch.cuda.memory_snapshot():
        if seg["segment_pool_id"] == pool:
            out.append((seg["address"], seg["total_size"],
                        [(b["size"], b["state"]) for b in seg["blocks"]]))
    return sorted(out)


def _live(pool):
    return sum(b[1] == "active_allocated" for _, _, blocks in _pool_blocks(pool) for b in blocks)


def _graph(fn, pool=None):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s, pool=pool):
        out = fn()
    return g, out


def _restore(state, stale=(), keep=()):
    torch._C._cuda_setCheckpointPoolState(
        torch.cuda.current_device(), state,
        [t.untyped_storage()._cdata for t in stale],
        [t.untyped_storage()._cdata for t in keep])


def test_checkpoint_round_trip_keeps_blocks_kept_between_freed_ones(ss):
    def keep_three_of_twelve():
        bufs = [torch.ones(512, dtype=torch.uint8, device="cuda") for _ in range(12)]
        return bufs[3], bufs[7], bufs[8]  # apart, and side by side

    g, outs = _graph(keep_three_of_twelve)
    pool = g.pool()
    before = _pool_blocks(pool)
    assert before and _live(pool) == 3
    state = torch._C._cuda_getCheckpointState(torch.cuda.current_device(), pool)
    # The live outputs are stale (their storages lose the deleter); the restore allocates
    # their blocks again, without deleters: they are freed by raw_delete.
    _restore(state, stale=outs)
    assert _pool_blocks(pool) == before
    g.replay()
    torch.cuda.synchronize()
    assert all(bool((o == 1).all()) for o in outs)
    ptrs = [o.data_ptr() for o in outs]
    del outs
    gc.collect()
    assert _live(pool) == 3  # the storages died without freeing
    for p in ptrs:
        torch._C._cuda_cudaCachingAllocator_raw_delete(p)
    assert _live(pool) == 0
    del g
    gc.collect()


def test_restore_brings_back_outputs_that_died_and_frees_later_ones(ss):
    def two():
        return (torch.full((256,), 2, dtype=torch.uint8, device="cuda"),
                torch.full((256,), 3, dtype=torch.uint8, device="cuda"))

    g, outs = _graph(two)
    pool = g.pool()
    device = torch.cuda.current_device()
    state = torch._C._cuda_getCheckpointState(device, pool)
    ptrs = [o.data_ptr() for o in outs]
    del outs  # the tensors die after the checkpoint
    gc.collect()
    assert _live(pool) == 0
    g2, later = _graph(lambda: (torch.ones(256, dtype=torch.uint8, device="cuda"),), pool=pool)
    assert _live(pool) == 1
    _restore(state, stale=later)  # the later block is freed: its storage loses its deleter
    assert _live(pool) == 2
    del later  # frees nothing
    gc.collect()
    assert _live(pool) == 2
    torch._C._cuda_cudaCachingAllocator_raw_delete(ptrs[0])
    assert _live(pool) == 1
    torch._C._cuda_cudaCachingAllocator_raw_delete(ptrs[1])
    assert _live(pool) == 0
    del g, g2
    gc.collect()


def test_restore_gives_deleters_to_the_storages_named(ss):
    def three():
        return tuple(torch.full((n,), 5.0, device="cuda") for n in (128, 128, 1 << 20))

    g, outs = _graph(three)
    pool = g.pool()
    device = torch.cuda.current_device()
    state = torch._C._cuda_getCheckpointState(device, pool)
    meta = [(o.untyped_storage().data_ptr(), o.untyped_storage().nbytes(), o.shape) for o in outs]
    del outs
    gc.collect()
    assert _live(pool) == 0
    rebuilt = []
    for ptr, nbytes, shape in meta:
        s = torch._C._construct_storage_from_data_pointer(ptr, torch.device("cuda", device), nbytes)
        t = torch.empty(0, device="cuda")
        t.set_(s, 0, shape)
        rebuilt.append(t)
    _restore(state, keep=rebuilt[:2])
    assert _live(pool) == 3
    rebuilt[0] = None
    assert _live(pool) == 2
    rebuilt[1] = None
    assert _live(pool) == 1
    rebuilt[2] = None  # no deleter: stays allocated until raw_delete
    assert _live(pool) == 1
    torch._C._cuda_cudaCachingAllocator_raw_delete(meta[2][0])
    assert _live(pool) == 0
    del g
    gc.collect()


TRAIN = r'''
import json, time, torch
if CONF:  # else PyTorch's own allocator
    import streamsafe.torch as s
    s.install(CONF)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(256, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
def step(x, y):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss
def evaluate(x, y):
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y)
train = torch.compile(step, mode="reduce-overhead")
val = torch.compile(evaluate, mode="reduce-overhead")
g = torch.Generator(device="cuda").manual_seed(1)
w = torch.randn(64, 1, device="cuda", generator=g)
losses, t0 = [], time.perf_counter()
for i in range(60):
    n = 32 if i % 3 else 48  # two batch sizes: two graphs of each path
    x = torch.randn(n, 64, device="cuda", generator=g)
    model.train()
    torch.compiler.cudagraph_mark_step_begin()
    loss = train(x, x @ w)
    opt.step()
    losses.append(float(loss))
    if i % 5 == 4:  # the eval path between training steps
        model.eval()
        torch.compiler.cudagraph_mark_step_begin()
        losses.append(float(val(x, x @ w)))
torch.cuda.synchronize()
print("RESULT", json.dumps({"losses": losses, "seconds": time.perf_counter() - t0}))
'''


def _train(conf):
    rc, out = run_child(f"CONF = {conf!r}\n" + TRAIN, timeout=900)
    assert rc == 0, out
    line = [l for l in out.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.environ.get("STREAMSAFE_TEST_COMPILE"),
                    reason="four torch.compile runs (minutes): set STREAMSAFE_TEST_COMPILE=1")
@pytest.mark.parametrize("conf", ["backend:expandable", "backend:cuda_malloc"])
def test_compile_reduce_overhead_trains_like_pytorch(conf):
    ref = _train("")
    got = _train(conf)
    print(f"{conf}: final loss {got['losses'][-1]:.6f} in {got['seconds']:.2f} s; "
          f"PyTorch's allocator {ref['losses'][-1]:.6f} in {ref['seconds']:.2f} s")
    assert len(got["losses"]) == len(ref["losses"])
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4, abs=1e-6)
    assert got["losses"][-1] < got["losses"][0]
