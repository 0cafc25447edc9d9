"""streamsafe.torch.install_pluggable(): the hooks of CUDAPluggableAllocator reach streamsafe."""

import json

import pytest

from conftest import run_child

pytest.importorskip("torch")

CODE = r'''
import gc, json, torch, streamsafe.torch as s
s.install_pluggable("backend:expandable")
MiB = 1 << 20
r = {}
x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda"); x.fill_(1); del x
torch.cuda.synchronize()
r0 = s.stats()["reserved_bytes.all.current"]
torch.cuda.empty_cache()
r["released"] = r0 - s.stats()["reserved_bytes.all.current"]
side = torch.cuda.Stream()
y = torch.ones(MiB, device="cuda")
with torch.cuda.stream(side):
    z = y * 2
y.record_stream(side)
e0 = s.stats()["events_recorded"]
del y
r["record_stream_events"] = s.stats()["events_recorded"] - e0
try:
    torch.cuda.set_per_process_memory_fraction(0.5)
    r["fraction"] = "accepted"
except RuntimeError as e:
    r["fraction"] = str(e)
static_in = torch.full((1 << 20,), 3.0, device="cuda")
st = torch.cuda.Stream(); st.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(st):
    static_in * 2
torch.cuda.current_stream().wait_stream(st)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out = static_in * 2 + 1
static_in.fill_(5.0); g.replay(); torch.cuda.synchronize()
r["graph_ok"] = bool(torch.all(out == 11.0))
del g, out; gc.collect()
try:
    torch.cuda.memory_stats()
    r["memory_stats"] = "works"
except RuntimeError as e:
    r["memory_stats"] = str(e)
print("R", json.dumps(r))
'''


def test_pluggable_hooks():
    rc, out = run_child(CODE)
    assert rc == 0, out
    r = json.loads(out.split("R ", 1)[1].splitlines()[0])
    assert r["released"] >= 256 << 20, r
    assert r["record_stream_events"] == 1, r
    assert "not supported" in r["fraction"], r
    assert r["graph_ok"], r
