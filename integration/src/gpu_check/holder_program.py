# The program tools/gpu-check parks and resumes (baton-gpu-check runs it as
# `python3 holder_program.py GIB [--fork-worker]`): exactly GIB GiB of random weights on the GPU and nothing
# else kept by PyTorch's allocator; with --fork-worker it then forks a worker that makes no CUDA call and
# keeps the NVIDIA fds and mappings it inherited, as a DataLoader worker does (on the H200 such a child holds
# 31 fds and 30 mappings while its parent's park frees the GPU: /work/shared/gpu/580.159.04/README.md, item
# 5). Prints `ready checksum=N reserved=BYTES worker=PID` once the weights are there, `checksum N` for each
# line it reads, and exits when its stdin closes (the worker when its parent is gone). The checksum is an
# exact integer sum of the weights' bits, taken a slice at a time: summing all of them at once into int64
# made an 8 GiB holder hold 24.6 GiB (the temporary stayed in PyTorch's cache).
import os
import sys

import torch

SLICE = 1 << 24  # int32 values summed at a time: a 128 MiB int64 temporary at most, freed after

gib = int(sys.argv[1])
generator = torch.Generator(device="cuda").manual_seed(1234)
weights = torch.rand(gib * (1 << 30) // 4, device="cuda", generator=generator)


def checksum():
    bits = weights.view(torch.int32)
    total = 0
    for start in range(0, bits.numel(), SLICE):
        total += int(bits[start : start + SLICE].sum(dtype=torch.int64))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return total


def fork_worker():
    """A child that inherits the CUDA state's fds and mappings, never calls CUDA, and ends with its parent."""
    parent_gone, keep = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(keep)
        os.read(parent_gone, 1)  # end of file once the parent has exited
        os._exit(0)
    os.close(parent_gone)
    return pid, keep


first = checksum()
worker, _keep = fork_worker() if "--fork-worker" in sys.argv[2:] else (0, None)
print(f"ready checksum={first} reserved={torch.cuda.memory_reserved()} worker={worker}", flush=True)
for _ in sys.stdin:
    print("checksum", checksum(), flush=True)
