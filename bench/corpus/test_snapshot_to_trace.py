#!/usr/bin/env python3
"""Tests of allocator/tools/snapshot_to_trace.py on synthetic snapshot dicts (no torch).

    python3 bench/corpus/test_snapshot_to_trace.py [--replay PATH/streamsafe-replay]

With --replay (or STREAMSAFE_REPLAY set), the converted trace is also replayed with --strict,
so the CSV is checked against the reader that consumes it.
"""

import collections
import gzip
import io
import os
import pickle
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.normpath(os.path.join(HERE, "..", "..", "allocator", "tools", "snapshot_to_trace.py"))
REPLAY = os.environ.get("STREAMSAFE_REPLAY")

SIDE = 0x7F00_0000_1000  # a stream handle
MiB = 1 << 20


def entry(action, addr, size, stream=0, t=None, **extra):
    e = {"action": action, "addr": addr, "size": size, "stream": stream, "frames": []}
    if t is not None:
        e["time_us"] = t
    e.update(extra)
    return e


def snapshot(device_traces, settings=None):
    return {
        "segments": [{"device": 0, "address": 1 << 40, "total_size": 20 * MiB, "stream": 0, "blocks": []}],
        "device_traces": device_traces,
        "allocator_settings": settings or {"expandable_segments": False},
    }


BASE = 1 << 40
DEVICE0 = [
    entry("segment_alloc", BASE, 20 * MiB, 0, 100),
    entry("alloc", BASE, 3 * MiB, 0, 101),
    entry("alloc", BASE + 3 * MiB, 1000, SIDE, 102),
    entry("free_requested", BASE + 3 * MiB, 1000, SIDE, 103),
    entry("free_completed", BASE + 3 * MiB, 1000, SIDE, 110),
    entry("segment_map", BASE + 20 * MiB, 2 * MiB, 0, 111),
    entry("alloc", BASE + 20 * MiB, 2 * MiB - 512, 0),  # no time_us: the previous entry's
    entry("oom", 0, 64 * MiB, 0, 120, device_free=5 * MiB),
    entry("snapshot", 0, 0, 0, 121),
    entry("free_requested", BASE + 20 * MiB, 2 * MiB - 512, 0, 130),
    entry("free_completed", BASE + 20 * MiB, 2 * MiB - 512, 0, 130),
    entry("segment_unmap", BASE + 20 * MiB, 2 * MiB, 0, 131),
    entry("free_requested", BASE, 3 * MiB, 0, 140),
    entry("free_completed", BASE, 3 * MiB, 0, 140),
    entry("segment_free", BASE, 20 * MiB, 0, 150),
    entry("alloc", BASE + 40 * MiB, 512, -1, 160),  # a negative stream: the handle, unsigned
    entry("something_new", 0, 0, 0, 161),
]


def run_tool(args, stdin=None):
    return subprocess.run([sys.executable, TOOL] + args, input=stdin, capture_output=True)


class Converter(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def write(self, obj, name="snap.pickle", compress=False):
        path = os.path.join(self.dir.name, name)
        data = pickle.dumps(obj)
        with open(path, "wb") as f:
            f.write(gzip.compress(data) if compress else data)
        return path

    def data_rows(self, text):
        return [line.split(",") for line in text.splitlines() if line and not line.startswith("#")]

    def test_mapping(self):
        path = self.write(snapshot([DEVICE0]))
        p = run_tool([path, "--plain"])
        self.assertEqual(p.returncode, 0, p.stderr)
        text = p.stdout.decode()
        rows = self.data_rows(text)
        self.assertEqual(rows[0], ["time_us", "action", "address", "size", "stream"])
        rows = rows[1:]
        # Every known action passes through; oom becomes a comment; unknown actions are left out.
        self.assertEqual(len(rows), len(DEVICE0) - 2)
        actions = collections.Counter(r[1] for r in rows)
        self.assertEqual(actions["alloc"], 4)
        self.assertEqual(actions["free_requested"], 3)
        self.assertEqual(actions["free_completed"], 3)
        for a in ("segment_alloc", "segment_free", "segment_map", "segment_unmap", "snapshot"):
            self.assertEqual(actions[a], 1, a)
        self.assertNotIn("oom", actions)
        self.assertIn("# oom at 120 us: size 67108864, device_free 5242880", text)
        self.assertIn("# allocator_settings: expandable_segments=False", text)
        self.assertEqual(rows[2], ["102", "alloc", str(BASE + 3 * MiB), "1000", str(SIDE)])
        self.assertEqual(rows[6][0], "111")  # the entry without time_us
        self.assertEqual(rows[-1][4], str((1 << 64) - 1))
        self.assertIn(b"something_new", p.stderr)
        self.assertIn(b"peak reserved from the segment rows 23068672 B", p.stderr)

    def test_gzip_in_and_out(self):
        path = self.write(snapshot([DEVICE0]), compress=True)
        p = run_tool([path])  # stdout is a pipe: gzip
        self.assertEqual(p.returncode, 0, p.stderr)
        plain = run_tool([path, "--plain"]).stdout
        self.assertEqual(gzip.decompress(p.stdout), plain)
        out = os.path.join(self.dir.name, "t.csv.gz")
        self.assertEqual(run_tool([path, "-o", out, "-q"]).returncode, 0)
        with gzip.open(out, "rb") as f:
            self.assertEqual(f.read(), plain)
        # Deterministic bytes: no time or file name in the gzip header.
        out2 = os.path.join(self.dir.name, "u.csv.gz")
        run_tool([path, "-o", out2, "-q"])
        with open(out, "rb") as a, open(out2, "rb") as b:
            self.assertEqual(a.read(), b.read())
        text_out = os.path.join(self.dir.name, "t.csv")
        run_tool([path, "-o", text_out, "-q"])
        with open(text_out, "rb") as f:
            self.assertEqual(f.read(), plain)
        with open(path, "rb") as f:
            p = run_tool(["-", "--plain", "-q"], stdin=f.read())
        self.assertIn(b"snapshot_to_trace.py: stdin, device 0", p.stdout)
        self.assertEqual(p.stdout.split(b"\n")[1:], plain.split(b"\n")[1:])

    def test_devices(self):
        d1 = [entry("alloc", 5 << 40, 4096, 0, 1), entry("free_requested", 5 << 40, 4096, 0, 2)]
        path = self.write(snapshot([[], d1]))
        p = run_tool([path, "--plain", "-q"])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(b"device 1", p.stdout)
        path = self.write(snapshot([DEVICE0, d1]))
        p = run_tool([path, "--plain"])
        self.assertEqual(p.returncode, 2)
        self.assertIn(b"--device", p.stderr)
        p = run_tool([path, "--plain", "-q", "--device", "1"])
        self.assertEqual(len(self.data_rows(p.stdout.decode())), 3)
        self.assertEqual(run_tool([path, "--plain", "--device", "2"]).returncode, 2)
        self.assertEqual(run_tool([self.write(snapshot([[]])), "--plain"]).returncode, 2)

    def test_refusals(self):
        self.assertEqual(run_tool([self.write({"segments": []}), "--plain"]).returncode, 2)
        self.assertEqual(run_tool([self.write([1, 2]), "--plain"]).returncode, 2)
        # A pickle that names a class is refused before anything is imported or called.
        p = run_tool([self.write(collections.OrderedDict(device_traces=[DEVICE0])), "--plain"])
        self.assertEqual(p.returncode, 2)
        self.assertIn(b"collections.OrderedDict", p.stderr)
        bad = os.path.join(self.dir.name, "bad.pickle")
        with open(bad, "wb") as f:
            f.write(b"not a pickle at all")
        self.assertEqual(run_tool([bad, "--plain"]).returncode, 2)
        self.assertEqual(run_tool([os.path.join(self.dir.name, "absent"), "--plain"]).returncode, 1)
        p = run_tool([self.write(snapshot([[entry("alloc", 1, "big")]])), "--plain"])
        self.assertEqual(p.returncode, 2)
        self.assertIn(b"not an integer", p.stderr)
        # Builtin sets are plain data: accepted.
        snap = snapshot([DEVICE0])
        snap["extra"] = {1, 2}
        self.assertEqual(run_tool([self.write(snap), "--plain", "-q"]).returncode, 0)

    def test_unmatched_free_is_reported(self):
        trace = [entry("free_requested", 7 << 40, 64, 0, 1), entry("alloc", 8 << 40, 64, 0, 2)]
        p = run_tool([self.write(snapshot([trace])), "--plain"])
        self.assertEqual(p.returncode, 0)
        self.assertIn(b"1 free(s) of blocks the trace never allocated", p.stderr)

    def test_replay_reads_it(self):
        if not REPLAY:
            self.skipTest("no streamsafe-replay given (--replay or STREAMSAFE_REPLAY)")
        path = self.write(snapshot([DEVICE0[:-2]]))
        out = os.path.join(self.dir.name, "t.csv.gz")
        self.assertEqual(run_tool([path, "-o", out, "-q"]).returncode, 0)
        p = subprocess.run([REPLAY, out, "--strict", "--passes", "1"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertRegex(p.stdout, r"replayed\s+6 events: 3 alloc, 3 free, on 2 stream\(s\)")
        self.assertRegex(p.stdout, r"4 segment rows, 1 other rows")
        self.assertRegex(p.stdout, r"recorded run\s+peak reserved 23,068,672 B")


if __name__ == "__main__":
    if "--replay" in sys.argv:
        i = sys.argv.index("--replay")
        REPLAY = sys.argv[i + 1]
        del sys.argv[i : i + 2]
    unittest.main(verbosity=1)
