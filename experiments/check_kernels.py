r"""Hardware check of rlx.kernels_pallas: accuracy vs the references, time, bandwidth, TFLOP/s.

Runs every kernel on the real hardware path of the current backend (GPU: the
Pallas Triton kernels; TPU: the Pallas Mosaic kernels) against its pure-jnp
reference and prints one table:

  * paged decode attention, bf16 and FP8 (e4m3fn) KV, several context lengths
    and batch sizes: max abs error, relative error (max abs / max |ref|), time,
    achieved GB/s (KV bytes read = 2 * Hkv * D * sum(lengths) * bytes/elem) and
    that as a fraction of the device copy bandwidth measured in the same run
    (a large `x * 2` elementwise copy: bytes read + written per second). Also the time of
    the XLA reference path (`impl="xla"`) for comparison.
  * FP8 blockwise matmul (`fp8_blockwise_matmul`, DeepSeek-V3 scales,
    https://arxiv.org/abs/2412.19437): errors vs `fp8_blockwise_matmul_reference`
    on the same quantized inputs, TFLOP/s, and the ratio to a bf16 `jnp.dot` on
    the same shape (incl. 4096^3).

Targets (H100/H200): paged attention >= 0.80 of copy bandwidth at long context
(decode is bandwidth-bound, PagedAttention https://arxiv.org/abs/2309.06180);
FP8 matmul >= 1.6x bf16 at 4096^3 (the FP8 tensor cores have twice the bf16 peak).

Status: written without access to a GPU or TPU, so the full run has NOT been
executed yet and no hardware table is committed. `--smoke` runs everything with
tiny shapes on CPU in Pallas interpret mode (both the GPU-style and the TPU
kernels), which checks that the script and kernels work, not their speed; it is
exercised by tests/kernels_pallas/test_kernels_check_script.py.

Usage:
  python experiments/check_kernels.py                     # full run on GPU/TPU
  python experiments/check_kernels.py --output=experiments/results/check_kernels_h200.md
  python experiments/check_kernels.py --smoke             # tiny, CPU interpret mode
"""

import dataclasses
import os
import sys
import time

from absl import app, flags

# jax (and rlx, which imports it) is imported inside the functions so that
# `--smoke` can select the CPU platform before jax initializes its backends.

FLAGS = flags.FLAGS
flags.DEFINE_bool("smoke", False, "Tiny shapes in Pallas interpret mode (runs on CPU).")
flags.DEFINE_string("output", None, "If set, also write the table (markdown) to this file.")
flags.DEFINE_list("context_lengths", ["1024", "4096", "16384", "32768"], "Paged-attn contexts.")
flags.DEFINE_list("batch_sizes", ["8", "32", "64"], "Paged-attention batch sizes.")
flags.DEFINE_list("kv_dtypes", ["bfloat16", "float8_e4m3fn"], "KV page dtypes.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads (Llama-3-8B / Qwen3-8B: 8).")
flags.DEFINE_integer("gqa", 4, "Query heads per KV head.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_integer("page_size", 64, "Tokens per page.")
flags.DEFINE_integer("pages_per_compute_block", 0, "Pages per kernel step (0: kernel default).")
flags.DEFINE_list("matmul_shapes", ["1024x4096x4096", "4096x4096x4096", "8192x8192x8192"], "MxKxN")
flags.DEFINE_integer("iters", 20, "Calls per timed run (best of 3 runs reported).")
flags.DEFINE_float("max_kv_gib", 24.0, "Skip paged-attention cases whose KV pool exceeds this.")


@dataclasses.dataclass
class Row:
  kernel: str
  case: str
  max_abs_err: float
  rel_err: float
  time_us: float
  rate: str  # "GB/s" or "TFLOP/s" figure
  vs_baseline: str  # fraction of copy bandwidth, or ratio to bf16 jnp.dot
  note: str = ""


def _timeit(fn, *args, iters: int, repeats: int = 3) -> float:
  """Seconds per call of jitted `fn(*args)`: best of `repeats` runs of `iters` calls.

  Calls within a run are dispatched back to back and only the last is waited
  for, so host dispatch overlaps device work (small, launch-bound cases still
  include launch gaps).
  """
  import jax

  jax.block_until_ready(fn(*args))  # compile + warm up
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t0) / iters)
  return best


def measure_copy_bandwidth(num_bytes: int, iters: int) -> float:
  """Bytes/s of a device copy (read + write) of a `num_bytes` float32 array."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((num_bytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a * 2.0)  # not foldable, unlike `a + 0`
  seconds = _timeit(copy, x, iters=iters)
  return 2 * num_bytes / seconds


def _errors(got, want):
  import numpy as np

  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  max_abs = float(np.max(np.abs(got - want)))
  return max_abs, max_abs / max(float(np.max(np.abs(want))), 1e-30)


def check_paged_attention(cfg, copy_bw: float, backend_impls, interpret_for) -> list[Row]:
  """Paged attention rows: every (kernel, kv dtype, batch, context) of `cfg`."""
  import jax
  import jax.numpy as jnp

  from rlx import kernels_pallas as kp

  rows = []
  timing = dict(iters=cfg["iters"], repeats=cfg.get("repeats", 3))
  hkv, group, d, page = cfg["num_kv_heads"], cfg["gqa"], cfg["head_dim"], cfg["page_size"]
  bs = kp.PagedAttentionBlockSizes(pages_per_compute_block=cfg["pages_per_compute_block"] or None)
  for kv_dtype in cfg["kv_dtypes"]:
    dtype = jnp.dtype(kv_dtype)
    for batch in cfg["batch_sizes"]:
      for ctx in cfg["context_lengths"]:
        pps = -(-ctx // page)
        num_pages = batch * pps + 1
        pool_bytes = 2 * hkv * num_pages * page * d * dtype.itemsize
        if pool_bytes > cfg["max_kv_gib"] * 2**30:
          rows.append(Row("paged_attention", f"{kv_dtype} B={batch} ctx={ctx}", 0, 0, 0, "-",
                          "-", f"skipped: KV pool {pool_bytes / 2**30:.1f} GiB"))  # fmt: skip
          continue
        key = jax.random.key(batch * 100003 + ctx)
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (batch, hkv * group, d), jnp.bfloat16)
        shape = (hkv, num_pages, page, d)
        k = jax.random.normal(kk, shape, jnp.bfloat16)
        v = jax.random.normal(kv, shape, jnp.bfloat16)
        if "float8" in dtype.name:
          k_scale = jnp.full((hkv,), 4.5 / 200.0, jnp.float32)  # amax ~4.5 for N(0,1)
          v_scale = jnp.float32(4.5 / 100.0)
          k = kp.saturating_cast(k.astype(jnp.float32) / k_scale[:, None, None, None], dtype)
          v = kp.saturating_cast(v.astype(jnp.float32) / v_scale, dtype)
        else:
          k_scale = v_scale = None
          k, v = k.astype(dtype), v.astype(dtype)
        # Sequences of slightly different lengths (ctx - b), pages shuffled in the pool.
        lengths = jnp.maximum(ctx - jnp.arange(batch, dtype=jnp.int32), 1)
        perm = jax.random.permutation(key, num_pages)[: batch * pps]
        table = perm.reshape(batch, pps).astype(jnp.int32)
        kv_bytes = 2 * hkv * d * int(lengths.sum()) * dtype.itemsize
        case = f"{kv_dtype} B={batch} ctx={ctx} H={hkv * group}/{hkv} D={d} page={page}"
        # Reference on (at most) 4 sequences to bound its dense-gather memory.
        nb = min(batch, 4)
        want = kp.paged_attention_reference(
          q[:nb], k, v, lengths[:nb], table[:nb], k_scale=k_scale, v_scale=v_scale
        )
        for impl in backend_impls:
          fn = jax.jit(
            lambda q, k, v, lengths, table, ks, vs, impl=impl: kp.paged_attention(
              q, k, v, lengths, table, k_scale=ks, v_scale=vs, impl=impl,
              interpret=interpret_for(impl), block_sizes=bs,
            )
          )  # fmt: skip
          try:
            out = fn(q, k, v, lengths, table, k_scale, v_scale)
            err = _errors(out[:nb], want)
            args = (q, k, v, lengths, table, k_scale, v_scale)
            seconds = _timeit(fn, *args, **timing)
          except Exception as e:  # a failing kernel is a table row, not a crash
            rows.append(Row(f"paged_attention[{impl}]", case, float("nan"), float("nan"), 0,
                            "-", "-", f"FAILED: {type(e).__name__}: {str(e)[:120]}"))  # fmt: skip
            continue
          gbps = kv_bytes / seconds / 1e9
          rows.append(
            Row(
              f"paged_attention[{impl}]", case, err[0], err[1], seconds * 1e6, f"{gbps:.1f} GB/s",
              f"{kv_bytes / seconds / copy_bw:.2f} of copy",
            )
          )  # fmt: skip
  return rows


def check_fp8_matmul(cfg, pallas_interpret) -> list[Row]:
  """FP8 blockwise matmul rows: Pallas kernel vs reference, and vs bf16 jnp.dot."""
  import jax
  import jax.numpy as jnp

  from rlx import kernels_pallas as kp

  rows = []
  timing = dict(iters=cfg["iters"], repeats=cfg.get("repeats", 3))
  for m, k, n in cfg["matmul_shapes"]:
    kx, kw = jax.random.split(jax.random.key(m + 7 * k + 13 * n))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32)
    xq, xs = kp.quantize_fp8_per_token_group(x)
    wq, ws = kp.quantize_fp8_blockwise(w)
    want = kp.fp8_blockwise_matmul_reference(xq, xs, wq, ws)
    fp8 = jax.jit(
      lambda xq, xs, wq, ws: kp.fp8_blockwise_matmul(
        xq, xs, wq, ws, out_dtype=jnp.bfloat16, impl="pallas", interpret=pallas_interpret
      )
    )
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    bf16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
    flops = 2.0 * m * k * n
    case = f"{m}x{k}x{n} e4m3 (1x128 act, 128x128 wt)"
    try:
      out = fp8(xq, xs, wq, ws)
      err = _errors(out, want)
      t_fp8 = _timeit(fp8, xq, xs, wq, ws, **timing)
    except Exception as e:
      rows.append(Row("fp8_blockwise_matmul", case, float("nan"), float("nan"), 0, "-", "-",
                      f"FAILED: {type(e).__name__}: {str(e)[:120]}"))  # fmt: skip
      continue
    t_bf16 = _timeit(bf16, xb, wb, **timing)
    rows.append(
      Row("fp8_blockwise_matmul", case, err[0], err[1], t_fp8 * 1e6,
          f"{flops / t_fp8 / 1e12:.1f} TFLOP/s", f"{t_bf16 / t_fp8:.2f}x bf16 dot")
    )  # fmt: skip
    rows.append(
      Row("jnp.dot bf16", f"{m}x{k}x{n}", 0.0, 0.0, t_bf16 * 1e6,
          f"{flops / t_bf16 / 1e12:.1f} TFLOP/s", "1.00x")
    )  # fmt: skip
  return rows


def format_table(rows: list[Row], header: str) -> str:
  cols = ["kernel", "case", "max abs err", "rel err", "time (us)", "rate", "vs baseline", "note"]
  lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    lines.append(
      f"| {r.kernel} | {r.case} | {r.max_abs_err:.3g} | {r.rel_err:.3g} | {r.time_us:.1f} | "
      f"{r.rate} | {r.vs_baseline} | {r.note} |"
    )
  return "\n".join(lines)


def run_checks(cfg: dict) -> tuple[list[Row], str]:
  """Runs all checks for config `cfg` (see `config_from_flags`); returns rows and a header."""
  import jax
  from jax.experimental.pallas import tpu as pltpu

  backend = jax.default_backend()
  if cfg["smoke"]:
    impls = ("pallas_gpu", "pallas_tpu", "xla")
    interpret_for = {"pallas_gpu": True, "pallas_tpu": pltpu.InterpretParams(), "xla": False}.get
    matmul_interpret = True
    copy_bytes = 64 * 2**20
  elif backend in ("gpu", "tpu"):
    impls = (f"pallas_{backend}", "xla")
    interpret_for = lambda impl: False  # noqa: E731
    matmul_interpret = False
    copy_bytes = 4 * 2**30
  else:
    raise SystemExit(f"No GPU/TPU (backend={backend!r}); use --smoke for the CPU interpret run.")
  copy_bw = measure_copy_bandwidth(copy_bytes, cfg["iters"])
  device = jax.devices()[0]
  header = (
    f"# rlx.kernels_pallas hardware check\n\ndevice: {device.device_kind} ({backend}), "
    f"jax {jax.__version__}, smoke={cfg['smoke']}, measured copy bandwidth "
    f"{copy_bw / 1e9:.1f} GB/s ({copy_bytes / 2**30:.2f} GiB array, read+write)\n\n"
    f"command: {cfg['command']}"
  )
  rows = check_paged_attention(cfg, copy_bw, impls, interpret_for)
  rows += check_fp8_matmul(cfg, matmul_interpret)
  return rows, header


def config_from_flags() -> dict:
  if FLAGS.smoke:
    return dict(
      smoke=True, context_lengths=[16, 40], batch_sizes=[2],
      kv_dtypes=["bfloat16", "float8_e4m3fn"],
      num_kv_heads=2, gqa=2, head_dim=64, page_size=16, pages_per_compute_block=2,
      matmul_shapes=[(32, 256, 128)], iters=2, repeats=1, max_kv_gib=1.0,
      command=" ".join(["python"] + sys.argv),
    )  # fmt: skip
  shapes = [tuple(int(v) for v in s.split("x")) for s in FLAGS.matmul_shapes]
  return dict(
    smoke=False, context_lengths=[int(c) for c in FLAGS.context_lengths],
    batch_sizes=[int(b) for b in FLAGS.batch_sizes], kv_dtypes=list(FLAGS.kv_dtypes),
    num_kv_heads=FLAGS.num_kv_heads, gqa=FLAGS.gqa, head_dim=FLAGS.head_dim,
    page_size=FLAGS.page_size, pages_per_compute_block=FLAGS.pages_per_compute_block,
    matmul_shapes=shapes, iters=FLAGS.iters, max_kv_gib=FLAGS.max_kv_gib,
    command=" ".join(["python"] + sys.argv),
  )  # fmt: skip


def main(argv):
  del argv
  if FLAGS.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  cfg = config_from_flags()
  print("rerun with:", cfg["command"], flush=True)
  rows, header = run_checks(cfg)
  table = format_table(rows, header)
  print(table)
  if FLAGS.output:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
    with open(FLAGS.output, "w") as f:
      f.write(table + "\n")
    print(f"wrote {FLAGS.output}")


if __name__ == "__main__":
  app.run(main)
