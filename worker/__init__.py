"""The engine worker: `engine/` (the seam, the slot bookkeeping, the fake and
torch engines), `model/` (the GPT-2 forward and its kernels), `serve/` (the
scheduler, its ZMQ server, the process) and `launch/` (the supervisor, warm
starts, the probe).

The only package that may import torch or transformers: `model/`, and in
`engine/` the torch engine and what builds it (`torch_engine`, `load`), so that
FakeEngine and the scheduler load without them.
"""
