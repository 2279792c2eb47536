"""Worker processes and their connections to the client: a running job (its listening
socket, the workers' connections, shutdown) and the warm pool of parked workers.  Built on
the engine (a job owns a client); the launcher (``local_mesh``, ``world_mesh``, ``attach``)
sits above it with the public API."""
