"""streamsafe's own tests of three things PyTorch users read from the allocator (docs/pytorch.md):
the out-of-memory message (PyTorch's form first, then streamsafe's account, graph pools
included), PyTorch's allocator settings (applied, accepted or refused by name), and the memory
history (skip_actions, free stacks, user metadata, compile context, record_function
annotations, torch.profiler's memory records).
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

MiB = 1 << 20


def _oom_message(nbytes):
    with pytest.raises(torch.OutOfMemoryError) as e:
        torch.empty(nbytes, dtype=torch.int8, device="cuda")
    return str(e.value)


# A size as PyTorch's format_size writes it: "512 bytes" up to 1 KiB, then two decimals.
SIZE = r"(?:\d+ bytes|\d+\.\d\d (?:KiB|MiB|GiB))"


def test_oom_message_has_pytorchs_form_then_streamsafes_account(ss):
    keep = torch.zeros(1024, device="cuda")
    text = _oom_message(1024 * 1024 * 1024 * 800000000)
    # PyTorch's form, with its one optional clause: ", with X allocated in private pools (e.g.,
    # CUDA Graphs)," when CUDA graphs' private pools hold cached free memory (earlier tests in
    # the process may have left some), X being that free memory.
    m = re.search(
        r"CUDA out of memory\. Tried to allocate 800000000\.00 GiB\. GPU \d+ has a total capacity of "
        rf"\d+\.\d\d GiB of which {SIZE} is free\. "
        rf"Of the allocated memory {SIZE} is allocated by PyTorch, "
        rf"(?:with ({SIZE}) allocated in private pools \(e\.g\., CUDA Graphs\), )?"
        rf"and {SIZE} is reserved by PyTorch but unallocated\. streamsafe: ", text)
    assert m, text
    graph_free = re.search(rf"held by CUDA graphs' private pools \(({SIZE}) of it free\)", text)
    assert graph_free, text
    if m.group(1) is None:  # PyTorch leaves the clause out when nothing is free there
        assert graph_free.group(1) == "0 bytes", text
    else:
        assert m.group(1) == graph_free.group(1) != "0 bytes", text
    for part in ("cached (reserved, not allocated)", "queued for release behind fences",
                 "freed and waiting for other streams' work", "held by CUDA graphs' private pools"):
        assert part in text, text
    assert "PiB" not in text.split(" streamsafe: ")[0]
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate more than 1EB memory"):
        torch.empty(1024 * 1024 * 1024 * 8000000000, dtype=torch.int8, device="cuda")
    keep.fill_(1)
    assert bool((keep == 1).all())


def test_oom_message_counts_graph_pool_memory(ss):
    static_in = torch.ones(8 * MiB // 4, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (static_in * 2).sum()  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tmp = static_in * 3  # freed inside the capture: cached free in the graph's pool
        out = (tmp + 1).sum()
        del tmp
    g.replay()
    torch.cuda.synchronize()
    text = _oom_message(1024 * 1024 * 1024 * 800000000)
    held = re.search(r"(\S+ \S+) held by CUDA graphs' private pools \((\S+ \S+) of it free\)", text)
    assert held, text
    assert held.group(1) != "0 bytes", text
    assert held.group(2) != "0 bytes", text
    assert "allocated in private pools (e.g., CUDA Graphs)" in text, text
    del g, out


def _child(code, env_extra):
    env = dict(os.environ)
    env.pop("PYTORCH_ALLOC_CONF", None)  # it would win over PYTORCH_CUDA_ALLOC_CONF
    env.update(env_extra)
    env.pop("STREAMSAFE_TORCH_INSTALL", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


SETTINGS_CHILD = """
import torch, streamsafe.torch as sst
sst.install("backend:expandable")
torch.cuda.init()  # memory_stats() is {} until torch.cuda is initialised (PyTorch's own rule)
conf = sst.config()
assert "max_split_size_mb:64" in conf, conf
assert "roundup_power2_divisions:4" in conf, conf
key = "active_bytes.all.allocated"
before = torch.cuda.memory_stats()[key]
y = torch.rand(21 * 1024 * 1024, device="cuda")   # 84 MiB: 4 steps per power of two -> 96 MiB
assert torch.cuda.memory_stats()[key] - before == 96 * 1024 * 1024, torch.cuda.memory_stats()[key] - before
torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:4,pinned_use_cuda_host_register:True")
torch.cuda.memory._set_allocator_settings("")
for bad, name in (("roundup_power2_divisions:128", "roundup_power2_divisions"),
                  ("no_such_key:1", "no_such_key"),
                  ("backend:cudaMallocAsync", "backend")):
    try:
        torch.cuda.memory._set_allocator_settings(bad)
    except (RuntimeError, ValueError) as e:  # ValueError: PyTorch's own parser refused first
        assert name in str(e), (bad, str(e))
    else:
        raise AssertionError("accepted: " + bad)
print("OK")
"""


def test_pytorch_settings_applied_accepted_or_refused_by_name():
    r = _child(SETTINGS_CHILD, {
        "PYTORCH_CUDA_ALLOC_CONF":
            "max_split_size_mb:64,roundup_power2_divisions:4,pinned_use_cuda_host_register:True"})
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


RUNTIME_SETTINGS_CHILD = """
import torch, streamsafe.torch as sst
sst.install("backend:cuda_malloc")
torch.cuda.init()  # memory_stats() is {} until torch.cuda is initialised (PyTorch's own rule)
MiB = 1 << 20
key = "active_bytes.all.allocated"

def taken(n):
    before = torch.cuda.memory_stats()[key]
    t = torch.empty(n, dtype=torch.int8, device="cuda")
    return torch.cuda.memory_stats()[key] - before, t

d, t0 = taken(84 * MiB)
assert d == 84 * MiB, d
torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:4")
d, t1 = taken(84 * MiB)
assert d == 96 * MiB, d
torch.cuda.memory._set_allocator_settings(
    "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
d, t2 = taken(84 * MiB)   # 64 to 128 MiB: 8 steps
assert d == 88 * MiB, d
d, t3 = taken(400 * MiB)  # 256 to 512 MiB: 2 steps
assert d == 512 * MiB, d
# A call that leaves a key out puts it back to its value at install (none here).
torch.cuda.memory._set_allocator_settings("garbage_collection_threshold:0.5,max_split_size_mb:40")
d, t4 = taken(84 * MiB)
assert d == 84 * MiB, d
conf = sst.config()
assert "max_split_size_mb:40" in conf and "garbage_collection_threshold:0.5" in conf, conf
assert "roundup_power2_divisions:0" in conf, conf
assert torch.cuda.memory_stats()["max_split_size"] == 40 * MiB
meta = torch.cuda.memory._snapshot().get("allocator_settings", {})
assert meta.get("garbage_collection_threshold", 0.5) == 0.5, meta
# max_split_size from now on: the free blocks, all of 64 MiB or more, are no longer split for
# 14 MiB; it takes a segment of its own.
del t0, t1, t2, t3, t4
big = torch.empty(64 * MiB, dtype=torch.int8, device="cuda")
del big
small = torch.empty(14 * MiB, dtype=torch.int8, device="cuda")
seg = [g for g in torch.cuda.memory_snapshot()
       if g["address"] <= small.data_ptr() < g["address"] + g["total_size"]]
assert len(seg) == 1 and seg[0]["total_size"] < 40 * MiB, seg
# A bad value: refused, nothing changed.
try:
    torch.cuda.memory._set_allocator_settings("max_split_size_mb:64,roundup_power2_divisions:128")
except (RuntimeError, ValueError) as e:
    assert "roundup_power2_divisions" in str(e), str(e)
else:
    raise AssertionError("accepted roundup_power2_divisions:128")
assert "max_split_size_mb:40" in sst.config(), sst.config()
# expandable_segments after install: accepted, the backend stays, one warning (stderr).
torch.cuda.memory._set_allocator_settings("expandable_segments:True,max_split_size_mb:64")
torch.cuda.memory._set_allocator_settings("expandable_segments:True")
conf = sst.config()
assert "backend:cuda_malloc" in conf and "max_split_size_mb:0" in conf, conf
x = torch.ones(3 * MiB, device="cuda")
assert float(x.sum()) == 3 * MiB
print("OK")
"""


def test_pytorch_settings_change_at_runtime_on_every_allocator():
    r = _child(RUNTIME_SETTINGS_CHILD, {"PYTORCH_CUDA_ALLOC_CONF": ""})
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    assert r.stderr.count("keeps its cuda_malloc backend") == 1, r.stderr


def test_pytorch_settings_unknown_key_refuses_install():
    r = _child("import streamsafe.torch as sst\nsst.install('backend:expandable')\n",
               {"PYTORCH_CUDA_ALLOC_CONF": "no_such_key:1"})
    assert r.returncode != 0
    assert "no_such_key" in r.stderr


RELEASE_IN_SNAPSHOT_CHILD = """
import json, torch, streamsafe.torch as sst
sst.install("backend:%s,empty_cache:defer,release_worker:%s")
torch.cuda.init()
sync = %s


def release_here():
    torch.cuda.empty_cache()


for context in ("all", "alloc"):
    torch.cuda.memory._record_memory_history(context=context, stacks="python")
    x = torch.empty(8 << 20, dtype=torch.int8, device="cuda")
    addr = x.data_ptr()
    del x
    torch.cuda._sleep(200_000_000)  # the release fence is still pending at empty_cache ...
    release_here()
    if sync:
        torch.cuda.synchronize()    # ... and completes here; no allocator call after it
    ss = torch.cuda.memory._snapshot()  # (else the snapshot waits on it: the history is on)
    last = ss["device_traces"][0][-1]
    assert last["action"] in ("segment_free", "segment_unmap"), (context, last)
    assert not [g for g in ss["segments"]
                if g["address"] <= addr < g["address"] + g["total_size"]], (context, addr)
    # PyTorch: the releasing call's stack with context="all" only.
    assert ("release_here" in json.dumps(last)) == (context == "all"), (context, last)
    settings = ss["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"]
    assert settings == "max_split_size_mb:64", settings
    torch.cuda.memory._record_memory_history(None)
# Without the history a snapshot never waits on a fence: memory queued behind a running kernel
# still shows as a segment (cached), and the kernel is still running when the snapshot returns.
x = torch.empty(8 << 20, dtype=torch.int8, device="cuda")
addr = x.data_ptr()
del x
done = torch.cuda.Event()
torch.cuda._sleep(2_000_000_000)
done.record()
torch.cuda.empty_cache()
ss = torch.cuda.memory._snapshot()
assert not done.query(), "the snapshot waited on the fence without the history"
assert [g for g in ss["segments"] if g["address"] <= addr < g["address"] + g["total_size"]], addr
torch.cuda.synchronize()
torch.cuda.memory._set_allocator_settings("garbage_collection_threshold:0.5")
settings = torch.cuda.memory._snapshot()["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"]
assert settings == "garbage_collection_threshold:0.5", settings
print("OK")
"""


@pytest.mark.parametrize("backend", ["expandable", "cuda_malloc"])
@pytest.mark.parametrize("worker", ["off", "on"])
@pytest.mark.parametrize("sync", [True, False])
def test_snapshot_with_history_shows_the_release_empty_cache_queued(backend, worker, sync):
    # empty_cache:defer queues memory behind a fence that is still busy. The next snapshot, with
    # the memory history on, gives it back first: at once when the device is done (sync), or
    # after waiting on the fence (no sync), as PyTorch's synchronous empty_cache would have. The
    # trace ends with that segment event (with the empty_cache caller's stack under
    # context="all"), and the segment is gone. With the worker off nothing else would release it;
    # with the worker on it may have released it already. Without the history the snapshot never
    # waits (the end of the child).
    r = _child(RELEASE_IN_SNAPSHOT_CHILD % (backend, worker, sync),
               {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def _trace(device=0):
    return torch.cuda.memory._snapshot()["device_traces"][device]


def _stop_history():
    torch.cuda.memory._record_memory_history(enabled=None)


def test_segment_events_carry_the_stack_of_the_allocation_that_brought_the_memory_in(ss):
    # PyTorch's allocator records the allocating call's stack on the segment_alloc entry (and
    # torch.cuda._memory_viz's trace_plot(filter_freed=True) keeps only such entries of a
    # freed allocation); streamsafe's segment_alloc / segment_map entries do the same.
    def bring_in():
        return torch.empty(96 * MiB + 7, dtype=torch.int8, device="cuda")

    for context in ("alloc", "all", "state"):
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            ss.reclaim()  # what empty_cache queued is back with the driver: bring_in maps anew
            torch.cuda.memory._record_memory_history(context=context, stacks="python")
            t = bring_in()
            seg = [e for e in _trace() if e["action"] in ("segment_alloc", "segment_map")]
            assert seg, context
            names = {f["name"] for e in seg for f in e.get("frames", [])}
            assert ("bring_in" in names) == (context != "state"), (context, names)
            del t
        finally:
            _stop_history()


def test_history_off_drops_it_and_skip_actions_hold(ss):
    try:
        torch.cuda.memory._record_memory_history(context="all", stacks="python")
        x = torch.rand(128, 128, device="cuda")
        del x
        _stop_history()
        torch.cuda.memory._record_memory_history(context="all", stacks="python",
                                                 skip_actions=["alloc", "free_completed"])
        x = torch.rand(128, 128, device="cuda")
        del x
        actions = {e["action"] for e in _trace()}
        assert "free_requested" in actions, actions
        assert "alloc" not in actions and "free_completed" not in actions, actions
    finally:
        _stop_history()


def test_free_entries_carry_stacks_as_pytorch(ss):
    held = []

    def thealloc():
        held.append(torch.rand(3, 4, device="cuda"))

    def thefree():
        held.pop()  # the last reference: the free happens here

    try:
        for context in ("alloc", "all", "state"):
            _stop_history()
            torch.cuda.memory._record_memory_history(context=context)
            thealloc()
            thefree()
            trace = _trace()
            assert any(e["action"] == "free_requested" for e in trace), context
            text = json.dumps(trace)
            assert ("thefree" in text) == (context == "all"), context
            assert ("thealloc" in text) == (context != "state"), context
    finally:
        _stop_history()


def test_user_metadata_and_compile_context_on_every_entry(ss):
    try:
        torch.cuda.memory._set_memory_metadata("ss metadata")
        torch.cuda.memory._record_memory_history(context="all")
        x = torch.rand(64, 64, device="cuda")
        del x
        torch.cuda.memory._set_memory_metadata("")
        trace = _trace()
        allocs = [e for e in trace if e["action"] in ("alloc", "free_requested", "free_completed")]
        assert allocs
        for e in allocs:
            assert e["user_metadata"] == "ss metadata", e
            assert e["compile_context"] == "N/A", e
    finally:
        torch.cuda.memory._set_memory_metadata("")
        _stop_history()


def test_record_function_annotations_in_the_snapshot(ss):
    try:
        torch.cuda.memory._record_memory_history(context="all")
        with torch.autograd.profiler.record_function("ss_region"):
            x = torch.rand(64, 64, device="cuda")
            del x
        annotations = torch.cuda.memory._snapshot().get("external_annotations", [])
        assert "ss_region" in json.dumps(annotations), annotations
    finally:
        _stop_history()


def test_profiler_memory_records_come_from_streamsafe(ss):
    from torch.cuda._memory_viz import _profile_to_snapshot

    def allocate_here():
        x = torch.rand(128, 128, device="cuda")
        return (x * x + x * x).sum()

    with torch.profiler.profile(with_stack=True, profile_memory=True, record_shapes=True) as prof:
        allocate_here()
    assert "allocate_here" in json.dumps(_profile_to_snapshot(prof))
