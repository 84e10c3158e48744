"""Lowering rules for the ``"neuron"`` platform, which JAX knows only once its PJRT plugin is
discovered: registering a rule for an unknown platform raises, so the registration waits for
JAX's plugin discovery (docs/neuron-kernel.md, "The `"neuron"` lowering")."""

from __future__ import annotations

from typing import Callable

NEURON_PLATFORM = "neuron"


def register_on_discovery(register: Callable[[], None]) -> Callable[..., bool]:
    """Runs ``register()`` (which registers rules with ``platform="neuron"``) once JAX knows that
    platform, and returns the callback that tries it: it returns whether the rules are
    registered (``register`` raising ``NotImplementedError`` means not yet)."""
    done = []

    def callback(**_plugin_info) -> bool:
        if done:
            return True
        try:
            register()
        except NotImplementedError:
            return False  # no Neuron plugin among the discovered ones
        done.append(True)
        return True

    try:
        from jax._src import xla_bridge

        xla_bridge.register_plugin_callbacks(callback)
    except (ImportError, AttributeError):
        callback()  # a JAX without plugin callbacks: succeeds only if "neuron" is already known
    return callback
