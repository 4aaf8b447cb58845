"""Running the user's model code from the command line: import it, build it, bound its time
(private)."""

from __future__ import annotations

import contextlib
import importlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fsdp_guide.errors import CommandError


class _Stopped(BaseException):
    """Ends building early with a message; not an ``Exception``, so no builder swallows it."""


def import_user_module(module_name: str) -> Any:
    """The module ``module_name`` of the user's code; whatever importing it raises, a
    :class:`CommandError`."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise CommandError(f"cannot import {module_name!r}: {exc}") from exc
    except SystemExit as exc:
        raise CommandError(f"importing {module_name!r} called sys.exit({exc.code!r})") from None
    except Exception as exc:  # the module's own code failed
        raise CommandError(f"importing {module_name!r} raised {type(exc).__name__}: {exc}") from exc


def load_builder(path: str, kwargs: dict[str, Any]) -> Callable[[], Any]:
    """A function building the model ``package.module:builder`` with ``kwargs``.

    The module is imported now; the builder runs when the function is called, and a
    builder that calls ``sys.exit`` instead of returning stops building with a message.

    Raises:
        CommandError: When the module cannot be imported (whatever it raised) or the
            builder cannot be found.

    Examples:
        >>> load_builder("fsdp_guide.models:MLP", {"depth": 1})().net[0].in_features
        32
        >>> load_builder("fsdp_guide.models:Nope", {})
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CommandError: module fsdp_guide.models has no attribute 'Nope'
    """
    module_name, _, attribute = path.partition(":")
    builder = getattr(import_user_module(module_name), attribute, None)
    if not callable(builder):
        raise CommandError(f"module {module_name} has no attribute {attribute!r}")

    def build() -> Any:
        try:
            return builder(**kwargs)
        except SystemExit as exc:
            raise _Stopped(
                f"the model builder {path} called sys.exit({exc.code!r}) instead of returning "
                "a model"
            ) from None

    return build


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Stop the block with a :class:`CommandError` after ``seconds`` (main thread, POSIX).

    Elsewhere (another thread, Windows) the block runs without a limit.

    Examples:
        >>> import time
        >>> with time_limit(0.05, "sleeping"):
        ...     time.sleep(5)
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CommandError: sleeping did not finish within 0.05 s ...
    """

    def expire(signum: int, frame: Any) -> None:
        raise _Stopped(
            f"{what} did not finish within {seconds:g} s (a builder waiting on input, a "
            "download or a lock never returns); fix it, or allow longer with --build-timeout"
        )

    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return
    handler = signal.signal(signal.SIGALRM, expire)
    started = time.monotonic()
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)  # a caller's own timer
    try:
        yield
    except _Stopped as exc:
        raise CommandError(str(exc)) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if outer > 0:  # give it back what is left of it
            left = max(outer - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, interval)
