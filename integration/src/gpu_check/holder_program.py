# The program tools/gpu-check parks and resumes (baton-gpu-check runs it as `python3 holder_program.py GIB`):
# GIB GiB of random weights on the GPU; prints `ready CHECKSUM` once they are there and `checksum N` for each
# line it reads; exits when its stdin closes. The checksum is an exact integer sum of the weights' bits.
import sys

import torch

gib = int(sys.argv[1])
generator = torch.Generator(device="cuda").manual_seed(1234)
weights = torch.rand(gib * (1 << 30) // 4, device="cuda", generator=generator)


def checksum():
    return int(weights.view(torch.int32).sum(dtype=torch.int64))


torch.cuda.synchronize()
print("ready", checksum(), flush=True)
for _ in sys.stdin:
    print("checksum", checksum(), flush=True)
