"""Test-wide settings: Triton runs under its CPU interpreter when no GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported anywhere, so the kernels run on the CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def skip_backward_deferral(monkeypatch):
    """A function that, called, makes dcp skip its last step, the backward deferral
    (``with_deferred_backward`` returns the plan it is given) for the rest of the test."""

    def skip():
        from dcp_modules import set_dcp

        set_dcp(monkeypatch, "with_deferred_backward", lambda tiles, placement, *args, **kwargs: placement)

    return skip


@pytest.fixture
def skip_replan(monkeypatch):
    """A function that, called, switches off dcp's re-plans for the rest of the test: with the
    overlap-aware balancer (both of its thresholds, several nodes and one node, and the duplex and unpriced
    ones that follow it) and with memory slack."""

    def skip():
        from dcp_modules import set_dcp

        for name in ("REPLAN_FROM", "REPLAN_FROM_ONE_NODE"):
            set_dcp(monkeypatch, name, float("inf"))
        set_dcp(monkeypatch, "MEMORY_REPLAN", False)

    return skip


@pytest.fixture
def skip_deal_pass(monkeypatch):
    """A function that, called, switches off dcp's deal pass (homes with heavy document pieces dealt over
    their node's ranks, ``DEAL_PASS_FROM``) for the rest of the test."""

    def skip():
        from dcp_modules import set_dcp

        set_dcp(monkeypatch, "DEAL_PASS_FROM", float("inf"))

    return skip


@pytest.fixture
def skip_level_pass(monkeypatch):
    """A function that, called, switches off dcp's leveling pass (the kept homes balanced again with each
    node over the cap leveling its own ranks, ``LEVEL_PASS``) for the rest of the test."""

    def skip():
        from dcp_modules import set_dcp

        set_dcp(monkeypatch, "LEVEL_PASS", False)

    return skip


@pytest.fixture
def skip_polish(monkeypatch):
    """A function that, called, switches off dcp's forward and backward polish (planner/polish.py,
    planner/polish_bwd.py: the last steps on the kept plan) for the rest of the test: for tests that
    measure what one earlier pass gains."""

    def skip():
        from dcp_modules import set_dcp

        for name in ("polish_forward", "polish_backward"):
            set_dcp(monkeypatch, name, lambda tiles, placement, **kwargs: placement)

    return skip


@pytest.fixture
def skip_fcp_plan(monkeypatch):
    """A function that, called, switches off dcp's last step, weighing the fcp strategy's own plan
    (``FCP_PLAN_LAST``), for the rest of the test: for tests that measure what one earlier pass gains."""
    def skip():
        from dcp_modules import set_dcp
        set_dcp(monkeypatch, "FCP_PLAN_LAST", False)
    return skip
