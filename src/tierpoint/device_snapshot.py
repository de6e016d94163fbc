"""A snapshot copied first into reused memory on the tensors' own devices, so that training may
change its state as soon as the save call returns.

Copying a 4.4 GB CUDA state to host memory takes 80 ms at the PCIe floor (an H100), and training
may not change the state meanwhile: a plain save blocks that long, an overlapped one makes the
optimizer step wait for the end of the copy (about 50 ms a save there). A copy within the GPU's
memory (a few ms for the same state: an H100 moves about 3 TB/s of reads and writes within it)
queued on the training stream frees the state at once, in the stream's order: the optimizer's
kernels queued after it run after it. The copy to host memory then reads this buffer in the
background.

Call order: :meth:`DeviceSnapshot.take` on the training thread when a save is requested. It waits
until the previous snapshot stopped reading the buffers (long done, normally), copies every tensor
into the buffer of its device (CUDA tensors: batched copies, one per dtype, queued on the thread's
current stream, no host wait; CPU tensors: copied at once) and returns the copies with a
:class:`Ticket`. Given the save's part plan, the tensors on the state's one GPU (or, without
one, its one device) are laid out as the plan's data section (:attr:`Ticket.image`): the snapshot
then moves them to host memory in one copy, not one per tensor (hundreds of calls on a thread that
competes with training for the GIL). The save's snapshot copies from them (its device copies wait
for the training stream, so for these copies), then calls :meth:`Ticket.release`, also when it
failed. :meth:`DeviceSnapshot.prepare` (a warm-up, optional) allocates the buffers ahead of the
first ``take``; :meth:`DeviceSnapshot.close` frees them.

Invariants: one snapshot at a time reads the buffers; a ticket whose buffers a later ``take`` took
over is void (:meth:`Ticket.check` raises), so a stale snapshot never copies another save's bytes;
the buffers and the copies viewing them are made again only on a layout change, after the previous
reader released them (a steady save allocates nothing). The cost is memory: as much as the state on
each of its devices (GPU memory for CUDA tensors; the data section's size for an image).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .errors import CheckpointingError
from .fileformat import PartPlan
from .snapshot_copy import copy_tensors, issue_copies

_ALIGN = 256
"""Byte alignment of each copy in a buffer (any dtype's, and CUDA's preferred)."""

Layout = tuple[tuple[torch.device, torch.dtype, tuple[int, ...]], ...]
LaidOut = PartPlan | Layout
"""What the buffers are laid out for: the plan (for an image; a plan made ``like`` it is the same
layout, known at once), or without one the tensors' layout."""

OVERWRITTEN = (
    "the device snapshot of this save was overwritten by a later save (a request that was not "
    "scheduled before the next save was requested): nothing written"
)


def _image_device(tensors: Sequence[torch.Tensor]) -> torch.device | None:
    """The device whose copies form the image: the one CUDA device holding tensors (CPU ones
    beside them are copied apart), else the one device of them all; None for several."""
    devices = {t.device for t in tensors if t.numel()}
    cuda = {d for d in devices if d.type == "cuda"}
    return (
        next(iter(cuda)) if len(cuda) == 1 else next(iter(devices)) if len(devices) == 1 else None
    )


def _layout_of(tensors: Sequence[torch.Tensor]) -> Layout:
    return tuple((t.device, t.dtype, tuple(t.shape)) for t in tensors)


class Ticket:
    """One save's claim on the buffers (see the module docstring)."""

    def __init__(self, owner: DeviceSnapshot, generation: int) -> None:
        self._owner = owner
        self._generation = generation
        self.image: torch.Tensor | None = None
        """The copies on one device as one uint8 buffer laid out as the plan's data section (the
        places of tensors on other devices unspecified), when ``take`` was given a plan and the
        state's CUDA tensors are on one GPU, or all its tensors on one device; else None."""

    @property
    def current(self) -> bool:
        """No later save took the buffers over (this snapshot's copies are still there)."""
        return self._owner.is_current(self._generation)

    def check(self) -> None:
        """Raise :data:`OVERWRITTEN` unless :attr:`current`."""
        if not self.current:
            raise CheckpointingError(OVERWRITTEN)

    def release(self) -> None:
        """The snapshot stopped reading the buffers (idempotent)."""
        self._owner.release(self._generation)


class DeviceSnapshot:
    """Reused buffers, one per device, holding the latest save's copy of the state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free = threading.Event()
        self._free.set()
        self._generation = 0
        self._laid_out: LaidOut | None = None
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._views: list[torch.Tensor] = []
        self._image: torch.Tensor | None = None
        # Indices of the tensors on each CUDA device, and of the others: fixed by the layout.
        self._on_devices: dict[torch.device, list[int]] = {}
        self._on_host: list[int] = []

    def take(
        self,
        tensors: Sequence[torch.Tensor],
        wait: float,
        void_unscheduled: bool = False,
        plan: PartPlan | None = None,
    ) -> tuple[list[torch.Tensor], Ticket]:
        """Copy ``tensors`` into the buffers (see the module docstring); ``wait``: seconds to wait
        for the previous reader; ``void_unscheduled``: the previous ticket's save was never
        scheduled, so nothing reads the buffers: take them over at once (that save is void);
        ``plan``: the part plan of ``tensors`` (in its order), for :attr:`Ticket.image`."""
        if not void_unscheduled and not self._free.wait(wait):
            raise CheckpointingError(
                f"the previous save's snapshot still reads the device snapshot after {wait:g} s"
            )
        with self._lock:
            self._generation += 1
            self._free.clear()
            ticket = Ticket(self, self._generation)
        try:
            copies = self._copies(tensors, plan)
            ticket.image = self._image
            with torch.no_grad():  # copy_ reads the data, not the autograd graph
                for device, ks in self._on_devices.items():
                    with torch.cuda.device(device):  # the current stream: the training thread's
                        issue_copies([tensors[k] for k in ks], [copies[k] for k in ks], True)
                if host := self._on_host:
                    copy_tensors([tensors[k] for k in host], [copies[k] for k in host], False)
        except BaseException:
            ticket.release()
            raise
        return copies, ticket

    def prepare(self, tensors: Sequence[torch.Tensor], plan: PartPlan | None = None) -> None:
        """Allocate (and touch) the buffers for ``tensors``' layout (and ``plan``, as ``take``
        would get it) ahead of the first ``take``; not while a snapshot reads them (the caller
        makes sure)."""
        if not self._fits(tensors, plan):
            self._copies(tensors, plan)
            for buf in self._buffers.values():
                buf.zero_()  # host pages faulted in now, not in the first save

    def _fits(self, tensors: Sequence[torch.Tensor], plan: PartPlan | None) -> bool:
        """The buffers are laid out for ``tensors`` (and ``plan``, their part plan)."""
        laid_out = self._laid_out
        if plan is not None:
            return isinstance(laid_out, PartPlan) and plan.same_layout_as(laid_out)
        return isinstance(laid_out, tuple) and laid_out == _layout_of(tensors)

    def _copies(self, tensors: Sequence[torch.Tensor], plan: PartPlan | None) -> list[torch.Tensor]:
        """A place for each tensor in its device's buffer: the buffers and these views are made
        on a layout change, and reused as they are until the next one."""
        if self._fits(tensors, plan):
            return list(self._views)
        image = None if plan is None else _image_device(tensors)
        offsets: list[int] = []
        sizes: dict[torch.device, int] = {}
        for k, t in enumerate(tensors):
            if t.device == image:
                assert plan is not None
                offsets.append(plan.offsets[k][0])
                sizes[t.device] = plan.data_size
                continue
            at = sizes.get(t.device, 0)
            offsets.append(at)
            sizes[t.device] = at + -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        # freed before the new ones are made (the memory is the cost); unusable until they are
        self._buffers, self._views, self._image, self._laid_out = {}, [], None, None
        self._on_devices, self._on_host = {}, []
        for k, t in enumerate(tensors):
            if t.device.type == "cuda":
                self._on_devices.setdefault(t.device, []).append(k)
            else:
                self._on_host.append(k)
        for d, n in sizes.items():
            try:
                self._buffers[d] = torch.empty(max(n, 1), dtype=torch.uint8, device=d)
            except (torch.OutOfMemoryError, RuntimeError) as e:
                self._buffers = {}
                raise CheckpointingError(
                    f"the device snapshot needs {n / 1e9:.2f} GB on {d} (a copy of the state there) "
                    f"and could not get it: {str(e).splitlines()[0]} - free that memory, or save "
                    "without device_snapshot=True"
                ) from e
        for t, at in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            if n == 0:
                self._views.append(torch.empty(t.shape, dtype=t.dtype, device=t.device))
            else:
                self._views.append(self._buffers[t.device][at : at + n].view(t.dtype).view(t.shape))
        self._image = (
            None if plan is None or image is None else self._buffers[image][: plan.data_size]
        )
        self._laid_out = plan if plan is not None else _layout_of(tensors)
        return list(self._views)

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold, all devices together (the memory this costs)."""
        return sum(b.numel() for b in self._buffers.values())

    def is_current(self, generation: int) -> bool:
        with self._lock:
            return generation == self._generation

    def release(self, generation: int) -> None:
        with self._lock:
            if generation == self._generation:
                self._free.set()

    def close(self) -> None:
        """Free the buffers (the next ``take`` makes new ones)."""
        with self._lock:
            self._buffers, self._views, self._image, self._laid_out = {}, [], None, None
