"""The target side of starhub: verification, acceptance rules and the attach() API."""

from targets.api import Attached, attach

__all__ = ["Attached", "attach"]
