"""CTPO's position-adaptive clip window and its valid-token position count."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from rlx.objectives import ctpo_clip_scale, ctpo_loss

T = 102
MASKED_SPAN = (50, 51)  # e.g. a tool observation inside the response
LAST = T - 1  # the 100th valid token


def single_token_case(index, delta, advantage, *, masked_span=True):
  """Inputs whose seq-mean-token-sum loss is the per-token loss of token `index`.

  All other tokens have log-ratio 0 and advantage 0; masked tokens hold NaN.
  """
  mask = np.ones((1, T), np.float32)
  if masked_span:
    mask[0, list(MASKED_SPAN)] = 0.0
  old = np.full((1, T), -1.0, np.float32)
  logp = old.copy()
  logp[0, index] += delta
  adv = np.zeros((1, T), np.float32)
  adv[0, index] = advantage
  for x in (old, logp, adv):
    x[mask == 0] = np.nan
  return logp, old, adv, mask


class CtpoWindowTest(chex.TestCase):
  def test_window_matches_reference(self):
    mask = np.ones((1, 100), np.float32)
    scale = np.asarray(ctpo_clip_scale(mask, position_power=0.5))[0]
    low, high = np.exp(-0.025 * scale), np.exp(0.05 * scale)
    np.testing.assert_allclose([low[0], high[0]], [0.975, 1.051], atol=1e-3)
    np.testing.assert_allclose([low[99], high[99]], [0.78, 1.65], atol=5e-3)

  def test_scale_counts_valid_tokens_only(self):
    mask = np.array([[0, 1, 1, 0, 0, 1, 0]], np.float32)  # prompt/tool tokens masked
    scale = np.asarray(ctpo_clip_scale(mask, position_power=1.0))
    np.testing.assert_allclose(scale, [[1, 1, 2, 2, 2, 3, 3]])

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
    # (token index, its log-ratio, advantage, expected per-token loss)
    ("t1_high", 0, 5.0, 1.0, -np.exp(0.05)),
    ("t1_low", 0, -5.0, -1.0, np.exp(-0.025)),
    ("t100_high", LAST, 5.0, 1.0, -np.exp(0.05 * 10.0)),
    ("t100_low", LAST, -5.0, -1.0, np.exp(-0.025 * 10.0)),
    # A < 0 with a huge ratio: dual clip at exp(0.05 * sqrt(100)).
    ("t100_dual", LAST, 5.0, -1.0, np.exp(0.05 * 10.0)),
  )
  def test_clipped_token_loss_at_positions_1_and_100(self, index, delta, advantage, expected):
    # Token LAST is the 100th VALID token: the masked span does not advance t.
    inputs = single_token_case(index, delta, advantage)
    fn = lambda lp, *rest: ctpo_loss(lp, *rest, agg="seq-mean-token-sum")
    (loss, _), grad = self.variant(jax.value_and_grad(fn, has_aux=True))(*inputs)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(grad, 0.0)  # clipped: no gradient

  def test_position_index_would_give_a_different_window(self):
    # Without the masked span the same token is the 102nd valid one.
    inputs = single_token_case(LAST, 5.0, 1.0, masked_span=False)
    loss, _ = ctpo_loss(*inputs, agg="seq-mean-token-sum")
    np.testing.assert_allclose(loss, -np.exp(0.05 * np.sqrt(102.0)), rtol=1e-5)
    self.assertGreater(abs(float(loss) + np.exp(0.5)), 1e-3)

  def test_prefix_after_masked_span_accumulates_valid_tokens_only(self):
    # delta = 0.01 on the 99 valid tokens before LAST and 0.001 on LAST: the
    # cumulative log-ratio at LAST is 0.991 (the NaN span adds nothing), which
    # is above the t=100 window (0.5): clipped high for A > 0.
    mask = np.ones((1, T), np.float32)
    mask[0, list(MASKED_SPAN)] = 0.0
    old = np.full((1, T), -1.0, np.float32)
    logp = old + 0.01
    logp[0, LAST] = old[0, LAST] + 0.001
    adv = np.zeros((1, T), np.float32)
    adv[0, LAST] = 1.0
    for x in (old, logp, adv):
      x[mask == 0] = np.nan
    _, metrics = ctpo_loss(logp, old, adv, mask, clip_high=1.0, agg="seq-mean-token-sum")
    # The largest cumulative ratio is at LAST: exp(99 * 0.01 + 0.001).
    np.testing.assert_allclose(metrics.ratio_max, np.exp(0.991), rtol=1e-4)
    # With c_high = 1.0 the window at t=100 is [.., exp(10)]: inside, gradient
    # flows with weight R_t = exp(0.991) on the current token only.
    grad = jax.grad(
      lambda x: ctpo_loss(x, old, adv, mask, clip_high=1.0, agg="seq-mean-token-sum")[0]
    )(jnp.asarray(logp))
    expected = np.zeros((1, T), np.float32)
    expected[0, LAST] = -np.exp(0.991)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-7)


if __name__ == "__main__":
  absltest.main()
