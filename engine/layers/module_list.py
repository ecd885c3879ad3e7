"""`ModuleListOf[M]`: an `nn.ModuleList` whose modules are all `M`s, so indexing and iterating it are typed.

At run time it is `nn.ModuleList` itself (a subclass that adds nothing: same registration, same
state-dict names, same indexing); only a type checker sees the item type, where a plain ModuleList
gives `Module` and every attribute of an item would need a cast.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar, overload

from torch import nn

M = TypeVar("M", bound=nn.Module)


class ModuleListOf(nn.ModuleList, Generic[M]):
    def __init__(self, modules: Iterable[M] | None = None) -> None:
        super().__init__(modules)

    if TYPE_CHECKING:  # declarations only: nn.ModuleList's own methods run

        @overload
        def __getitem__(self, idx: slice) -> ModuleListOf[M]: ...
        @overload
        def __getitem__(self, idx: int) -> M: ...
        def __getitem__(self, idx: int | slice) -> M | ModuleListOf[M]: ...

        def __iter__(self) -> Iterator[M]: ...
