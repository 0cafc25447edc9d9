#!/usr/bin/env python3
"""Converts a PyTorch CUDA memory snapshot to streamsafe's trace CSV.

    python3 snapshot_to_trace.py snapshot.pickle > trace.csv.gz
    python3 snapshot_to_trace.py snapshot.pickle -o trace.csv.gz     (.gz: compressed; else text)
    python3 snapshot_to_trace.py snapshot.pickle --plain | head      (text on stdout)

The snapshot is the dict that torch.cuda.memory._snapshot() returns, pickled (what
torch.cuda.memory._dump_snapshot(path) writes), plain or gzip-compressed; '-' reads stdin. Its
trace is there only when the program called torch.cuda.memory._record_memory_history() before
it allocated (max_entries large enough to hold the whole run: the history is a ring, and a
wrapped ring starts in the middle of the run). Only the Python standard library is needed: the
pickle holds plain dicts, lists, strings and numbers, and the unpickler here refuses anything
else (it imports no class a pickle names).

Output columns, one row per trace entry of the chosen device, in the snapshot's order
(streamsafe-replay's PyTorch format, ../../shared/traces/README.md):

    time_us,action,address,size,stream

Mapping from the snapshot's device_traces[device][i] entries:
  time_us   entry['time_us'] (microseconds since the epoch); entries without one get the
            previous entry's time.
  action    entry['action'], unchanged, for alloc, free_requested, free_completed,
            segment_alloc, segment_free, segment_map, segment_unmap and snapshot.
            'oom' entries become comment lines ('# oom ...', with the device's free bytes):
            the replay skips them. Any other action is counted, reported and left out.
  address   entry['addr'], decimal.
  size      entry['size'], decimal: for alloc/free_* the requested size of the block (what
            the program asked for), for segment_* the bytes taken from or given back to the
            driver (segment_map/segment_unmap: the range of an expandable segment mapped or
            unmapped).
  stream    entry['stream'], the cudaStream_t handle as an unsigned decimal (0 = the legacy
            default stream).
  device    not a column: a trace holds one device. --device N picks it; without it the one
            device with entries is taken (several: an error that lists them).

Header comment lines ('# ...') say where the trace came from, the allocator settings the
snapshot records and PyTorch's segment totals; streamsafe-replay skips them. A summary goes to
stderr: rows per action, the peak of requested bytes and the peak of reserved bytes that the
segment rows imply (PyTorch's own decision, the replay's 'recorded run' line).

Exit status: 0 written; 1 usage or I/O error; 2 the snapshot is not one (or holds no trace for
the device).
"""

import argparse
import gzip
import io
import os
import pickle
import sys

KNOWN_ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
)
SEGMENT_ADD = ("segment_alloc", "segment_map")
SEGMENT_REMOVE = ("segment_free", "segment_unmap")
HEADER = "time_us,action,address,size,stream"
U64 = (1 << 64) - 1


class SnapshotError(Exception):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """Loads builtin containers and scalars only: a pickle that names a class is refused."""

    SAFE = {("builtins", n) for n in ("set", "frozenset", "complex", "bytearray")}

    def find_class(self, module, name):
        if (module, name) in self.SAFE:
            return super().find_class(module, name)
        raise SnapshotError(
            f"the pickle names {module}.{name}; a memory snapshot holds only dicts, lists, "
            "strings and numbers (is this torch.cuda.memory._snapshot()'s output?)"
        )


def load_snapshot(path):
    """The snapshot dict from a pickle file (plain or gzip), '-' for stdin."""
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        with open(path, "rb") as f:
            data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    try:
        snap = _PlainUnpickler(io.BytesIO(data)).load()
    except SnapshotError:
        raise
    except Exception as e:  # a truncated or foreign file: pickle raises many kinds
        raise SnapshotError(f"not a pickle: {e}") from None
    if not isinstance(snap, dict) or "device_traces" not in snap:
        keys = sorted(snap)[:8] if isinstance(snap, dict) else type(snap).__name__
        raise SnapshotError(f"not a memory snapshot: no 'device_traces' (found {keys})")
    if not isinstance(snap["device_traces"], list):
        raise SnapshotError("'device_traces' is not a list")
    return snap


def pick_device(snap, device):
    traces = snap["device_traces"]
    with_entries = [d for d, t in enumerate(traces) if t]
    if device is None:
        if not with_entries:
            raise SnapshotError(
                "the snapshot has no trace entries: call torch.cuda.memory._record_memory_history() "
                "before the program allocates"
            )
        if len(with_entries) > 1:
            raise SnapshotError(f"trace entries on devices {with_entries}: pick one with --device")
        return with_entries[0]
    if device < 0 or device >= len(traces) or not traces[device]:
        raise SnapshotError(f"no trace entries for device {device} (devices with entries: {with_entries})")
    return device


def _int(entry, key, default=0):
    v = entry.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise SnapshotError(f"entry field {key!r} is {v!r}, not an integer")
    return v


def convert(snap, device, out, source="snapshot"):
    """Writes the CSV for `device` to the text stream `out`; returns the summary dict."""
    entries = snap["device_traces"][device]
    counts = {}
    skipped = {}
    live = {}
    requested = requested_peak = 0
    reserved = reserved_peak = 0
    unmatched_frees = 0
    segments = [s for s in snap.get("segments", []) if isinstance(s, dict) and s.get("device", device) == device]
    settings = snap.get("allocator_settings")

    out.write(f"# PyTorch memory snapshot converted by snapshot_to_trace.py: {source}, device {device}\n")
    if isinstance(settings, dict) and settings:
        text = ",".join(f"{k}={settings[k]}" for k in sorted(settings))
        out.write(f"# allocator_settings: {text}\n")
    if segments:
        total = sum(int(s.get("total_size", 0)) for s in segments)
        out.write(f"# segments at the snapshot: {len(segments)}, {total} bytes reserved\n")
    out.write(HEADER + "\n")

    time_us = 0
    rows = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise SnapshotError(f"a trace entry is {type(entry).__name__}, not a dict")
        action = entry.get("action")
        if "time_us" in entry:
            time_us = _int(entry, "time_us")
        if action == "oom":
            rows.append(f"# oom at {time_us} us: size {entry.get('size', '?')}, "
                        f"device_free {entry.get('device_free', '?')}, stream {entry.get('stream', '?')}\n")
            counts["oom"] = counts.get("oom", 0) + 1
            continue
        if action not in KNOWN_ACTIONS:
            skipped[str(action)] = skipped.get(str(action), 0) + 1
            continue
        address = _int(entry, "addr") & U64
        size = _int(entry, "size")
        stream = _int(entry, "stream") & U64
        if size < 0:
            raise SnapshotError(f"negative size {size} in a {action} entry")
        counts[action] = counts.get(action, 0) + 1
        if action == "alloc":
            live[address] = size
            requested += size
            requested_peak = max(requested_peak, requested)
        elif action in ("free_requested", "free_completed"):
            if address in live:
                requested -= live.pop(address)
            elif action == "free_requested":
                unmatched_frees += 1
        elif action in SEGMENT_ADD:
            reserved += size
            reserved_peak = max(reserved_peak, reserved)
        elif action in SEGMENT_REMOVE:
            reserved -= size
        rows.append(f"{time_us},{action},{address},{size},{stream}\n")
        if len(rows) >= 8192:
            out.write("".join(rows))
            rows.clear()
    out.write("".join(rows))
    return {
        "device": device,
        "entries": len(entries),
        "counts": counts,
        "skipped": skipped,
        "requested_peak": requested_peak,
        "reserved_peak_from_segments": reserved_peak,
        "live_at_end": len(live),
        "unmatched_frees": unmatched_frees,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="PyTorch CUDA memory snapshot (pickle) -> streamsafe trace CSV "
        "(time_us,action,address,size,stream).",
        epilog="Writes gzip to stdout unless --plain; -o FILE compresses when FILE ends in .gz.",
    )
    ap.add_argument("snapshot", help="the pickled snapshot dict (torch.cuda.memory._dump_snapshot), or -")
    ap.add_argument("-o", "--output", help="output file (default stdout)")
    ap.add_argument("--device", type=int, help="CUDA device index (default: the one device with entries)")
    ap.add_argument("--plain", action="store_true", help="uncompressed text on stdout")
    ap.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")
    args = ap.parse_args(argv)

    try:
        snap = load_snapshot(args.snapshot)
        device = pick_device(snap, args.device)
    except OSError as e:
        print(f"snapshot_to_trace: {e}", file=sys.stderr)
        return 1
    except SnapshotError as e:
        print(f"snapshot_to_trace: {args.snapshot}: {e}", file=sys.stderr)
        return 2

    source = os.path.basename(args.snapshot) if args.snapshot != "-" else "stdin"
    if args.output:
        compress = args.output.endswith(".gz")
        raw = open(args.output, "wb")
    else:
        compress = not args.plain
        if compress and sys.stdout.isatty():
            print("snapshot_to_trace: not writing gzip to a terminal: redirect stdout, or use -o or --plain",
                  file=sys.stderr)
            return 1
        raw = sys.stdout.buffer
    try:
        binary = gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=9, mtime=0) if compress else raw
        text = io.TextIOWrapper(binary, encoding="ascii", newline="\n")
        try:
            summary = convert(snap, device, text, source)
        finally:
            text.flush()
            text.detach()
            if compress:
                binary.close()
            if args.output:
                raw.close()
    except SnapshotError as e:
        print(f"snapshot_to_trace: {args.snapshot}: {e}", file=sys.stderr)
        if args.output:
            os.unlink(args.output)
        return 2
    except OSError as e:
        print(f"snapshot_to_trace: {e}", file=sys.stderr)
        return 1

    if not args.quiet:
        c = summary["counts"]
        parts = ", ".join(f"{c[a]} {a}" for a in KNOWN_ACTIONS + ("oom",) if a in c)
        print(f"snapshot_to_trace: device {device}: {summary['entries']} entries: {parts}", file=sys.stderr)
        print(f"snapshot_to_trace: peak requested {summary['requested_peak']} B; peak reserved from the "
              f"segment rows {summary['reserved_peak_from_segments']} B; {summary['live_at_end']} block(s) "
              f"live at the end", file=sys.stderr)
        if summary["skipped"]:
            print(f"snapshot_to_trace: left out unknown actions: {summary['skipped']}", file=sys.stderr)
        if summary["unmatched_frees"]:
            print(f"snapshot_to_trace: {summary['unmatched_frees']} free(s) of blocks the trace never "
                  "allocated: the history started after them or its ring wrapped (raise max_entries)",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
