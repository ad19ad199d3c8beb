"""On-policy distillation: the teacher's per-token reverse KL as the advantage.

The student (the policy being trained) samples the responses; a frozen teacher scores the
*same* sampled tokens; each response token gets the negative single-sample estimate of the
reverse KL between student and teacher as its advantage (Thinking Machines, "On-Policy
Distillation", 2025, and the Tinker cookbook's ``incorporate_kl_penalty``; slime's OPD).
Student-sampled sequences and the reverse KL come from GKD (Agarwal et al. 2024,
arXiv:2306.13649) and Qwen3's strong-to-weak distillation (arXiv:2505.09388), which match
the teacher's whole next-token distribution instead of the sampled token's log-prob::

    d_t = log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t)      (k1, on y_t ~ student)
    A_t = A^task_t - kl_coef * sum_{k >= t, m_k = 1} discount^(n(t, k)) m_k d_k

where ``n(t, k)`` counts the valid tokens after ``t`` up to ``k`` (the discount steps once
per *student* token). ``E_{y_t ~ pi}[d_t]`` is the per-position reverse KL
``KL(pi_student || pi_teacher)``, so a policy-gradient loss that ascends ``A`` descends the
reverse KL: on-policy (ratio 1), ``E[-A_t grad log pi(y_t)] = kl_coef grad KL`` for
``discount = 0`` (``E[grad log pi] = 0`` removes the ``-1`` of the KL's derivative). Any
policy loss of ``losses.POLICY_LOSSES`` takes these advantages.

``baseline=True`` replaces ``d_k`` by ``d_k - mean(d)`` (the batch's token mean): a
constant baseline, so the expected gradient is unchanged (``E[grad log pi] = 0`` again, up
to the ``O(1 / tokens)`` share of a token in its own mean) while its variance falls when
the student is far from the teacher: sampled tokens the teacher rules out (``d`` of several
nats) otherwise dominate every update with large negative advantages.

Shapes: ``[B, T]`` = batch x response tokens, as ``polyrl.algos.advantages``; host side, no
gradient flows through the advantages.
"""

from __future__ import annotations

from typing import Any

from polyrl.algos.losses import check_same_shape
from polyrl.tensor import masked_sum, namespace, reverse_linear_scan, stop_gradient

__all__ = ["distillation_advantages"]

Array = Any
Metrics = dict[str, Array]


def distillation_advantages(
    student_log_probs: Array,
    teacher_log_probs: Array,
    mask: Array,
    kl_coef: float = 1.0,
    discount: float = 0.0,
    task_advantages: Array | None = None,
    baseline: bool = False,
) -> tuple[Array, Metrics]:
    """Per-token on-policy distillation advantages (module docstring): [B, T] -> [B, T].

    ``student_log_probs`` are the log-probs of the policy that *sampled* the tokens (the
    batch's ``old_log_probs``), ``teacher_log_probs`` the teacher's log-probs of the same
    tokens, ``mask`` the response mask (0 on padding and, in multi-turn episodes, on the
    environment's tokens between turns: those carry no KL and do not advance the
    discount). Values outside the mask are never read, so a teacher that leaves ``-inf``
    or NaN there is harmless.

    * ``discount = 0`` (the default; the Tinker cookbook's ``kl_discount_factor=0``;
      slime has no discount): each token's advantage is its own ``-kl_coef d_t``, the greedy per-token
      objective (the next token only). ``0 < discount <= 1`` adds the discounted KL of the
      student's later tokens (the return of the per-token reward ``-d``, which also counts
      that a token steers the rest of the response); Tinker steps its discount per
      position, here it steps per valid token, as ``advantages.reinforce_plus_plus``.
    * ``task_advantages`` [B, T] (optional): an advantage of a task reward (e.g.
      ``advantages.grpo``, already normalised) that the KL term is added to (slime's
      OPD, Tinker cookbook). The KL term itself is *not* whitened or group-centred: no
      published recipe does, its absolute scale says how far the student is from the
      teacher, and centring would reward tokens where the student disagrees less than
      average but still disagrees.
    * ``baseline`` (default False): subtract the batch's token mean of ``d`` from every
      ``d`` first (module docstring), the variance reduction GRPO's group mean gives an
      outcome reward. Off, as every published recipe, by default; on, a student far from
      its teacher learns much faster (docs/algorithms.md has the tiny copy task's numbers).

    Returns ``(advantages, metrics)``: advantages [B, T] (0 at masked positions) and the
    metrics ``reverse_kl`` (token mean of ``d`` over valid tokens; 0 if there are none)
    and ``tokens`` (its denominator, the number of valid tokens), both 0-d: batches
    combine as ``sum(reverse_kl * tokens) / sum(tokens)``.
    """
    check_same_shape(
        "distillation_advantages",
        student_log_probs=student_log_probs,
        teacher_log_probs=teacher_log_probs,
        mask=mask,
        task_advantages=task_advantages,
    )
    if student_log_probs.ndim != 2:
        raise ValueError(
            f"distillation_advantages: inputs must be [B, T] per-token log-probs, got shape "
            f"{tuple(student_log_probs.shape)}"
        )
    if not 0.0 <= discount <= 1.0:
        raise ValueError(
            f"distillation_advantages: discount={discount!r} must lie in [0, 1] "
            "(0: each token's own KL, as the Tinker cookbook and Qwen3; 1: undiscounted)"
        )
    if not kl_coef >= 0.0:
        raise ValueError(
            f"distillation_advantages: kl_coef={kl_coef!r} must be >= 0 (a negative weight "
            "would push the student away from the teacher)"
        )
    xp = namespace(student_log_probs, teacher_log_probs, mask)
    student = stop_gradient(student_log_probs)
    m = xp.astype(mask, student.dtype)
    valid = m != 0
    # where, not a product: -inf - -inf at padding would be NaN, and NaN * 0 is NaN
    d = xp.where(valid, student - stop_gradient(teacher_log_probs), xp.zeros_like(student))
    tokens = xp.sum(m)
    reverse_kl = masked_sum(d, m) / xp.where(tokens > 0, tokens, xp.ones_like(tokens))
    reward = -(d - reverse_kl) * m if baseline else -d * m
    # y_t = m_t r_t + (m_t discount + 1 - m_t) y_{t+1}: a masked position passes through
    kl_return = reverse_linear_scan(reward, m * discount + (1.0 - m))
    advantages = kl_coef * kl_return * m
    if task_advantages is not None:
        advantages = advantages + stop_gradient(task_advantages) * m
    return advantages, {"reverse_kl": reverse_kl, "tokens": tokens}
