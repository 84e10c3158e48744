"""Errors raised by the NKI emulator.

Every rejection is an :class:`NkiEmulatorError`; the subclass says which family of rule was broken
and the message starts with the rule itself (for example ``"partition axis > 128: ..."``), so a test
or a user can match on the rule rather than on wording around it.
"""

from __future__ import annotations


class NkiEmulatorError(Exception):
    """A kernel did something the Neuron compiler or hardware would reject (or that NKI leaves undefined)."""


class NkiLimitError(NkiEmulatorError):
    """A hardware size limit: partitions, PSUM tile size, matmul and transpose tile sizes."""


class NkiCapacityError(NkiEmulatorError):
    """More live on-chip memory than the chip has: SBUF bytes per partition or PSUM banks."""


class NkiMemorySpaceError(NkiEmulatorError):
    """An operand lives in a memory the instruction cannot read or write."""


class NkiShapeError(NkiEmulatorError):
    """Shapes that do not line up: dst against the computed value, operands against each other."""


class NkiDtypeError(NkiEmulatorError):
    """A dtype the instruction does not accept."""


class NkiOutOfBoundsError(NkiEmulatorError):
    """An access outside a tensor, or a gather index outside the source rows."""


class NkiUninitializedReadError(NkiEmulatorError):
    """A read of memory that was never written (fresh allocations hold garbage)."""


class NkiUnsupportedError(NkiEmulatorError):
    """Valid NKI perhaps, but outside the subset this emulator models (see docs/nki-emulator.md)."""
