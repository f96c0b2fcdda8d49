"""Choosing a pipeline's layout: the planner (rank layouts from a profile and a measured link),
``plan="auto"`` and the ranking's report. Observing a run lives in :mod:`lightning_pipe.observe`."""

from lightning_pipe.plan.planner import Candidate, Link, format_plans, plan

__all__ = ["Candidate", "Link", "format_plans", "plan"]
