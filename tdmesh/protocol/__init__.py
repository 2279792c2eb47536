"""What crosses the wire, shared by the client and the workers: the messages (one handler per
message on the worker), their schema check, the value codec and its bulk path, the framed
transport with its handshake and secrets, the host relay that runs inside a host's first
worker, and the c10d rendezvous by which ranks find the client.  Imports only geometry,
``config`` and ``errors``."""
