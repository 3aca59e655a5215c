"""MC-GRPO: the median baseline over G + 1 rollouts with one dropped pivot."""

import jax.numpy as jnp
from jaxtyping import Array, Float

from rlx.objectives import _checks
from rlx.objectives._advantages import check_rewards, group_scale

MEDIAN_SCALES = ("std", "mad", "none")

# Default `eps` per scale: the MC-GRPO reference adds 1e-3 to the MAD; the std
# scale follows GRPO's 1e-6.
_DEFAULT_EPS = {"std": 1e-6, "mad": 1e-3, "none": 0.0}


def median_advantages(
  rewards: Float[Array, "Ng Gp1"],
  *,
  scale: str = "std",
  eps: float | None = None,
) -> tuple[Float[Array, "Ng Gp1"], Float[Array, "Ng Gp1"]]:
  """MC-GRPO median-baseline advantages and the keep-mask dropping one pivot per group.

  Each prompt gets an odd number G + 1 of rollouts. With m = median_g(s):

    A_ig = (s_ig - m_i) / (S_i + eps)

  where S_i is, by `scale`:
    "std":  the unbiased (N - 1) standard deviation of the G + 1 rewards (default);
    "mad":  the median absolute deviation median_g |s_ig - m_i| (the reference);
    "none": S = 1 and eps = 0, i.e. A = s - m.

  Exactly one rollout per group, the *pivot*, is the median itself: it gets
  A = 0 and keep_mask = 0, so G rollouts carry gradient, the same update cost as
  plain G-rollout GRPO. The pivot is the middle element of a stable sort of the
  group, so among tied median values the pivot is determined by index order.
  Ties: only the pivot is dropped; other rollouts whose reward equals the
  median keep A = 0 and keep_mask = 1 (they still count in loss denominators).

  Why the default is "std": with binary rewards the median is the majority
  value, so more than half of the group sits at it and the MAD is 0; the
  reference's MAD scaling then yields A in {0, +-1/eps} = {0, +-1000}. The std
  scale keeps binary-reward advantages O(1) and equals GRPO's scaling.

  Non-finite rewards: an eager call raises ValueError naming the group. Under
  `jit` a NaN/inf reward is contained: it gets A = 0 and keep_mask = 0 and is
  left out of the median, the pivot choice and the scale; the pivot is the
  lower middle of the finite members (so a group that lost one member keeps
  G - 1 rollouts with gradient).

  Reference: MC-GRPO (median-centred GRPO), https://github.com/lotusroot-kim/MC-GRPO.

  Args:
    rewards: per-rollout scalar rewards with shape `[num_groups, G + 1]`; the group
      size must be odd and >= 3.
    scale: "std" | "mad" | "none", see above.
    eps: added to the scale before dividing; None picks 1e-6 for "std" and 1e-3
      for "mad" (the reference's value); must be > 0 for "mad". Ignored for
      "none". A traced `eps` is not checked: a traced 0 with "mad" gives
      +-inf wherever a group's MAD is 0.

  Returns:
    `(advantages, keep_mask)`, both float32 with shape `[num_groups, G + 1]`;
    keep_mask is 0 at exactly one pivot index per group and 1 elsewhere.
    Multiply the keep-mask into the per-sequence loss mask before
    `broadcast_to_tokens`/the loss.
  """
  finite = check_rewards(rewards)
  rewards = _checks.as_f32(rewards)
  _checks.check_choice(scale, MEDIAN_SCALES, "scale")
  group_size = rewards.shape[1]
  if group_size < 3 or group_size % 2 == 0:
    raise ValueError(
      "`rewards` must hold an odd number G + 1 >= 3 of rollouts per group (MC-GRPO drops one "
      f"median pivot so that G carry gradient), got group size {group_size} in shape "
      f"{rewards.shape}."
    )
  if eps is None:
    eps = _DEFAULT_EPS[scale]
  _checks.check_finite(eps, "eps")
  _checks.check_non_negative(eps, "eps")
  if scale == "mad" and _checks.is_concrete(eps) and float(eps) == 0.0:
    raise ValueError(
      "`eps` must be > 0 with scale='mad': the MAD is 0 whenever more than half of a group "
      "shares the median (e.g. binary rewards), and (s - m) / 0 is +-inf. Use eps > 0 (the "
      "reference uses 1e-3) or scale='std'."
    )

  # Statistics on rewards / (a power of two per group): exact, and finite up to float32 max.
  group = group_scale(rewards, finite)
  rewards = jnp.where(finite, rewards / group, rewards)
  # Non-finite rewards sort after every finite one and never enter a statistic.
  count = jnp.sum(finite, axis=1)  # [Ng]
  order = jnp.argsort(jnp.where(finite, rewards, jnp.inf), axis=1, stable=True)
  middle = jnp.maximum(count - 1, 0) // 2
  pivot = jnp.take_along_axis(order, middle[:, None], axis=1)[:, 0]  # [Ng]
  median = jnp.take_along_axis(rewards, pivot[:, None], axis=1)  # [Ng, 1]
  centered = jnp.where(finite, rewards - median, 0.0)
  observed = jnp.where(finite, rewards, jnp.nan)

  if scale == "std":
    spread = jnp.nanstd(observed, axis=1, keepdims=True, ddof=1)
    advantages = centered / (spread + eps / group)
  elif scale == "mad":
    spread = jnp.nanmedian(jnp.abs(observed - median), axis=1, keepdims=True)
    advantages = centered / (spread + eps / group)
  else:
    advantages = centered * group

  is_pivot = jnp.arange(group_size)[None, :] == pivot[:, None]
  keep_mask = jnp.where(is_pivot | ~finite, jnp.float32(0.0), jnp.float32(1.0))
  # Rollouts at the median (the pivot and its ties) get exactly 0, even when the
  # scale is 0 and eps = 0 (0 / 0); so does every non-finite reward.
  advantages = jnp.where(centered == 0, jnp.float32(0.0), advantages)
  return advantages, keep_mask
