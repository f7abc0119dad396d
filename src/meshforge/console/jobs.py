"""The fleet's jobs: a list with progress, one job's per-node states, and cancel.

Reads and cancels through ``JobStore``, the code behind ``meshforge ctl job status`` and
``ctl job cancel``. Jobs belong to sites, not tenants: a console bound to a tenant has none.
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from meshforge.console.auth import User, audit
from meshforge.console.web import action, console_of, flash, fragment, page, render, see_other
from meshforge.control.jobs import TERMINAL, JobStore
from meshforge.control.rollout import job_report
from meshforge.errors import MeshForgeError
from meshforge.topology.subjects import validate_token

__all__ = ["routes"]

# The list shows the newest jobs only: each one costs a read of its nodes' states.
MAX_JOBS = 50


def _job_name(request: Request) -> str:
    """The job of the path, once the console is known to see jobs at all."""
    if console_of(request).tenant is not None:
        raise MeshForgeError("jobs belong to sites, not tenants: this console is bound to one")
    return validate_token(request.path_params["job"], "job")


def _progress(report: dict[str, Any]) -> dict[str, Any]:
    """The report with how many nodes are done (any terminal state) out of its targets."""
    done = sum(n for state, n in report["counts"].items() if state in TERMINAL)
    return {**report, "done": done}


async def _store(request: Request) -> JobStore | None:
    """The jobs bucket, or None before the first job (a page never creates it)."""
    try:
        return await JobStore.open(console_of(request).connection.js, create=False)
    except MeshForgeError:
        return None


@page
async def list_page(request: Request) -> Response:
    if console_of(request).tenant is not None:
        raise MeshForgeError("jobs belong to sites, not tenants: this console is bound to one")
    store = await _store(request)
    rows = []
    if store is not None:
        specs = (await store.jobs())[-MAX_JOBS:]
        for spec in reversed(specs):  # newest first
            rows.append(_progress(await job_report(store, spec.job)))
    name = "_jobs.html" if fragment(request) else "jobs.html"
    return render(request, name, {"jobs": rows, "max_jobs": MAX_JOBS})


@page
async def job_page(request: Request) -> Response:
    job = _job_name(request)
    store = await JobStore.open(console_of(request).connection.js, create=False)
    report = _progress(await job_report(store, job))
    name = "_job.html" if fragment(request) else "job.html"
    return render(request, name, {"job": report})


@action
async def cancel(request: Request, user: User, form: FormData) -> Response:
    job = _job_name(request)
    store = await JobStore.open(console_of(request).connection.js, create=False)
    if form.get("confirm") != "yes":
        spec = await store.spec(job)  # a clear error for an unknown job, before asking
        context: dict[str, Any] = {
            "what": f"Cancel job {job}",
            "count": None,
            "detail": f"{spec.command} to {len(spec.targets)} node(s): nothing more is sent, "
            "and nodes answer CANCELED to its commands not yet run",
            "target": f"/jobs/{job}/cancel",
            "fields": {"confirm": "yes"},
            "button": "Cancel the job",
            "back": "Keep it running",
            "back_url": f"/jobs/{job}",
        }
        return render(request, "confirm.html", context)
    await store.cancel(job)
    audit(user, f"canceled job {job}")
    flash(request, f"job {job} canceled: unsent commands will not be sent")
    return see_other(f"/jobs/{job}")


routes = [
    Route("/jobs", list_page),
    Route("/jobs/{job}", job_page),
    Route("/jobs/{job}/cancel", cancel, methods=["POST"]),
]
