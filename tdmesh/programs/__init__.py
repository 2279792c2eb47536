"""Recorded functions (``tdmesh.compile``): the trace of a call, what it settles into, the
recording and its replays, their signatures, when a recording may be a CUDA graph, and the
``torch.optim`` settings a replay checks.  Built on the engine."""
