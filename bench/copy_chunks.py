"""What cutting a 64 MiB copy between pinned host memory and the GPU into 2 MiB chunks costs the
copy engine: the copies queued on 1, 2 or 4 side streams behind a GPU sleep (so the host's time
to queue them does not count), CUDA events around them, median of 5. Prints; run from the
repository root:  python3 bench/copy_chunks.py
"""
import torch


def main():
    dev = torch.device("cuda")
    total = 64 << 20
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(total, dtype=torch.uint8, device=dev)
    streams = [torch.cuda.Stream() for _ in range(4)]
    for name, (src, dst) in {"up": (host, d), "down": (d, host2)}.items():
        for size in (64 << 20, 2 << 20):
            for ns in (1, 2, 4):
                res = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    cur = torch.cuda.current_stream()
                    torch.cuda._sleep(100_000_000)
                    s = torch.cuda.Event(enable_timing=True)
                    e = torch.cuda.Event(enable_timing=True)
                    s.record()
                    for st in streams[:ns]:
                        st.wait_stream(cur)
                    for k, off in enumerate(range(0, total, size)):
                        with torch.cuda.stream(streams[k % ns]):
                            dst[off:off + size].copy_(src[off:off + size], non_blocking=True)
                    for st in streams[:ns]:
                        cur.wait_stream(st)
                    e.record()
                    e.synchronize()
                    res.append(s.elapsed_time(e))
                res.sort()
                print(f"{name} {size >> 10} KiB x {total // size} on {ns} streams: {res[2]:.3f} ms "
                      f"({res[0]:.3f}-{res[-1]:.3f})", flush=True)


if __name__ == "__main__":
    main()
