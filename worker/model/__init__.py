"""The model: the batched GPT-2 forward on the slot KV cache, its matrix products
and CPU kernels, precision, sampling and penalties, and where weights come from.
Imported only by the torch engine (`worker.engine.torch_engine`, `load`), but
`cpu_isa`, which needs no torch: the supervisor's preflight and bench reports
read it too."""
