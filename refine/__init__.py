"""refine: prove a distributed training step refines its sequential model, or localize the bug.

    from refine import check_files
    report = check_files("seq.json", "dist.json")
    assert report.refines, report
"""

from refine.check import check, check_files
from refine.format import InputError
from refine.report import Report

__all__ = ["InputError", "Report", "check", "check_files"]
