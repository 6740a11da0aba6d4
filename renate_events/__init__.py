"""Renate-style continual learning (experience replay) on the event-driven ``trainer`` loop.

Subpackages:
    components: the seed's ``Component`` and the loss / reinitialisation components.
    memory: replay buffers stored in preallocated tensors.
"""

__version__ = "0.1.0.dev0"
