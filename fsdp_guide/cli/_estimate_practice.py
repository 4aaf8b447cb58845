"""``estimate``'s options for training as it is really run: gradient accumulation and frozen
parameters (``--grad-accum``, ``--sync-each-micro-step``, ``--trainable``) (private).

Kept apart from the parser's other options so that each concern stays one file: the options,
their checks, how ``--trainable lora:r=R`` adapts the model (``peft``, imported only then) and
the lines they add to the table.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsdp_guide.cli._args import shown
from fsdp_guide.errors import CommandError

#: Strategies whose accumulation and frozen parameters ``plan`` knows, for the default list.
ACCUMULATION_STRATEGIES = ("ddp", "fsdp", "fsdp2")
FROZEN_STRATEGIES = ("ddp", "fsdp2")
_LORA = re.compile(r"^lora:r=(?P<r>[0-9]+)(?:,targets=(?P<targets>[\w.]+(?:\+[\w.]+)*))?$")


@dataclass(frozen=True)
class TrainableArg:
    """What ``--trainable`` asked: LoRA adapters of rank ``r`` (on ``targets``, or ``peft``'s
    default modules for the model type), or parameter-name patterns."""

    text: str
    lora_rank: int = 0
    targets: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()


def trainable_arg(text: str) -> TrainableArg:
    """A ``type=`` for ``--trainable``: ``lora:r=R[,targets=A+B]`` or name patterns.

    Examples:
        >>> trainable_arg("lora:r=8").lora_rank
        8
        >>> trainable_arg("lora:r=4,targets=q_proj+v_proj").targets
        ('q_proj', 'v_proj')
        >>> trainable_arg("layers.31.*,lm_head.*").patterns
        ('layers.31.*', 'lm_head.*')
        >>> trainable_arg("lora:r=0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be lora:r=R[,targets=A+B] with R >= 1, got 'lora:r=0'
    """
    if text.startswith("lora"):
        match = _LORA.match(text)
        if match is None or int(match["r"]) < 1:
            raise argparse.ArgumentTypeError(
                f"must be lora:r=R[,targets=A+B] with R >= 1, got {shown(text)}"
            )
        targets = tuple(match["targets"].split("+")) if match["targets"] else ()
        return TrainableArg(text=text, lora_rank=int(match["r"]), targets=targets)
    patterns = tuple(p.strip() for p in text.split(",") if p.strip())
    if not patterns:
        raise argparse.ArgumentTypeError(
            "must be lora:r=R or parameter-name patterns such as 'layers.31.*,lm_head.*', "
            f"got {shown(text)}"
        )
    return TrainableArg(text=text, patterns=patterns)


def add_options(p: argparse.ArgumentParser) -> None:
    """Register ``--sync-each-micro-step`` and ``--trainable`` (``--grad-accum`` is
    ``estimate``'s own)."""
    p.add_argument(
        "--sync-each-micro-step",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --grad-accum (ddp, fsdp, fsdp2): reduce the gradients after every "
        "micro-step (FSDP then holds gradient shards only), or with --no-sync-each-micro-step "
        "once, after the last (no_sync(), set_requires_gradient_sync(False): FSDP holds every "
        "unsharded gradient); default: each strategy's own way",
    )
    p.add_argument(
        "--trainable",
        type=trainable_arg,
        default=None,
        metavar="SPEC",
        help="with --model or --hf: which parameters train (they alone have gradients and "
        "optimizer state; ddp, fsdp2): lora:r=R adds LoRA adapters of rank R with peft "
        "(the peft extra) and freezes the rest (,targets=q_proj+v_proj picks the layers), or "
        "comma-separated parameter-name patterns such as 'layers.31.*,lm_head.*'",
    )


def check(args: argparse.Namespace) -> None:
    """Refuse the options without a real model, and the sync flag without accumulation."""
    real = args.model is not None or args.hf is not None
    if not real and (args.grad_accum > 1 or args.trainable is not None):
        option = "--grad-accum" if args.grad_accum > 1 else "--trainable"
        raise CommandError(
            f"{option} needs a real model (--model package.module:builder or --hf TYPE); "
            "--params plans the model state of one step only"
        )
    if args.sync_each_micro_step is not None and args.grad_accum == 1:
        raise CommandError(
            "--sync-each-micro-step says when K micro-steps reduce: pass --grad-accum K (K > 1)"
        )


def default_strategies(args: argparse.Namespace, names: list[str]) -> list[str]:
    """The strategies planned when ``--strategy`` is not given: those that plan the options."""
    if args.strategy:
        return names
    if args.trainable is not None:
        names = [n for n in names if n in FROZEN_STRATEGIES]
    if args.grad_accum > 1 and args.sync_each_micro_step is not None:
        # A sync asked for is planned for these only; FSDP1's no_sync() in bf16 is not.
        held_back = args.precision == "mixed" and not args.sync_each_micro_step
        usable = [n for n in ACCUMULATION_STRATEGIES if not (held_back and n == "fsdp")]
        names = [n for n in names if n in usable]
    return names


def adapted(builder: Callable[[], Any], arg: TrainableArg | None) -> Callable[[], Any]:
    """The builder, its model wrapped in LoRA adapters when ``arg`` asks for them."""
    if arg is None or not arg.lora_rank:
        return builder

    def build() -> Any:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:
            raise CommandError(
                "--trainable lora needs peft: pip install -c requirements/constraints.txt "
                "-e '.[peft]'"
            ) from exc
        config = LoraConfig(r=arg.lora_rank, target_modules=list(arg.targets) or None)
        try:
            return get_peft_model(builder(), config)
        except ValueError as exc:  # no default target modules for this model type
            raise CommandError(
                f"--trainable {arg.text}: {exc}; name the layers with ,targets=A+B"
            ) from exc

    return build


def patterns(arg: TrainableArg | None) -> list[str] | None:
    """The name patterns ``plan(trainable=...)`` takes, or ``None`` (LoRA's own flags)."""
    return list(arg.patterns) if arg is not None and arg.patterns else None


def extra_lines(plans: list[Any]) -> list[str]:
    """What the options add under the table: trainable counts, accumulation per strategy."""
    from fsdp_guide.memory import format_bytes

    lines = []
    first = plans[0]
    if first.frozen_params:
        lines.append(
            f"trainable: {first.trainable_params:,} of {first.num_params:,} parameters "
            f"({first.frozen_params:,} frozen: no gradients, no optimizer state)"
        )
    for p in plans:
        acc = p.accumulation
        if acc is None:
            continue
        how = "synced each micro-step" if acc.sync_each_micro_step else "synced once"
        sent = ", ".join(f"{k} {format_bytes(b)}" for k, b in acc.payload_bytes.items())
        lines.append(
            f"{p.strategy}, {acc.micro_steps} micro-steps {how}: gradients held between "
            f"micro-steps {format_bytes(acc.held[p.fullest_rank])}; per optimizer step {sent}"
        )
    return lines
