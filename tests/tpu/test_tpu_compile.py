"""rlx programs compile for a TPU v5e 2x2 slice on a CPU-only machine (real TPU compiler).

Tiny shapes: each compile takes about a second. The memory figures are the TPU
compiler's own per-chip accounting (`Compiled.memory_analysis()`), so a sharded
state that is not sharded, or a donation that XLA drops, shows up here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlx import kernels_pallas, policy, train

_MOSAIC = "tpu_custom_call"


def _per_chip_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded `jax.ShapeDtypeStruct`s."""
  return sum(
    int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(tree)
  )


def _abstract(mesh, spec, shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _model_config():
  return policy.ModelConfig.small("qwen2", param_dtype="bfloat16", compute_dtype="bfloat16")


def _train_batch(mesh, rows=8, length=32):
  spec = PartitionSpec(train.BATCH_AXES)
  return {
    "tokens": _abstract(mesh, spec, (rows, length), jnp.int32),
    "loss_mask": _abstract(mesh, spec, (rows, length), jnp.bool_),
    "advantages": _abstract(mesh, spec, (rows,), jnp.float32),
    "old_logp": _abstract(mesh, spec, (rows, length), jnp.float32),
  }


def test_train_step_compiles_sharded_and_donates_state(v5e_2x2, lower_and_compile):
  mesh = train.make_mesh(data=2, fsdp=2, devices=v5e_2x2)
  step = train.make_train_step(_model_config(), train.get_config(), mesh)
  state, batch = step.abstract_state, _train_batch(mesh)
  _, compiled = lower_and_compile(step.jitted.trace(state, batch), v5e_2x2[0])
  # The compiled step keeps the state on its partition rules (FSDP over "fsdp").
  in_state = compiled.input_shardings[0][0]
  for got, want in zip(jax.tree.leaves(in_state), jax.tree.leaves(state), strict=True):
    assert got.is_equivalent_to(want.sharding, len(want.shape))
  # Per chip (TPU tiles pad small arrays, so the compiler's bytes are >= the logical ones):
  # the arguments hold this chip's shard of the state and batch, and the donated state is
  # aliased to the new state.
  memory = compiled.memory_analysis()
  state_bytes, batch_bytes = _per_chip_bytes(state), _per_chip_bytes(batch)
  assert memory.argument_size_in_bytes >= state_bytes + batch_bytes
  assert state_bytes <= memory.alias_size_in_bytes <= memory.argument_size_in_bytes
  assert memory.output_size_in_bytes >= memory.alias_size_in_bytes
  assert memory.temp_size_in_bytes > 0


def test_compute_logprobs_compiles_sharded(v5e_2x2, lower_and_compile):
  mesh = train.make_mesh(data=2, fsdp=2, devices=v5e_2x2)
  compute_logprobs = train.make_compute_logprobs(_model_config(), train.get_config(), mesh)
  params = train.abstract_train_state(_model_config(), train.get_config(), mesh).params
  batch = _train_batch(mesh, rows=32, length=128)  # one (8, 128) f32 output tile per chip
  batch = {k: v for k, v in batch.items() if k in ("tokens", "loss_mask")}
  _, compiled = lower_and_compile(compute_logprobs.jitted.trace(params, batch), v5e_2x2[0])
  memory = compiled.memory_analysis()
  assert memory.argument_size_in_bytes >= _per_chip_bytes(params) + _per_chip_bytes(batch)
  assert memory.output_size_in_bytes == 32 * 128 * 4 // 4  # f32[B, S] split over 4 chips
  assert memory.alias_size_in_bytes == 0  # nothing donated


def _paged_attention_inputs(mesh, batch_spec, page_dtype, *, rows=8):
  num_kv_heads, gqa, head_dim, num_pages, page_size, pages_per_sequence = 2, 4, 128, 64, 16, 8
  pool = (num_kv_heads, num_pages, page_size, head_dim)
  return (
    _abstract(mesh, batch_spec, (rows, num_kv_heads * gqa, head_dim), jnp.bfloat16),
    _abstract(mesh, PartitionSpec(), pool, page_dtype),
    _abstract(mesh, PartitionSpec(), pool, page_dtype),
    _abstract(mesh, batch_spec, (rows,), jnp.int32),
    _abstract(mesh, batch_spec, (rows, pages_per_sequence), jnp.int32),
    _abstract(mesh, PartitionSpec(), (num_kv_heads,), jnp.float32),
    _abstract(mesh, PartitionSpec(), (num_kv_heads,), jnp.float32),
  )


def test_auto_dispatch_follows_the_inputs_tpu_sharding(v5e_2x2, lower_and_compile):
  # No mesh context, no default device: only the inputs' sharding names the TPU.
  mesh = Mesh(np.asarray(v5e_2x2[:1]), ("x",))
  seen = {}

  def attend(q, k_pages, v_pages, lengths, page_table, k_scale, v_scale):
    seen["platform"] = kernels_pallas.arrays_platform(q, k_pages, v_pages, lengths, page_table)
    seen["context_mesh_empty"] = jax.sharding.get_abstract_mesh().empty
    return kernels_pallas.paged_attention(
      q, k_pages, v_pages, lengths, page_table, k_scale=k_scale, v_scale=v_scale
    )

  inputs = _paged_attention_inputs(mesh, PartitionSpec(), jnp.bfloat16)
  lowered, _ = lower_and_compile(jax.jit(attend).trace(*inputs), v5e_2x2[0])
  assert seen == {"platform": "tpu", "context_mesh_empty": True}
  assert _MOSAIC in lowered.as_text()
  # The same program on CPU arrays keeps the XLA path.
  cpu = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs)
  assert _MOSAIC not in jax.jit(attend).trace(*cpu).lower().as_text()
  assert seen["platform"] == "cpu"


@pytest.mark.parametrize("page_dtype", ["bfloat16", "float8_e4m3fn"])
def test_paged_attention_mosaic_kernel_compiles_under_shard_map(
  v5e_2x2, lower_and_compile, page_dtype
):
  # As the sampler calls it: per shard, its slots against the replicated pools.
  mesh = Mesh(np.asarray(v5e_2x2), ("slots",))
  spec, rep = PartitionSpec("slots"), PartitionSpec()

  def attend(q, k_pages, v_pages, lengths, page_table, k_scale, v_scale):
    return jax.shard_map(
      lambda q, k, v, n, t, ks, vs: kernels_pallas.paged_attention(
        q, k, v, n, t, k_scale=ks, v_scale=vs
      ),
      mesh=mesh,
      in_specs=(spec, rep, rep, spec, spec, rep, rep),
      out_specs=spec,
      check_vma=False,
    )(q, k_pages, v_pages, lengths, page_table, k_scale, v_scale)

  inputs = _paged_attention_inputs(mesh, spec, page_dtype)
  lowered, compiled = lower_and_compile(jax.jit(attend).trace(*inputs), v5e_2x2[0])
  assert _MOSAIC in lowered.as_text()
  memory = compiled.memory_analysis()
  pool_bytes = 2 * 2 * 64 * 16 * 128 * jnp.dtype(page_dtype).itemsize
  assert memory.argument_size_in_bytes >= pool_bytes  # both pools, replicated on each chip
  assert memory.output_size_in_bytes == 2 * 8 * 128 * 2  # this chip's 2 rows, bf16


def test_fp8_blockwise_matmul_mosaic_kernel_compiles(v5e_2x2, lower_and_compile):
  mesh = Mesh(np.asarray(v5e_2x2[:1]), ("x",))
  m, k, n = 128, 512, 256
  rep = PartitionSpec()
  inputs = (
    _abstract(mesh, rep, (m, k), jnp.float8_e4m3fn),
    _abstract(mesh, rep, (m, k // 128), jnp.float32),
    _abstract(mesh, rep, (k, n), jnp.float8_e4m3fn),
    _abstract(mesh, rep, (k // 128, n // 128), jnp.float32),
  )
  lowered, compiled = lower_and_compile(
    jax.jit(kernels_pallas.fp8_blockwise_matmul).trace(*inputs), v5e_2x2[0]
  )
  assert _MOSAIC in lowered.as_text()
  assert compiled.memory_analysis().output_size_in_bytes == m * n * 2  # bf16


def test_arrays_platform_prefers_the_traced_mesh(v5e_2x2):
  mesh = Mesh(np.asarray(v5e_2x2), ("x",))
  tpu = _abstract(mesh, PartitionSpec("x"), (8, 4), jnp.float32)
  assert kernels_pallas.arrays_platform(tpu) == "tpu"  # a ShapeDtypeStruct's own sharding
  cpu_array = jnp.ones((8, 4))  # concrete, on the host CPU
  with pytest.raises(ValueError, match="several platforms"):
    kernels_pallas.arrays_platform(tpu, cpu_array)
  seen = []

  def fn(x):
    # Under the TPU trace a closed-over CPU array is a constant moved to the TPU.
    seen.append(kernels_pallas.arrays_platform(x, cpu_array))
    return x

  jax.jit(fn).trace(tpu)
  assert seen == ["tpu"]
