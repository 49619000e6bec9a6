"""The scheduler and the KV cache's bookkeeping: requests, blocks, prefix hashes, KV events.

Host-side logic only: nothing here runs a model or a kernel, so it is tested on its own and
read by the runner (ferry/worker/) through `SchedulerOutput`.
"""
