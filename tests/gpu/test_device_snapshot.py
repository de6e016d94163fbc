"""The device snapshot with CUDA states: given the save's plan, the CUDA tensors land in one buffer
laid out as the part file's data section (one copy to host memory), the CPU ones copied over their
places after it."""

from __future__ import annotations

import torch

from tierpoint import fileformat
from tierpoint.device_snapshot import DeviceSnapshot
from tierpoint.staging import copy_planned, planned_view
from tierpoint.tree import flatten

from .helpers import DEVICE, cuda_still_works, model_state, needs_gpu

pytestmark = needs_gpu


def test_the_cuda_tensors_form_an_image_of_the_data_section_and_copy_in_one_piece():
    state = model_state(5)  # CUDA weights and moments, CPU step counters
    flat = flatten(state)
    plan = fileformat.plan_part(flat, {"iteration": 5})
    snap = DeviceSnapshot()
    copies, ticket = snap.take(flat.tensors, wait=5, plan=plan)
    image = ticket.image
    assert image is not None and image.device.type == DEVICE  # the GPU's, not the CPU counters'
    assert image.numel() == plan.data_size
    for k, t in enumerate(flat.tensors):
        if t.device.type == DEVICE:
            assert torch.equal(planned_view(image, plan, k), t)
    host = torch.zeros(plan.data_size, dtype=torch.uint8)
    copy_planned(flatten(state), plan, host, pinned=False, image=image)
    ticket.release()
    for k, t in enumerate(flat.tensors):
        assert torch.equal(planned_view(host, plan, k), t.cpu())
    again, ticket = snap.take(flat.tensors, wait=5, plan=plan)  # a steady save: nothing made
    assert all(a is b for a, b in zip(again, copies)) and ticket.image is image
    ticket.release()
    snap.close()
    cuda_still_works()
