"""The client's engine: torch calls on ``tdmesh.Tensor`` proxies become messages.

Dispatch, metadata propagation and placement checks make an op; ``issue`` gives it refs and a
sequence number; the client records it in the dataflow history (what a failure poisons) and
sends it through the outbox; futures, fetches and host reads bring values back; the
supervisor watches the fleet from the client.  Imports geometry and protocol, never the
public modules above it."""
