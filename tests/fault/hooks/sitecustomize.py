"""Installs the fault suite's phase tracer in a rank's background worker (see
``tierpoint_fault_phases``); does nothing unless ``TIERPOINT_FAULT_PHASES`` is set."""

import os

if os.environ.get("TIERPOINT_FAULT_PHASES"):
    import tierpoint_fault_phases

    tierpoint_fault_phases.install("worker")
