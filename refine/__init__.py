"""refine: prove a distributed training step refines its sequential model, or localize the bug.

    from refine import check_files
    report = check_files("seq.json", "dist.json")
    assert report.refines, report

    from refine import capture, check          # from real PyTorch code (refine.frontends.capture)
    report = check(*capture(spec))
"""

from typing import Any

from refine.check import check, check_files
from refine.ir.errors import InputError
from refine.verdict.report import Report

__all__ = ["InputError", "Report", "capture", "check", "check_files"]


def __getattr__(name: str) -> Any:
    # refine.frontends.capture imports torch's tracing machinery: load it only when asked for
    if name == "capture":
        import refine.frontends.capture as capture

        return capture
    raise AttributeError(f"module 'refine' has no attribute {name!r}")
