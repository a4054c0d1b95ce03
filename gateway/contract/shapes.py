"""Array values the policy reads only for their shape: their length and first element.

A body's 100k-token `input_ids` need not become 100k Python ints for the policy to know it
is one sequence (gateway/contract/jsonview.py). Such an array comes to the policy as a
`Head`, a plain object holding the length and the first element; a small body's arrays come
as the lists orjson built. The policy reads either through `length_of` and `first_of`, so
nothing can take a Head for the array it stands for: it has no len(), no indexing and no
iteration. (It once subclassed list and answered len() with the real length; compiled code
reads a list's length from its C struct and got 1.)
"""

from __future__ import annotations


class Head:
    """Stands for a JSON array: its length, and its first element (an array there is a Head
    or a list, read through the same helpers; None past the reader's depth)."""

    __slots__ = ("first", "length")

    def __init__(self, first: object, length: int) -> None:
        self.first = first
        self.length = length

    def __repr__(self) -> str:
        return f"Head({self.first!r}, {self.length})"


def length_of(value: object) -> int:
    """Elements of an array value, a list or a Head; -1 for a value that is no array."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, Head):
        return value.length
    return -1


def first_of(value: object) -> object:
    """The first element of an array value with at least one element (length_of > 0)."""
    if isinstance(value, Head):
        return value.first
    assert isinstance(value, list)
    return value[0]
