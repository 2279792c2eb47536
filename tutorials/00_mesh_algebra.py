"""Mesh algebra: which ranks a (sub-)mesh holds, with no processes at all.

    python tutorials/00_mesh_algebra.py

A DeviceMesh is named dims over a Slice (offset, sizes, strides) of global ranks.  Slicing,
splitting, renaming and flattening only rewrite that arithmetic; rank order never changes.
"""

import tdmesh
from tdmesh.geometry.grouping import all_groups, to_mesh_pairs

mesh = tdmesh.DeviceMesh.from_sizes(host=2, gpu=8)      # a pure value: no workers behind it
print(mesh)
print("ranks of host 1           :", list(mesh.slice(host=1).processes))
print("gpus 3..4 of every host   :", list(mesh.slice(gpu=slice(3, 5)).processes))
print("every other gpu of host 0 :", list(mesh.slice(host=0, gpu=slice(None, None, 2)).processes))

pp = mesh.split(host=("dp",), gpu=("pp", "tp"), tp=2)   # host -> dp, gpu -> pp x tp
print("\nsplit into", pp.sizes, "— the same ranks in the same order:")
print(pp.to_table())
print("flattened:", mesh.flatten("rank").sizes)

# The groups a reduce over "gpu" uses: one per host, ranks agreeing on every other dim
print("\ngroups over gpu :", all_groups(mesh.shape, ("gpu",)))
print("groups over host:", all_groups(mesh.shape, ("host",))[:3], "...")

# to_mesh pairs source and destination ranks by dim name
print("host 0 -> host 1:", to_mesh_pairs(mesh.slice(host=0).shape, mesh.slice(host=1).shape)[:4], "...")

s = tdmesh.Slice(offset=10, sizes=[10, 2], strides=[10, 5])
print("\n", s, "holds", list(s)[:6], "...; rank 35 is at", s.coordinates(35), "index", s.index(35))
try:
    mesh.slice(zone=0)
except KeyError as e:
    print("a dim the mesh does not have:", e)
