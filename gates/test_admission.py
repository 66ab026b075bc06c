"""Gate: the page pool's admission invariants (gates/admission_machine.py), over PagePool + Scheduler at three page sizes.

Settings come from the hypothesis profile that conftest.py loads (ci / dev / long).
"""
from __future__ import annotations

from .admission_machine import make_machine

# page_size 1: the smallest page the config accepts (a mutant refusing it survived the two sizes below)
AdmissionPage1 = make_machine(page_size=1)
AdmissionPage64 = make_machine(page_size=64)
AdmissionPage256 = make_machine(page_size=256)
TestAdmissionPage1 = AdmissionPage1.TestCase
TestAdmissionPage64 = AdmissionPage64.TestCase
TestAdmissionPage256 = AdmissionPage256.TestCase
