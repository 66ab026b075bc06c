"""Gate: the page pool's admission invariants (gates/admission_machine.py), over PagePool + Scheduler at two page sizes.

Settings come from the hypothesis profile that conftest.py loads (ci / dev / long).
"""
from __future__ import annotations

from .admission_machine import make_machine

AdmissionPage64 = make_machine(page_size=64)
AdmissionPage256 = make_machine(page_size=256)
TestAdmissionPage64 = AdmissionPage64.TestCase
TestAdmissionPage256 = AdmissionPage256.TestCase
