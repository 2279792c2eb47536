"""Rank arithmetic, pure and immutable: ``Slice`` (offset, sizes, strides), ``Shape`` (named
dims over a slice), the grouping of a mesh's ranks by dims (one process group per group) and
the host fan-out tree.  No torch, no sockets: every layer above may use it, the workers too."""
