# The seeds' loop's server (baton-gpu-check runs it as `python3 server_program.py MIB` once the agent's
# GPU-free gate has opened, as a shim's Start would start it): PyTorch's CUDA initialisation, MIB MiB taken
# and written, `serving` printed; holds it until its stdin closes.
import sys

import torch

block = torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")
block.fill_(1)
torch.cuda.synchronize()
print("serving", flush=True)
for _ in sys.stdin:
    pass
