"""The axis names of every rlx device mesh, shared by rlx.train, rlx.sampling and rlx.policy.

A mesh has the axes `MESH_AXES = ("data", "fsdp", "tensor")`, in this order
(the naming of MaxText / big_vision meshes): params are sharded over "fsdp"
and "tensor", batches (and the sampler's slots) along their first dimension
over `BATCH_AXES = ("data", "fsdp")`, KV heads over "tensor". Names only, no
imports, so any package can read them without importing rlx.train.
"""

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"
# The axes of every mesh, in mesh order (`rlx.train.make_mesh`).
MESH_AXES = (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS)
# The batch (sequence) dimension is split over these axes.
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)
