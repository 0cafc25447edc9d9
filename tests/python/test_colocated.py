"""The pieces examples/pytorch/colocated_rl.py needs (docs/colocated_rl.md), on the GPU: a CUDA
graph that replays across a pause and a resume of the memory it reads, an interprocess event that
orders two streamsafe processes, CUDA IPC of tensors between two streamsafe processes, the memory
cap beside paused memory, and the example's own rows bit for bit on a tiny model."""

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import run_child

torch = pytest.importorskip("torch")

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pytorch", "colocated_rl.py")


def _settle(ss, name, limit_s=30.0):
    t0 = time.perf_counter()
    while ss.tag_status(name)["phase"] != "paused":
        assert time.perf_counter() - t0 < limit_s, ss.tag_status(name)
        time.sleep(0.001)


def test_graph_replays_across_pause_and_resume(ss):
    """The engine's case: a decode graph reads a tagged static cache; the tag is paused while
    replays are still queued (the fence waits for them), then resumed at the same addresses, and
    the same graph replays correctly without a new capture."""
    with ss.tag("cg_cache"):
        # Small integers: every partial sum of 0.5 * cache is exact in float32, so the 41 additions
        # equal one multiplication bit for bit (arange's values up to 4 Mi would round).
        cache = (torch.arange(16 * MiB // 4, device="cuda") % 1000).to(torch.float32)
    out = torch.zeros_like(cache)  # untagged: stays mapped
    ptr = cache.data_ptr()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.add_(cache * 0.5)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.add_(cache * 0.5)
    torch.cuda.synchronize()
    out.zero_()
    for _ in range(40):  # queued, not waited for
        g.replay()
    st = ss.pause("cg_cache", mode="offload", wait=False)
    assert st["phase"] in ("pausing", "paused")
    _settle(ss, "cg_cache")
    assert ss.tag_status("cg_cache")["reserved_bytes"] == 0
    ss.resume("cg_cache")
    assert cache.data_ptr() == ptr
    g.replay()
    torch.cuda.synchronize()
    expect = (torch.arange(16 * MiB // 4, device="cuda") % 1000).to(torch.float32) * 0.5 * 41
    assert torch.equal(out, expect)
    del g, cache, out


def test_discarded_cache_is_rewritten_and_the_graph_stays_valid(ss):
    """Discard (the KV cache): contents are lost, the addresses stay, and a graph that writes the
    cache first and then reads it gives the right answer after the resume."""
    with ss.tag("cg_kv"):
        kv = torch.zeros(8 * MiB // 4, device="cuda")
    src = torch.full_like(kv, 3.0)
    res = torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kv.copy_(src)
        res.copy_(kv.sum().view(1))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kv.copy_(src)
        res.copy_(kv.sum().view(1))
    g.replay()
    ss.pause("cg_kv", mode="discard", wait=False)
    _settle(ss, "cg_kv")
    ss.resume("cg_kv")
    src.fill_(2.0)
    g.replay()
    torch.cuda.synchronize()
    assert res.item() == 2.0 * kv.numel()
    del g, kv


def test_graph_captured_under_a_tag_sleeps_with_it(ss):
    """The engine's decode graph captured under a tag: its private pool (intermediates, the
    capture stream's cuBLAS workspace) is the tag's memory. pause(discard) with replays still
    queued gives it back (memory_breakdown shows nothing of the graph's pool mapped), and resume
    maps it at the same addresses: the same graph replays correctly without a new capture."""
    w = torch.randn(1024, 1024, device="cuda")
    x = torch.randn(64, 1024, device="cuda")
    out = torch.zeros(64, 1024, device="cuda")
    s = torch.cuda.Stream()
    with ss.tag("cg_graph"):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out.copy_(torch.relu(x @ w) @ w)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out.copy_(torch.relu(x @ w) @ w)  # the intermediate lives in the graph's pool
    torch.cuda.synchronize()
    held = ss.memory_breakdown()["graph_pools"].get("cg_graph", {}).get("mapped", 0)
    assert held > 0, ss.memory_breakdown()
    for _ in range(20):  # queued, not waited for
        g.replay()
    ss.pause("cg_graph", mode="discard", wait=False)
    _settle(ss, "cg_graph")
    assert ss.memory_breakdown()["graph_pools"].get("cg_graph", {}).get("mapped", 0) == 0
    ss.resume("cg_graph")
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, torch.relu(x @ w) @ w)
    del g


_EVENT_PRODUCER = """
import sys, torch, streamsafe.torch as s
s.install('backend:expandable')
torch.cuda.init()
ev = torch.cuda.Event(interprocess=True)
ev.record()
print(bytes(ev.ipc_handle()).hex(), flush=True)
sys.stdin.readline()                   # the consumer has opened the event
torch.cuda._sleep(int(sys.argv[1]))    # a long kernel before the record
ev.record()
print("recorded", flush=True)
sys.stdin.readline()                   # keep the event alive until the consumer is done
"""

_EVENT_CONSUMER = """
import sys, time, torch, streamsafe.torch as s
s.install('backend:expandable')
torch.cuda.init()
ev = torch.cuda.Event.from_ipc_handle(0, bytes.fromhex(sys.argv[1]))
print("opened", flush=True)
sys.stdin.readline()                   # the producer has recorded after its long kernel
torch.cuda.current_stream().wait_event(ev)
mine = torch.cuda.Event()
mine.record()
early = mine.query()
t0 = time.perf_counter()
mine.synchronize()
print("early", early, "waited_ms", (time.perf_counter() - t0) * 1e3, flush=True)
"""


def test_interprocess_event_orders_two_streamsafe_processes():
    """The hand-over's ordering: the engine's stream waits on the device for the trainer's event
    (and the trainer's for the engine's copy), with streamsafe installed in both."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("STREAMSAFE_TORCH_INSTALL", None)
    popen = dict(env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prod = subprocess.Popen([sys.executable, "-c", _EVENT_PRODUCER, str(2_000_000_000)], **popen)
    cons = None
    try:
        handle = prod.stdout.readline().strip()
        assert handle, prod.stderr.read()
        cons = subprocess.Popen([sys.executable, "-c", _EVENT_CONSUMER, handle], **popen)
        assert cons.stdout.readline().strip() == "opened", cons.stderr.read()
        prod.stdin.write("go\n")
        prod.stdin.flush()
        assert prod.stdout.readline().strip() == "recorded", prod.stderr.read()
        cons.stdin.write("go\n")
        cons.stdin.flush()
        out, err = cons.communicate(timeout=120)
        assert cons.returncode == 0, out + err
        words = out.split()
        assert words[1] == "False", out  # the consumer's work waits for the producer's kernel
        assert float(words[3]) > 50.0, out
    finally:
        with contextlib.suppress(Exception):
            prod.stdin.write("\n")
            prod.stdin.flush()
        prod.wait(timeout=60)
        if cons is not None and cons.poll() is None:
            cons.kill()


_IPC_PAIR = """
import sys, torch, torch.multiprocessing as mp, streamsafe.torch as s

def consumer(q, back):
    s.install('backend:expandable')
    torch.cuda.init()
    try:
        fn, args = q.get(timeout=60)
        t = fn(*args)
        back.put(("ok", float(t.sum().item())))
        del t
    except Exception as e:
        back.put(("error", f"{type(e).__name__}: {e}"))

if __name__ == "__main__":
    s.install('backend:expandable')
    from torch.multiprocessing.reductions import reduce_tensor
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, back))
    p.start()
    x = torch.full((1 << 20,), 2.0, device="cuda")
    try:
        q.put(reduce_tensor(x))
    except Exception as e:
        print("RESULT error", f"producer: {type(e).__name__}: {e}")
        q.put(None)
        p.join(30)
        sys.exit(0)
    kind, val = back.get(timeout=120)
    p.join(30)
    print("RESULT", kind, val)
"""


@pytest.mark.timeout(300)
def test_cuda_ipc_of_tensors_between_streamsafe_processes(tmp_path):
    """The hand-over of the example: reduce_tensor in the trainer, rebuild_cuda_tensor in the
    engine, both with streamsafe installed. A refusal is a failure: the extension supports CUDA
    IPC of tensors (the example's host-buffer path is only its fallback)."""
    script = tmp_path / "ipc_pair.py"
    script.write_text(_IPC_PAIR)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("STREAMSAFE_TORCH_INSTALL", None)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, p.stdout + p.stderr
    assert line.split()[1] == "ok", line
    assert float(line.split()[2]) == 2.0 * (1 << 20)


def test_memory_cap_does_not_count_paused_memory():
    """The example's budget: set_per_process_memory_fraction caps what the process holds; paused
    memory is not held, so another allocation fits under the cap while the tag sleeps, and resuming
    past the cap is an out-of-memory error (that part stays paused) until memory is freed."""
    code = (
        "import torch, streamsafe.torch as s\n"
        "s.install('backend:expandable,empty_cache:wait')\n"
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "torch.cuda.set_per_process_memory_fraction((1 << 30) / total, 0)\n"
        "with s.tag('w'):\n"
        "    w = torch.ones(600 << 20, dtype=torch.uint8, device='cuda')\n"
        "try:\n"
        "    torch.empty(600 << 20, dtype=torch.uint8, device='cuda')\n"
        "    print('over-cap allocation fit')\n"
        "except torch.OutOfMemoryError:\n"
        "    print('capped')\n"
        "torch.cuda.empty_cache()\n"
        "s.pause('w', mode='offload', wait=True)\n"
        "x = torch.empty(600 << 20, dtype=torch.uint8, device='cuda')\n"
        "print('fits while paused')\n"
        "try:\n"
        "    s.resume('w')\n"
        "    print('resume past the cap succeeded')\n"
        "except torch.OutOfMemoryError:\n"
        "    print('resume refused')\n"
        "del x\n"
        "torch.cuda.empty_cache()\n"
        "s.resume('w')\n"
        # Checked in 64 MiB slices: w.sum() would make an int64 copy (4.7 GiB) past the 1 GiB cap.
        "print('sum', sum(int(c.sum(dtype=torch.int32)) for c in w.split(64 << 20)))\n")
    rc, out = run_child(code)
    assert rc == 0, out
    assert "capped" in out, out
    assert "fits while paused" in out, out
    assert "resume refused" in out, out
    assert f"sum {600 << 20}" in out, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hybrid", [False, True], ids=["two_processes", "hybrid"])
def test_example_rows_are_identical_to_the_reference(tmp_path, hybrid):
    """examples/pytorch/colocated_rl.py on its tiny model (--sanitize sizes, no sanitizer): the
    streamsafe and field rows reproduce the reference's tokens and weights bit for bit, in two
    processes and in one (--hybrid)."""
    pytest.importorskip("transformers")
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("STREAMSAFE_TORCH_INSTALL", None)
    p = subprocess.run([sys.executable, EXAMPLE, "--sanitize", "--rows", "reference,streamsafe,field",
                        "--steps", "3", "--json", str(out)] + (["--hybrid"] if hybrid else []),
                       env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("streamsafe", "field"):
        r = rows[name]
        assert not r["errors"], r["errors"]
        assert r["tokens_equal"] and r["weights_equal"] and r["engine_weights_equal"], (name, p.stdout[-3000:])
