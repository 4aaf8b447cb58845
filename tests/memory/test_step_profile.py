"""The step traced on fake tensors: what the loss's backward holds, moment by moment.

Backward makes a layer's weight gradient after the gradient flowing into it: the loss's
backward holds its logits' gradient (and their softmax's) at its peak, and the head's weight
gradient only once they are freed. At a large vocabulary both are large; planning them as
held together put FSDP2's step peak the head's gradient (4 MB here) above what a real step
on two gloo ranks held.
"""

from __future__ import annotations

import gc

import pytest

from fsdp_guide.memory import plan
from fsdp_guide.memory._profile import traced_profile
from fsdp_guide.models import TinyTransformer, TransformerConfig

LARGE_VOCAB = TransformerConfig(vocab_size=16384, dim=64, n_heads=2, n_layers=2, seq_len=64)


def _model(config: TransformerConfig = LARGE_VOCAB) -> TinyTransformer:
    return TinyTransformer(config)


def test_the_loss_peaks_before_the_head_gradient_is_made() -> None:
    loss = traced_profile(_model(), 4, LARGE_VOCAB.seq_len).stretches[0]
    assert not loss.unit
    head = LARGE_VOCAB.vocab_size * LARGE_VOCAB.dim
    assert loss.largest_grad == head  # the head's weight gradient is made in this stretch
    # Its moments cover it: their activations peak where it is, their gradients add up.
    assert max(a for a, _ in loss.moments) == loss.peak
    assert loss.moments[-1][1] == loss.grads
    assert [g for _, g in loss.moments] == sorted(g for _, g in loss.moments)
    # At the peak (the logits' gradient) no weight gradient exists yet; once the head's is
    # made, the logits' gradient is gone and far less is held.
    assert loss.moments[0] == (loss.peak, 0)
    assert loss.held == loss.peak < loss.peak + loss.grads


def test_fsdp2_plans_the_loss_without_the_gradients_still_to_come() -> None:
    model = _model()
    planned = plan(model, batch_size=4, seq_len=LARGE_VOCAB.seq_len, world_size=2, strategy="fsdp2")
    loss = traced_profile(model, 4, LARGE_VOCAB.seq_len).stretches[0]
    root = 4 * sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    assert planned.step_peak_kind.startswith("the loss's backward"), planned.step_peak_kind
    state = planned.between_steps[planned.fullest_rank].total
    # The state, the root's gathered parameters and the loss's activations at their peak:
    # not the head's gradient on top (made after that peak).
    assert planned.step_peak == state + root + loss.peak


def test_ddp_plans_the_loss_without_the_head_gradient() -> None:
    model = _model()
    planned = plan(model, batch_size=4, seq_len=LARGE_VOCAB.seq_len, world_size=2, strategy="ddp")
    loss = traced_profile(model, 4, LARGE_VOCAB.seq_len).stretches[0]
    state = planned.between_steps[planned.fullest_rank].total  # the buckets included
    # The gradients are views of the buckets: at the loss's peak, its activations alone.
    assert planned.step_peak == state + loss.peak


def _fsdp2_peaks() -> tuple[int, ...]:
    return plan(
        _model(), batch_size=4, seq_len=LARGE_VOCAB.seq_len, world_size=2, strategy="fsdp2"
    ).rank_peaks


@pytest.mark.parametrize("condition", ["collected", "gc disabled", "after other plans"])
def test_the_same_plan_in_any_process_state(condition: str) -> None:
    expected = _fsdp2_peaks()
    if condition == "collected":
        gc.collect()
        got = _fsdp2_peaks()
    elif condition == "gc disabled":
        gc.disable()
        try:
            got = _fsdp2_peaks()
        finally:
            gc.enable()
    else:
        for strategy in ("ddp", "deepspeed_zero3"):
            plan(_model(), batch_size=8, seq_len=64, world_size=1, strategy=strategy)
        got = _fsdp2_peaks()
    assert got == expected
