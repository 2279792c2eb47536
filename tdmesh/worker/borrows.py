"""Borrows on the worker: a value lent from one stream to another, and the events that order them.

``BorrowCreate`` runs on the lending stream (it takes the value and an event after the work
so far), ``BorrowFirstUse``/``BorrowLastUse`` on the borrowing one (it waits for that event,
then hands the value back with an event of its own), ``BorrowDrop`` on the lender again (it
waits for the hand-back): each stream keeps its own order, and neither runs ahead of the other.
"""

from __future__ import annotations

import torch

from ..errors import ProtocolViolation
from ..protocol import messages as m
from .streams import Stream
from .values import BorrowSlot, Poison, event_on


class Borrows(dict):
    """This worker's live borrows, by borrow id, and the stream work of each borrow message."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def add(self, msg: m.BorrowCreate) -> None:
        if msg.borrow in self:
            raise ProtocolViolation(f"borrow {msg.borrow} already exists on worker {self.rank}")
        self[msg.borrow] = BorrowSlot(msg)

    def slot(self, borrow: int) -> BorrowSlot:
        try:
            return self[borrow]
        except KeyError:
            raise ProtocolViolation(f"borrow {borrow} does not exist on worker {self.rank}") from None

    def create(self, msg: m.BorrowCreate, stream: Stream) -> None:
        slot = self[msg.borrow]
        try:
            slot.value = stream.env[msg.tensor]
        except KeyError:
            slot.value = Poison(-1, f"borrowed ref {msg.tensor} does not exist on stream {stream.id}")
        slot.event = event_on(stream)
        slot.created.set()

    def first_use(self, msg: m.BorrowFirstUse, stream: Stream) -> None:
        slot = self[msg.borrow]
        slot.created.wait()
        if slot.event is not None and stream.cuda is not None:
            stream.cuda.wait_event(slot.event)
        value = slot.value
        if isinstance(value, torch.Tensor) and stream.cuda is not None:
            value.record_stream(stream.cuda)  # the allocator must not reuse it while we read it
        stream.env[slot.msg.result] = value

    def last_use(self, msg: m.BorrowLastUse, stream: Stream) -> None:
        slot = self[msg.borrow]
        slot.last_event = event_on(stream)
        stream.env.pop(slot.msg.result, None)
        slot.released.set()

    def drop(self, msg: m.BorrowDrop, stream: Stream) -> None:
        slot = self[msg.borrow]
        slot.released.wait()
        if slot.last_event is not None and stream.cuda is not None:
            stream.cuda.wait_event(slot.last_event)
        del self[msg.borrow]
