"""Two processes share a CUDA tensor through torch.multiprocessing's reductions, with streamsafe
installed in both (run by test_torch_conformance.py; not a test module itself).

    python3 ipc_scenario.py CONF MODE

The producer fills a tensor with 7 and sends it (reduce_tensor). The consumer rebuilds it
(rebuild_cuda_tensor), queues a long kernel and then a read of the tensor on its current stream,
and tells the producer at once, before the read has run. The producer then frees its tensor,
allocates tensors of the same size and fills them with 9, and synchronises. The consumer's read
then runs. MODE "hold": PyTorch's reference counting of the sent tensor is left alone, so the
producer's free waits for the consumer (the block is not reused): the read sees 7. MODE
"control": the consumer gives its reference back at once, as if the count were missing: the
producer's free goes through, its new tensors may take the block, and the read then sees what
they wrote. A second read, queued only once the producer has written its new tensors ("late_ok"),
does not depend on how the GPU interleaves the two processes: in "hold" it must see 7, in
"control" it sees 9 whenever the producer took the block again. Prints one JSON line:
{"mode", "reused", "read_ok", "late_ok", "consumer_error"}.
"""

import json
import sys

import torch
import torch.multiprocessing as mp

N = 16 << 20  # 64 MiB of float32
SLEEP_CYCLES = 2_000_000_000  # about a second of GPU time before the read


def consumer(conf, mode, args, to_producer, from_producer, result):
    try:
        import streamsafe.torch as sst
        sst.install(conf)
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        x = rebuild_cuda_tensor(*args)
        if mode == "control":
            storage_cls, device = args[4], args[6]
            storage_cls._release_ipc_counter(args[11], args[12], device=device)
        torch.cuda._sleep(SLEEP_CYCLES)
        total = x.sum()           # the read: queued behind the sleep
        ones = (x == 7).all()
        to_producer.put("reading")
        assert from_producer.get(timeout=120) == "reallocated"
        late = (x == 7).all()     # a read queued after the producer's new tensors were written
        torch.cuda.synchronize()
        result.put({"read_ok": bool(ones.item()), "late_ok": bool(late.item()), "sum": float(total.item())})
        del x
        torch.cuda.synchronize()
    except Exception as e:  # reported to the producer
        result.put({"error": f"{type(e).__name__}: {e}"})


def main():
    conf, mode = sys.argv[1], sys.argv[2]
    import streamsafe.torch as sst
    sst.install(conf)
    from torch.multiprocessing.reductions import reduce_tensor
    ctx = mp.get_context("spawn")
    to_producer, from_producer, result = ctx.Queue(), ctx.Queue(), ctx.Queue()
    x = torch.full((N,), 7.0, device="cuda")
    torch.cuda.synchronize()
    address = x.data_ptr()
    _, args = reduce_tensor(x)
    child = ctx.Process(target=consumer, args=(conf, mode, args, to_producer, from_producer, result))
    child.start()
    out = {"mode": mode, "conf": conf, "reused": False, "read_ok": None, "late_ok": None,
           "consumer_error": None}
    msg = to_producer.get(timeout=300)
    assert msg == "reading", msg
    del x, args
    torch.cuda.ipc_collect()
    fresh = []
    for _ in range(4):
        y = torch.full((N,), 9.0, device="cuda")
        out["reused"] = out["reused"] or y.data_ptr() == address
        fresh.append(y)
    torch.cuda.synchronize()
    from_producer.put("reallocated")
    r = result.get(timeout=300)
    child.join(timeout=120)
    if "error" in r:
        out["consumer_error"] = r["error"]
    else:
        out["read_ok"] = r["read_ok"]
        out["late_ok"] = r["late_ok"]
    del fresh
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
