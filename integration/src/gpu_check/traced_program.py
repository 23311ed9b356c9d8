# The program tools/gpu-check traces (baton-gpu-check writes it out and runs it with python3): PyTorch's
# CUDA initialisation, 1 GiB allocated, one matmul, everything freed, exit.
import torch

torch.cuda.init()
block = torch.empty(256 * 1024 * 1024, dtype=torch.float32, device="cuda")
block.fill_(1.0)
a = torch.randn(4096, 4096, device="cuda")
b = a @ a
torch.cuda.synchronize()
print("matmul", float(b[0, 0]), flush=True)
del block, a, b
torch.cuda.empty_cache()
torch.cuda.synchronize()
print("done", flush=True)
