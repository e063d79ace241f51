"""The one error family of beaconkv: every error the library raises on purpose is a :class:`BeaconKVError`.

Each concrete error also keeps the built-in base that says what kind of failure it is
(``ValueError`` for bad input, ``RuntimeError`` for what cannot run here), so both of these work::

    try:
        beaconkv.generate(model, tok, prompts, policy=policy)
    except beaconkv.BeaconKVError as error:     # anything beaconkv refused, with the fix in the message
        ...
    except ValueError:                          # still catches bad input, as before
        ...

This module imports nothing, so every layer of the package can use it without reaching up.
"""

__all__ = ["BeaconKVError"]


class BeaconKVError(Exception):
    """Base class of every error beaconkv raises on purpose; its message names the bad value and the fix."""
