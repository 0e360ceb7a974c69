"""Engine-side helpers: what an engine integrating hicache needs on its side.

The request-row table, paged slot assignment for extend and decode, the CSR
``kv_indices`` an attention backend reads, and exporting the engine's KV pool to the
daemon (POSIX shared memory in CPU mode, CUDA IPC handles on GPUs).
"""
