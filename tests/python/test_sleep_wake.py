"""streamsafe.torch tags, pause and resume on the GPU (docs/sleep.md): values asserted."""

import time

import pytest

from conftest import run_child

torch = pytest.importorskip("torch")

MiB = 1 << 20


def _settle(ss, name, limit_s=30.0):
    t0 = time.perf_counter()
    while ss.tag_status(name)["phase"] != "paused":
        assert time.perf_counter() - t0 < limit_s, ss.tag_status(name)
        time.sleep(0.001)


def test_offload_keeps_contents_and_gives_memory_back(ss):
    with ss.tag("pt_weights"):
        w = torch.arange(64 * MiB // 4, device="cuda", dtype=torch.float32)
    ptr = w.data_ptr()
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    st = ss.pause("pt_weights", mode="offload", wait=False)
    assert st["phase"] in ("pausing", "paused")
    _settle(ss, "pt_weights")
    st = ss.tag_status("pt_weights")
    assert st["reserved_bytes"] == 0
    assert st["released_bytes"] >= 64 * MiB
    assert st["offloaded_host_bytes"] >= 64 * MiB
    assert torch.cuda.mem_get_info()[0] >= free_before + 60 * MiB
    with pytest.raises(RuntimeError, match="pt_weights"):
        with ss.tag("pt_weights"):
            torch.empty(MiB, device="cuda")
    ss.resume("pt_weights")
    assert w.data_ptr() == ptr
    assert torch.equal(w, torch.arange(64 * MiB // 4, device="cuda", dtype=torch.float32))
    del w


def test_discard_and_the_side_stream_tail(ss):
    """A per-parameter tail on a side stream still runs at the pause: defer mode waits for it."""
    side = torch.cuda.Stream()
    out = torch.zeros(16, device="cuda")  # untagged: the pause leaves it alone
    with ss.tag("pt_grads"):
        grads = [torch.ones(4 * MiB, device="cuda") for _ in range(16)]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i, g in enumerate(grads):
                torch.cuda._sleep(100000)
                out[i] = g.sum()
        del grads
    ss.pause("pt_grads", mode="discard", wait=False)
    _settle(ss, "pt_grads")
    side.synchronize()
    ss.resume("pt_grads")
    assert out.tolist() == [4.0 * MiB] * 16
    del out


def test_pause_needs_the_expandable_backend():
    rc, out = run_child(
        "import torch, streamsafe.torch as s\n"
        "s.install('backend:cuda_malloc')\n"
        "with s.tag('x'):\n"
        "    t = torch.empty(1 << 20, device='cuda')\n"
        "try:\n"
        "    s.pause('x')\n"
        "except RuntimeError as e:\n"
        "    print('refused:', e)\n")
    assert rc == 0, out
    assert "refused:" in out and "expandable" in out


def test_unsafe_scope_faults_where_the_default_does_not():
    """The control: with release_fence:allocation_stream the pause ignores the side stream's tail,
    and the tail reads unmapped memory (an illegal address), as the crashing tools do."""
    code = (
        "import torch, streamsafe.torch as s\n"
        "s.install('backend:expandable,empty_cache:defer,release_fence:allocation_stream')\n"
        "side = torch.cuda.Stream()\n"
        "with s.tag('g'):\n"
        "    gs = [torch.ones(4 << 20, device='cuda') for _ in range(32)]\n"
        "acc = torch.zeros(32, device='cuda')\n"
        "side.wait_stream(torch.cuda.current_stream())\n"
        "with torch.cuda.stream(side):\n"
        "    for i, g in enumerate(gs):\n"
        "        torch.cuda._sleep(2000000)\n"
        "        acc[i] = g.sum()\n"
        "del gs\n"
        "s.pause('g', mode='discard', wait=False)\n"
        "torch.cuda.synchronize()\n"
        "print('sums', acc.tolist())\n")
    rc, out = run_child(code)
    assert rc != 0 and "illegal" in out.lower(), out


def test_touching_a_paused_tensor_is_an_illegal_address():
    """The tag's virtual range stays reserved and unmapped while paused: a kernel that reads it
    faults (never reads another tag's memory)."""
    code = (
        "import torch, streamsafe.torch as s\n"
        "s.install('backend:expandable')\n"
        "with s.tag('w'):\n"
        "    t = torch.ones(16 << 20, device='cuda')\n"
        "other = torch.full((16 << 20,), 7.0, device='cuda')\n"
        "s.pause('w', mode='discard', wait=True)\n"
        "print('sum', t.sum().item())\n")
    rc, out = run_child(code)
    assert rc != 0 and "illegal" in out.lower(), out
