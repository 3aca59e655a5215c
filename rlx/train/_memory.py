"""What lowers the device memory of the train step and `compute_logprobs` (for OOM errors).

The lines name the `rlx.rl.get_config()` fields (`model.*`, `train.*`,
`mesh.*`), which are the `rlx.policy.ModelConfig`, train config and
`make_mesh` arguments of the same names, with their current values.
"""

from typing import Any

from jax.sharding import Mesh

from rlx import _mesh_axes
from rlx.train import _spec


def _mesh_line(mesh: Mesh) -> str:
  shape = {a: int(mesh.shape.get(a, 1)) for a in _mesh_axes.MESH_AXES}
  return (
    f"mesh.fsdp / mesh.tensor (now {shape['fsdp']} / {shape['tensor']}, with data "
    f"{shape['data']}): shard the params, gradients and optimizer state over more chips "
    "(the data axis holds a full copy of the state per fsdp x tensor group)"
  )


def _chunk_line(spec: _spec.StepSpec) -> str:
  now = spec.logprob_chunk_size or "0 = the policy's default"
  return (
    f"train.logprob_chunk_size (now {now}): fewer positions per LM-head chunk, smaller "
    "[rows, chunk, vocab] logits"
  )


def train_step_advice(
  model_config: Any, spec: _spec.StepSpec, mesh: Mesh, rows: int | None = None
) -> tuple[str, ...]:
  """The settings that lower the train step's memory, with their current values.

  Args:
    model_config: the step's `rlx.policy.ModelConfig` (its `remat`).
    spec: the step's `StepSpec`.
    mesh: the step's mesh.
    rows: the batch's B, if known (gives the rows of one forward / backward pass).
  """
  lines = []
  if not getattr(model_config, "remat", False):
    lines.append(
      "model.remat = True (now False): recompute each decoder layer's activations in the "
      "backward pass instead of keeping them"
    )
  per_pass = ""
  if rows:
    per_pass = f", {rows // (spec.mini_batches * spec.micro_batches)} rows per pass of B = {rows}"
  lines.append(
    f"train.micro_batches (now {spec.micro_batches}, mini_batches {spec.mini_batches}"
    f"{per_pass}): more micro-batches, fewer rows in each forward and backward pass"
  )
  lines.append(_mesh_line(mesh))
  if spec.gather_fsdp_params and not spec.gather_fsdp_per_layer:
    lines.append(
      "train.gather_fsdp_per_layer = True (now False): gather one decoder layer's weights at "
      "a time instead of the whole model"
    )
  lines.append(_chunk_line(spec))
  return tuple(lines)


def compute_logprobs_advice(
  spec: _spec.StepSpec, mesh: Mesh, rows: int | None = None
) -> tuple[str, ...]:
  """The settings that lower `compute_logprobs`' memory, with their current values."""
  per_pass = f", {rows // spec.micro_batches} rows per pass of B = {rows}" if rows else ""
  return (
    f"train.micro_batches (now {spec.micro_batches}{per_pass}): more micro-batches, fewer "
    "rows in each forward pass",
    _chunk_line(spec),
    _mesh_line(mesh),
  )
